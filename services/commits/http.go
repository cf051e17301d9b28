package commits

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/millrace/millrace/internal/httpapi"
	commitspb "github.com/millrace/millrace/schemas/commits"
)

// Prefix is the path the HTTP API serves under.
const Prefix = "/v1/worlds/"

// Handler serves the API over HTTP. Document bodies travel as they are
// (any bytes), everything else as JSON:
//
//	PUT    /v1/worlds/{world}/docs/{id...}     Put: the request body is the document
//	GET    /v1/worlds/{world}/docs/{id...}     Get (?version=N for that version)
//	DELETE /v1/worlds/{world}/docs/{id...}     Delete
//	GET    /v1/worlds/{world}/history/{id...}  History (?after=N&page_size=M)
//	GET    /v1/worlds/{world}/docs             List (?prefix=P&after=ID&page_size=M)
//
// World and id are path-escaped (an id may hold '/', escaped or not).
// Compare-and-set: If-Match: "N" (the current version must be N) or
// If-None-Match: * (the document must not exist). Idempotency-Key is the
// request id. A Get answers the version in ETag and X-Millrace-Version.
// Errors are {"error": "...", "code": "..."}; a conflict is 409 with
// "current_version" and "deleted" added.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("PUT "+Prefix+"{world}/docs/{id...}", s.httpPut)
	mux.HandleFunc("DELETE "+Prefix+"{world}/docs/{id...}", s.httpDelete)
	mux.HandleFunc("GET "+Prefix+"{world}/docs/{id...}", s.httpGet)
	mux.HandleFunc("GET "+Prefix+"{world}/history/{id...}", s.httpHistory)
	mux.HandleFunc("GET "+Prefix+"{world}/docs", s.httpList)
	mux.HandleFunc(Prefix, func(w http.ResponseWriter, r *http.Request) {
		httpapi.WriteJSONError(w, http.StatusNotFound, httpapi.CodeName(codes.NotFound),
			"millrace: no such commits API path; see /v1/worlds/{world}/docs/{id} and /v1/worlds/{world}/history/{id}")
	})
	return mux
}

const (
	headerVersion = "X-Millrace-Version"
	headerDeleted = "X-Millrace-Deleted"
)

func (s *Server) httpPut(w http.ResponseWriter, r *http.Request) {
	res, err := track(s, "put", func() (*commitspb.PutResponse, error) {
		wr, err := s.httpWrite(w, r)
		if err != nil {
			return nil, err
		}
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, int64(s.cfg.MaxBodyBytes)))
		var tooBig *http.MaxBytesError
		switch {
		case errors.As(err, &tooBig):
			return nil, errTooLarge{s.cfg.tooLarge(-1)}
		case err != nil:
			return nil, status.Errorf(codes.Canceled, "millrace: reading the request body: %v", err)
		}
		wr.body = body
		return s.write(r.Context(), wr)
	})
	s.respondWrite(w, res, err)
}

func (s *Server) httpDelete(w http.ResponseWriter, r *http.Request) {
	res, err := track(s, "delete", func() (*commitspb.PutResponse, error) {
		wr, err := s.httpWrite(w, r)
		if err != nil {
			return nil, err
		}
		wr.deleted = true
		return s.write(r.Context(), wr)
	})
	s.respondWrite(w, res, err)
}

// httpWrite authenticates a PUT or DELETE and reads its path and
// conditions.
func (s *Server) httpWrite(w http.ResponseWriter, r *http.Request) (write, error) {
	wr := write{world: r.PathValue("world"), id: r.PathValue("id"), requestID: r.Header.Get("Idempotency-Key")}
	if err := s.authorize(httpapi.RequestKey(r), wr.world); err != nil {
		return wr, err
	}
	match, noneMatch := r.Header.Get("If-Match"), r.Header.Get("If-None-Match")
	switch {
	case match != "" && noneMatch != "":
		return wr, status.Error(codes.InvalidArgument, "millrace: send If-Match or If-None-Match, not both")
	case noneMatch != "":
		if strings.TrimSpace(noneMatch) != "*" {
			return wr, status.Error(codes.InvalidArgument, `millrace: If-None-Match takes only "*" (the document must not exist)`)
		}
		wr.expected = new(uint64)
	case match != "":
		v, err := strconv.ParseUint(strings.Trim(strings.TrimSpace(match), `"`), 10, 64)
		if err != nil {
			return wr, status.Errorf(codes.InvalidArgument, `millrace: If-Match takes one version, as "N": %q`, match)
		}
		wr.expected = &v
	}
	return wr, nil
}

// errTooLarge is a body over the limit: 413.
type errTooLarge struct{ msg string }

func (e errTooLarge) Error() string { return e.msg }

func (s *Server) respondWrite(w http.ResponseWriter, res *commitspb.PutResponse, err error) {
	if err != nil {
		writeError(w, err)
		return
	}
	w.Header().Set("ETag", etag(res.Version))
	writeJSON(w, http.StatusOK, map[string]any{"version": res.Version, "duplicate": res.Duplicate})
}

