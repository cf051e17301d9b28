package reservations

import (
	"errors"
	"io"
	"mime"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/internal/httpapi"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// Prefix is the path the HTTP API serves; mount Handler on both Prefix and
// Prefix+"/".
const Prefix = "/v1/reservations"

// Bodies are protojson with the .proto field names (request_id, not
// requestId); requests may use either spelling.
var (
	jsonOut = protojson.MarshalOptions{UseProtoNames: true}
	jsonIn  = protojson.UnmarshalOptions{}
)

// Handler serves the API as JSON over HTTP:
//
//	POST   /v1/reservations                 Create (body: CreateReservationRequest)
//	GET    /v1/reservations/{id}            Get
//	GET    /v1/reservations?pool=&state=&page_size=&page_token=   List
//	POST   /v1/reservations/{id}:cancel     Cancel
//	DELETE /v1/reservations/{id}            Cancel
//
// Errors are {"error": "...", "code": "INVALID_ARGUMENT"} with the HTTP
// status of the gRPC code (README.md).
func (s *Server) Handler() http.Handler { return http.HandlerFunc(s.serveHTTP) }

func (s *Server) serveHTTP(w http.ResponseWriter, r *http.Request) {
	rest, ok := strings.CutPrefix(r.URL.Path, Prefix)
	switch {
	case !ok:
		writeError(w, status.Errorf(codes.NotFound, "millrace: no such path %q; the API is under %s", r.URL.Path, Prefix))
	case rest == "" || rest == "/":
		switch r.Method {
		case http.MethodPost:
			s.httpCreate(w, r)
		case http.MethodGet:
			s.httpList(w, r)
		default:
			methodNotAllowed(w, r, "GET, POST")
		}
	default:
		seg := rest[1:]
		if rest[0] != '/' || seg == "" || strings.Contains(seg, "/") {
			writeError(w, status.Errorf(codes.NotFound, "millrace: no such path %q", r.URL.Path))
			return
		}
		if id, isCancel := strings.CutSuffix(seg, ":cancel"); isCancel {
			if r.Method != http.MethodPost {
				methodNotAllowed(w, r, "POST")
				return
			}
			s.httpCancel(w, r, id)
			return
		}
		switch r.Method {
		case http.MethodGet:
			s.httpGet(w, r, seg)
		case http.MethodDelete:
			s.httpCancel(w, r, seg)
		default:
			methodNotAllowed(w, r, "GET, DELETE")
		}
	}
}

func methodNotAllowed(w http.ResponseWriter, r *http.Request, allow string) {
	w.Header().Set("Allow", allow)
	httpapi.WriteJSONError(w, http.StatusMethodNotAllowed, "UNIMPLEMENTED",
		"millrace: "+r.Method+" is not allowed on "+r.URL.Path+"; use "+allow)
}

func httpKey(r *http.Request) string { return httpapi.RequestKey(r) }

func (s *Server) httpCreate(w http.ResponseWriter, r *http.Request) {
	res, err := track(s, "Create", "http", func() (*fleetpb.Reservation, error) {
		p, err := s.authenticate(httpKey(r))
		if err != nil {
			return nil, err
		}
		body, err := readBody(w, r)
		if err != nil {
			return nil, err
		}
		req, err := decodeCreateJSON(body)
		if err != nil {
			return nil, err
		}
		return s.create(r.Context(), p, req)
	})
	respond(w, res, err)
}

func (s *Server) httpGet(w http.ResponseWriter, r *http.Request, id string) {
	res, err := track(s, "Get", "http", func() (*fleetpb.Reservation, error) {
		p, err := s.authenticate(httpKey(r))
		if err != nil {
			return nil, err
		}
		return s.get(r.Context(), p, id)
	})
	respond(w, res, err)
}

func (s *Server) httpCancel(w http.ResponseWriter, r *http.Request, id string) {
	res, err := track(s, "Cancel", "http", func() (*fleetpb.Reservation, error) {
		p, err := s.authenticate(httpKey(r))
		if err != nil {
			return nil, err
		}
		// A body, if any, is ignored (some clients send "{}").
		if _, err := readBody(w, r); err != nil {
			return nil, err
		}
		return s.cancel(r.Context(), p, id)
	})
	respond(w, res, err)
}

func (s *Server) httpList(w http.ResponseWriter, r *http.Request) {
	res, err := track(s, "List", "http", func() (*fleetpb.ListReservationsResponse, error) {
		p, err := s.authenticate(httpKey(r))
		if err != nil {
			return nil, err
		}
		req, err := listRequest(r.URL.Query())
		if err != nil {
			return nil, err
		}
		return s.list(r.Context(), p, req)
	})
	respond(w, res, err)
}

var listParams = []string{"pool", "state", "page_size", "page_token"}

// listRequest reads List's query parameters. Unknown parameters are
// refused, so that a misspelt filter does not silently list everything.
func listRequest(q url.Values) (*fleetpb.ListReservationsRequest, error) {
	for k, v := range q {
		if !slices.Contains(listParams, k) {
			return nil, invalid("unknown query parameter %q; List takes %s", k, strings.Join(listParams, ", "))
		}
		if len(v) > 1 {
			return nil, invalid("query parameter %q is given %d times; give it once", k, len(v))
		}
	}
	req := &fleetpb.ListReservationsRequest{Pool: q.Get("pool"), PageToken: q.Get("page_token")}
	if v := q.Get("state"); v != "" {
		st, ok := parseState(v)
		if !ok {
			return nil, invalid("state %q is not a reservation state (PENDING, PLACED, ACTIVE, CANCELLED or FAILED)", v)
		}
		req.State = st
	}
	if v := q.Get("page_size"); v != "" {
		n, err := strconv.ParseUint(v, 10, 32)
		if err != nil {
			return nil, invalid("page_size %q is not a number from 1 to %d", v, MaxPageSize)
		}
		req.PageSize = uint32(n)
	}
	return req, nil
}

// parseState accepts "PENDING", "pending" or "RESERVATION_STATE_PENDING".
func parseState(v string) (fleetpb.ReservationState, bool) {
	v = strings.ToUpper(v)
	if !strings.HasPrefix(v, "RESERVATION_STATE_") {
		v = "RESERVATION_STATE_" + v
	}
	n, ok := fleetpb.ReservationState_value[v]
	return fleetpb.ReservationState(n), ok
}

// readBody reads at most MaxRequestBytes of a JSON body.
func readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	if ct := r.Header.Get("Content-Type"); ct != "" {
		mt, _, err := mime.ParseMediaType(ct)
		if err != nil || mt != "application/json" {
			return nil, errUnsupportedMedia
		}
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxRequestBytes))
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		return nil, errTooLarge
	case err != nil:
		return nil, status.Errorf(codes.Canceled, "millrace: reading the request body: %v", err)
	}
	return body, nil
}

