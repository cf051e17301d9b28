// Package httpapi holds what millrace's JSON-over-HTTP APIs share with
// their gRPC twins: the API key of a request, and gRPC status codes as
// HTTP statuses and JSON errors ({"error": "...", "code": "NOT_FOUND"}).
package httpapi

import (
	"encoding/json"
	"net/http"
	"strconv"
	"strings"

	rpccode "google.golang.org/genproto/googleapis/rpc/code"
	"google.golang.org/grpc/codes"
)

// APIKeyHeader is the gRPC metadata key and HTTP header that may carry an
// API key instead of "authorization: Bearer KEY".
const APIKeyHeader = "x-millrace-api-key"

// APIKey takes the key from an "authorization: Bearer KEY" value, else
// from the x-millrace-api-key one.
func APIKey(authorization, header string) string {
	if scheme, key, ok := strings.Cut(strings.TrimSpace(authorization), " "); ok && strings.EqualFold(scheme, "bearer") {
		return strings.TrimSpace(key)
	}
	return strings.TrimSpace(header)
}

// RequestKey is the API key of an HTTP request.
func RequestKey(r *http.Request) string {
	return APIKey(r.Header.Get("Authorization"), r.Header.Get(APIKeyHeader))
}

// WriteJSONError writes {"error": msg, "code": code} with httpCode.
func WriteJSONError(w http.ResponseWriter, httpCode int, code, msg string) {
	b, _ := json.Marshal(struct {
		Error string `json:"error"`
		Code  string `json:"code"`
	}{msg, code})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(httpCode)
	w.Write(b)
	w.Write([]byte("\n"))
}

// Status maps gRPC codes to HTTP statuses as Google's APIs do.
func Status(c codes.Code) int {
	switch c {
	case codes.OK:
		return http.StatusOK
	case codes.InvalidArgument, codes.FailedPrecondition, codes.OutOfRange:
		return http.StatusBadRequest
	case codes.Unauthenticated:
		return http.StatusUnauthorized
	case codes.PermissionDenied:
		return http.StatusForbidden
	case codes.NotFound:
		return http.StatusNotFound
	case codes.AlreadyExists, codes.Aborted:
		return http.StatusConflict
	case codes.ResourceExhausted:
		return http.StatusTooManyRequests
	case codes.Canceled:
		return 499 // client closed request
	case codes.Unimplemented:
		return http.StatusNotImplemented
	case codes.Unavailable:
		return http.StatusServiceUnavailable
	case codes.DeadlineExceeded:
		return http.StatusGatewayTimeout
	default:
		return http.StatusInternalServerError
	}
}

// CodeName is the canonical name of a code, as google.rpc.Code spells it
// ("CANCELLED", where gRPC's Go constant says Canceled), or CODE_n for a
// code it does not know.
func CodeName(c codes.Code) string {
	// A code of 2^31 or more turns negative, which no name has.
	if n, ok := rpccode.Code_name[int32(c)]; ok {
		return n
	}
	return "CODE_" + strconv.Itoa(int(c))
}