func (s *Server) httpGet(w http.ResponseWriter, r *http.Request) {
	doc, err := track(s, "get", func() (*commitspb.Document, error) {
		world := r.PathValue("world")
		if err := s.authorize(httpapi.RequestKey(r), world); err != nil {
			return nil, err
		}
		var version uint64
		if v := r.URL.Query().Get("version"); v != "" {
			n, err := strconv.ParseUint(v, 10, 64)
			if err != nil || n == 0 {
				return nil, status.Errorf(codes.InvalidArgument, "millrace: version %q is not a version (a number from 1)", v)
			}
			version = n
		}
		return s.get(r.Context(), world, r.PathValue("id"), version)
	})
	if err != nil {
		writeError(w, err)
		return
	}
	h := w.Header()
	h.Set("Content-Type", "application/octet-stream")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("ETag", etag(doc.Version))
	h.Set(headerVersion, strconv.FormatUint(doc.Version, 10))
	h.Set("Last-Modified", doc.CommittedAt.AsTime().UTC().Format(http.TimeFormat))
	if doc.Deleted {
		h.Set(headerDeleted, "true")
	}
	h.Set("Content-Length", strconv.Itoa(len(doc.Body)))
	w.WriteHeader(http.StatusOK)
	w.Write(doc.Body)
}

func (s *Server) httpHistory(w http.ResponseWriter, r *http.Request) {
	res, err := track(s, "history", func() (*commitspb.HistoryResponse, error) {
		world := r.PathValue("world")
		if err := s.authorize(httpapi.RequestKey(r), world); err != nil {
			return nil, err
		}
		q := r.URL.Query()
		var after uint64
		var size uint64
		if v := q.Get("after"); v != "" {
			n, err := strconv.ParseUint(v, 10, 64)
			if err != nil {
				return nil, status.Errorf(codes.InvalidArgument, "millrace: after=%q is not a version", v)
			}
			after = n
		}
		if v := q.Get("page_size"); v != "" {
			n, err := strconv.ParseUint(v, 10, 32)
			if err != nil {
				return nil, status.Errorf(codes.InvalidArgument, "millrace: page_size=%q is not a number", v)
			}
			size = n
		}
		return s.history(r.Context(), world, r.PathValue("id"), after, uint32(size))
	})
	if err != nil {
		writeError(w, err)
		return
	}
	type version struct {
		Version     uint64    `json:"version"`
		Deleted     bool      `json:"deleted,omitempty"`
		Size        uint32    `json:"size"`
		CommittedAt time.Time `json:"committed_at"`
	}
	out := struct {
		Versions         []version `json:"versions"`
		NextAfterVersion uint64    `json:"next_after_version,omitempty"`
	}{Versions: []version{}, NextAfterVersion: res.NextAfterVersion}
	for _, v := range res.Versions {
		out.Versions = append(out.Versions, version{v.Version, v.Deleted, v.Size, v.CommittedAt.AsTime().UTC()})
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) httpList(w http.ResponseWriter, r *http.Request) {
	type doc struct {
		ID          string    `json:"id"`
		Version     uint64    `json:"version"`
		Size        uint32    `json:"size"`
		CommittedAt time.Time `json:"committed_at"`
	}
	out := struct {
		Docs        []doc  `json:"docs"`
		NextAfterID string `json:"next_after_id,omitempty"`
	}{Docs: []doc{}}
	_, err := track(s, "list", func() (struct{}, error) {
		world := r.PathValue("world")
		if err := s.authorize(httpapi.RequestKey(r), world); err != nil {
			return struct{}{}, err
		}
		q := r.URL.Query()
		var size uint64
		if v := q.Get("page_size"); v != "" {
			n, err := strconv.ParseUint(v, 10, 32)
			if err != nil {
				return struct{}{}, status.Errorf(codes.InvalidArgument, "millrace: page_size=%q is not a number", v)
			}
			size = n
		}
		ids, entries, more, err := s.list(r.Context(), world, q.Get("prefix"), q.Get("after"), uint32(size))
		if err != nil {
			return struct{}{}, err
		}
		for i, id := range ids {
			e := entries[i]
			out.Docs = append(out.Docs, doc{id, e.version, e.size, time.Unix(0, e.at).UTC()})
		}
		if more {
			out.NextAfterID = ids[len(ids)-1]
		}
		return struct{}{}, nil
	})
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, out)
}

func etag(v uint64) string { return `"` + strconv.FormatUint(v, 10) + `"` }

func writeJSON(w http.ResponseWriter, code int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		writeError(w, status.Errorf(codes.Internal, "millrace: encode response: %v", err))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	w.Write(b)
	w.Write([]byte("\n"))
}

// writeError answers err as JSON: a conflict as 409 with the current
// version, a body over the limit as 413, the rest by their gRPC code.
func writeError(w http.ResponseWriter, err error) {
	var big errTooLarge
	if errors.As(err, &big) {
		httpapi.WriteJSONError(w, http.StatusRequestEntityTooLarge, httpapi.CodeName(codes.InvalidArgument), big.Error())
		return
	}
	st, ok := status.FromError(err)
	if !ok {
		st = status.New(codes.Internal, "millrace: "+err.Error())
	}
	switch st.Code() {
	case codes.FailedPrecondition:
		for _, d := range st.Details() {
			if c, ok := d.(*commitspb.Conflict); ok {
				writeJSON(w, http.StatusConflict, map[string]any{
					"error": st.Message(), "code": httpapi.CodeName(codes.FailedPrecondition),
					"current_version": c.CurrentVersion, "deleted": c.Deleted,
				})
				return
			}
		}
	case codes.Unauthenticated:
		w.Header().Set("WWW-Authenticate", `Bearer realm="millrace"`)
	case codes.Unavailable:
		w.Header().Set("Retry-After", "1")
	}
	httpapi.WriteJSONError(w, httpapi.Status(st.Code()), httpapi.CodeName(st.Code()), st.Message())
}