// HTTP-only refusals, told apart from their gRPC codes by the status.
var (
	errTooLarge         = status.Errorf(codes.InvalidArgument, "millrace: the request body is larger than %d bytes", MaxRequestBytes)
	errUnsupportedMedia = status.Error(codes.InvalidArgument, "millrace: send the body as Content-Type: application/json")
)

// decodeCreateJSON reads a CreateReservationRequest from JSON. Unknown
// fields are refused so that a misspelt one (gpu for gpus) is not dropped
// in silence.
func decodeCreateJSON(body []byte) (*fleetpb.CreateReservationRequest, error) {
	if len(strings.TrimSpace(string(body))) == 0 {
		return nil, invalid(`the request body is empty; send a CreateReservationRequest, e.g. {"spec": {"pool": "a100", "gpus": 2}}`)
	}
	req := &fleetpb.CreateReservationRequest{}
	if err := jsonIn.Unmarshal(body, req); err != nil {
		return nil, invalid("the request body is not a CreateReservationRequest in JSON: %v", err)
	}
	return req, nil
}

func respond(w http.ResponseWriter, res proto.Message, err error) {
	if err != nil {
		writeError(w, err)
		return
	}
	b, err := jsonOut.Marshal(res)
	if err != nil {
		writeError(w, status.Errorf(codes.Internal, "millrace: encode response: %v", err))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	w.Write(b)
	w.Write([]byte("\n"))
}

func writeError(w http.ResponseWriter, err error) {
	st, ok := status.FromError(err)
	if !ok {
		st = status.New(codes.Internal, "millrace: "+err.Error())
	}
	code := httpapi.Status(st.Code())
	switch {
	case err == errTooLarge:
		code = http.StatusRequestEntityTooLarge
	case err == errUnsupportedMedia:
		code = http.StatusUnsupportedMediaType
	case st.Code() == codes.Unauthenticated:
		w.Header().Set("WWW-Authenticate", `Bearer realm="millrace"`)
	case st.Code() == codes.Unavailable || st.Code() == codes.ResourceExhausted:
		w.Header().Set("Retry-After", "1")
	}
	httpapi.WriteJSONError(w, code, httpapi.CodeName(st.Code()), st.Message())
}
