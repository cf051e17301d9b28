package httpapi

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"google.golang.org/grpc/codes"
)

func TestAPIKey(t *testing.T) {
	for _, c := range []struct{ auth, header, want string }{
		{"Bearer k1", "", "k1"},
		{"bearer  k1 ", "k2", "k1"},
		{"Basic k1", "k2", "k2"},
		{"", " k2 ", "k2"},
		{"", "", ""},
	} {
		if got := APIKey(c.auth, c.header); got != c.want {
			t.Errorf("APIKey(%q, %q) = %q, want %q", c.auth, c.header, got, c.want)
		}
	}
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.Header.Set(APIKeyHeader, "k3")
	if got := RequestKey(r); got != "k3" {
		t.Errorf("RequestKey = %q, want k3", got)
	}
}

func TestStatusAndJSONError(t *testing.T) {
	for c, want := range map[codes.Code]int{
		codes.InvalidArgument: 400, codes.FailedPrecondition: 400, codes.Unauthenticated: 401, codes.PermissionDenied: 403,
		codes.NotFound: 404, codes.AlreadyExists: 409, codes.Aborted: 409, codes.ResourceExhausted: 429, codes.Unavailable: 503,
		codes.Internal: 500, codes.Canceled: 499,
	} {
		if got := Status(c); got != want {
			t.Errorf("Status(%v) = %d, want %d", c, got, want)
		}
	}
	w := httptest.NewRecorder()
	WriteJSONError(w, 404, CodeName(codes.NotFound), `no "x"`)
	if w.Code != 404 || w.Body.String() != `{"error":"no \"x\"","code":"NOT_FOUND"}`+"\n" || w.Header().Get("Content-Type") != "application/json" {
		t.Errorf("WriteJSONError: %d %q %v", w.Code, w.Body.String(), w.Header())
	}
}

// The names clients see in {"code": ...}: google.rpc.Code's, whatever
// gRPC's Go constants are called.
func TestCodeName(t *testing.T) {
	want := []string{"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
		"PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
		"INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"}
	for c, name := range want {
		if got := CodeName(codes.Code(c)); got != name {
			t.Errorf("CodeName(%d) = %q, want %q", c, got, name)
		}
	}
	for c, name := range map[codes.Code]string{17: "CODE_17", 1 << 31: "CODE_2147483648", 1<<32 - 1: "CODE_4294967295"} {
		if got := CodeName(c); got != name {
			t.Errorf("CodeName(%d) = %q, want %q", c, got, name)
		}
	}
}
