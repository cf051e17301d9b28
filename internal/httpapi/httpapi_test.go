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
