package commits

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/millrace/millrace/commitlog/layout"
	"github.com/millrace/millrace/internal/backoff"
	"github.com/millrace/millrace/internal/httpapi"
	commitspb "github.com/millrace/millrace/schemas/commits"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/subjects"
)

// APIKeyHeader is the gRPC metadata key (and HTTP header) that may carry
// an API key instead of "authorization: Bearer KEY".
const APIKeyHeader = httpapi.APIKeyHeader

// Server serves millrace.commits.v1.Commits over gRPC (Register) and as
// JSON and raw bodies over HTTP (Handler).
type Server struct {
	commitspb.UnimplementedCommitsServer

	cfg    Config
	js     jetstream.JetStream
	stream jetstream.Stream
	m      *Metrics
	log    *slog.Logger
	folded *folded // nil without a bucket
	index  *indexes
}

// New makes the edge on the COMMITS stream of js (streams.Apply creates
// it). The body limit must leave room for headers in the stream's largest
// message.
func New(ctx context.Context, cfg Config, js jetstream.JetStream, m *Metrics, log *slog.Logger) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	if js == nil {
		return nil, errors.New("commits: New needs JetStream")
	}
	st, err := js.Stream(ctx, subjects.StreamCommits)
	if err != nil {
		return nil, fmt.Errorf("commits: the %s stream: %w", subjects.StreamCommits, err)
	}
	if max := st.CachedInfo().Config.MaxMsgSize; max > 0 && int64(cfg.MaxBodyBytes)+64<<10 > int64(max) {
		return nil, fmt.Errorf("commits: MaxBodyBytes %d does not fit the %s stream's largest message (%d bytes) with 64 KiB for headers",
			cfg.MaxBodyBytes, subjects.StreamCommits, max)
	}
	if m == nil {
		m = NewMetrics(nil)
	}
	if log == nil {
		log = slog.Default()
	}
	s := &Server{cfg: cfg, js: js, stream: st, m: m, log: log}
	if cfg.Store != nil {
		s.folded = newFolded(cfg.Store, cfg.CacheBytes)
	}
	s.index = newIndexes(s, cfg.IndexWorlds)
	return s, nil
}

// Close stops following the worlds List opened.
func (s *Server) Close() { s.index.close() }

// Register adds the Commits service to a gRPC server.
func (s *Server) Register(g *grpc.Server) { commitspb.RegisterCommitsServer(g, s) }

// --- gRPC ---

// Put stores a new version of a document (see the package documentation).
func (s *Server) Put(ctx context.Context, req *commitspb.PutRequest) (*commitspb.PutResponse, error) {
	return track(s, "put", func() (*commitspb.PutResponse, error) {
		if err := s.authorize(grpcKey(ctx), req.GetWorld()); err != nil {
			return nil, err
		}
		return s.write(ctx, write{world: req.GetWorld(), id: req.GetId(), body: req.GetBody(),
			expected: req.ExpectedVersion, requestID: req.GetRequestId()})
	})
}

// Delete stores a tombstone.
func (s *Server) Delete(ctx context.Context, req *commitspb.DeleteRequest) (*commitspb.PutResponse, error) {
	return track(s, "delete", func() (*commitspb.PutResponse, error) {
		if err := s.authorize(grpcKey(ctx), req.GetWorld()); err != nil {
			return nil, err
		}
		return s.write(ctx, write{world: req.GetWorld(), id: req.GetId(), deleted: true,
			expected: req.ExpectedVersion, requestID: req.GetRequestId()})
	})
}

// Get returns the latest version of a document, or the one asked for.
func (s *Server) Get(ctx context.Context, req *commitspb.GetRequest) (*commitspb.Document, error) {
	return track(s, "get", func() (*commitspb.Document, error) {
		if err := s.authorize(grpcKey(ctx), req.GetWorld()); err != nil {
			return nil, err
		}
		return s.get(ctx, req.GetWorld(), req.GetId(), req.GetVersion())
	})
}

// History lists a document's versions, oldest first.
func (s *Server) History(ctx context.Context, req *commitspb.HistoryRequest) (*commitspb.HistoryResponse, error) {
	return track(s, "history", func() (*commitspb.HistoryResponse, error) {
		if err := s.authorize(grpcKey(ctx), req.GetWorld()); err != nil {
			return nil, err
		}
		return s.history(ctx, req.GetWorld(), req.GetId(), req.GetAfterVersion(), req.GetPageSize())
	})
}

// List names a world's live documents by id prefix, in id order.
func (s *Server) List(ctx context.Context, req *commitspb.ListRequest) (*commitspb.ListResponse, error) {
	return track(s, "list", func() (*commitspb.ListResponse, error) {
		if err := s.authorize(grpcKey(ctx), req.GetWorld()); err != nil {
			return nil, err
		}
		ids, entries, more, err := s.list(ctx, req.GetWorld(), req.GetPrefix(), req.GetAfterId(), req.GetPageSize())
		if err != nil {
			return nil, err
		}
		resp := &commitspb.ListResponse{Docs: make([]*commitspb.Entry, len(ids))}
		for i, id := range ids {
			e := entries[i]
			resp.Docs[i] = &commitspb.Entry{Id: id, Version: e.version, Size: e.size,
				CommittedAt: timestamppb.New(time.Unix(0, e.at))}
		}
		if more {
			resp.NextAfterId = ids[len(ids)-1]
		}
		return resp, nil
	})
}

// --- authentication ---

func grpcKey(ctx context.Context) string {
	md, _ := metadata.FromIncomingContext(ctx)
	first := func(v []string) string {
		if len(v) == 0 {
			return ""
		}
		return v[0]
	}
	return httpapi.APIKey(first(md.Get("authorization")), first(md.Get(APIKeyHeader)))
}

func (s *Server) authorize(key, world string) error {
	if key == "" {
		return status.Error(codes.Unauthenticated,
			"millrace: this API needs an API key: send \"authorization: Bearer KEY\" or \""+APIKeyHeader+": KEY\"")
	}
	known, allowed := s.cfg.Keys.allows(key, world)
	switch {
	case !known:
		return status.Error(codes.Unauthenticated, "millrace: the API key is not valid")
	case !allowed:
		return status.Errorf(codes.PermissionDenied, "millrace: this API key may not use world %q", world)
	}
	return nil
}

// --- writes ---

type write struct {
	world, id string
	body      []byte
	deleted   bool
	expected  *uint64
	requestID string
}

const maxRequestIDBytes = 256

func (s *Server) check(w write) error {
	if err := checkWorld(w.world); err != nil {
		return status.Errorf(codes.InvalidArgument, "millrace: %v", err)
	}
	if err := checkID(w.id); err != nil {
		return status.Errorf(codes.InvalidArgument, "millrace: %v", err)
	}
	if len(w.body) > s.cfg.MaxBodyBytes {
		return status.Error(codes.InvalidArgument, s.cfg.tooLarge(len(w.body)))
	}
	if len(w.requestID) > maxRequestIDBytes {
		return status.Errorf(codes.InvalidArgument, "millrace: the request id is %d bytes, more than %d", len(w.requestID), maxRequestIDBytes)
	}
	return nil
}

func (s *Server) write(ctx context.Context, w write) (*commitspb.PutResponse, error) {
	if err := s.check(w); err != nil {
		return nil, err
	}
	subject := subjects.Commits(w.world, w.id)
	kind := envelope.KindPut
	if w.deleted {
		kind = envelope.KindDelete
	}
	hdr := nats.Header{envelope.Schema: {envelope.SchemaCommitsV1}, envelope.Kind: {kind}}
	var msgID string
	if w.requestID != "" {
		// Hashed: ids are any UTF-8 up to 1 KiB, and the stream keeps
		// every message id of its duplicate window in memory.
		h := sha256.Sum256([]byte(w.world + "\x00" + w.id + "\x00" + w.requestID))
		msgID = "commits/" + hex.EncodeToString(h[:16])
		hdr.Set(envelope.MsgID, msgID)
	}
	// mine reports whether the document's current version is this very
	// write, stored by an earlier send of it: then the answer is that
	// version, as a duplicate, whatever compare-and-set would now say.
	mine := func(c last) bool { return msgID != "" && c.msgID == msgID }
	// The pause before a retry of a false conflict: 1, 2, 4... ms up to
	// 50 ms, jittered.
	pause := backoff.Backoff{Min: time.Millisecond, Max: 50 * time.Millisecond, Jitter: true}
	for attempt := 0; ; attempt++ {
		var want uint64
		if w.expected != nil {
			want = *w.expected
			if want == 0 {
				// "Must not exist": a tombstone is the version to replace.
				c, err := s.current(ctx, subject)
				if err != nil {
					return nil, unavailable(err)
				}
				switch {
				case mine(c):
					s.m.duplicates.Inc()
					return &commitspb.PutResponse{Version: c.version, Duplicate: true}, nil
				case c.version != 0 && !c.deleted:
					return nil, s.conflict(w, c.version, false)
				case c.version != 0:
					want = c.version
				}
			}
			hdr.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(want, 10))
		}
		ack, err := s.js.PublishMsg(ctx, &nats.Msg{Subject: subject, Header: hdr, Data: w.body})
		if err == nil {
			if ack.Duplicate {
				s.m.duplicates.Inc()
			}
			return &commitspb.PutResponse{Version: ack.Sequence, Duplicate: ack.Duplicate}, nil
		}
		if !isConflict(err) {
			return nil, unavailable(err)
		}
		c, rerr := s.current(ctx, subject)
		if rerr != nil {
			return nil, unavailable(rerr)
		}
		if mine(c) {
			s.m.duplicates.Inc()
			return &commitspb.PutResponse{Version: c.version, Duplicate: true}, nil
		}
		if c.version == want && attempt < s.cfg.ConflictRetries {
			// The server refused a write whose expected version is still
			// the current one: another write to the subject was in flight
			// (a replicated stream). Try again shortly.
			s.m.falseConflicts.Inc()
			if !pause.Wait(ctx) {
				return nil, status.FromContextError(ctx.Err()).Err()
			}
			continue
		}
		return nil, s.conflict(w, c.version, c.deleted)
	}
}

// conflict is the FAILED_PRECONDITION of a compare-and-set, with the
// current version in a Conflict detail.
func (s *Server) conflict(w write, current uint64, deleted bool) error {
	s.m.conflicts.Inc()
	what := fmt.Sprintf("version %d", current)
	switch {
	case current == 0:
		what = "no version (the document does not exist)"
	case deleted:
		what += " (a tombstone: the document is deleted)"
	}
	var expected uint64
	if w.expected != nil {
		expected = *w.expected
	}
	st := status.Newf(codes.FailedPrecondition, "millrace: conflict: the document %q of world %q is at %s, not at version %d",
		w.id, w.world, what, expected)
	if d, err := st.WithDetails(&commitspb.Conflict{CurrentVersion: current, Deleted: deleted}); err == nil {
		st = d
	}
	return st.Err()
}

// isConflict reports JetStream's "wrong last sequence": 10071, or 10164
// on a replicated stream.
func isConflict(err error) bool {
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		return false
	}
	return apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
		apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant
}

func invalid(err error) error {
	return status.Errorf(codes.InvalidArgument, "millrace: %v", err)
}

func unavailable(err error) error {
	if s, ok := status.FromError(err); ok && s.Code() != codes.Unknown {
		return err
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return status.FromContextError(err).Err()
	}
	return status.Errorf(codes.Unavailable, "millrace: the commit log is unavailable: %v", err)
}

// last is what compare-and-set needs of a document's current version.
type last struct {
	version uint64 // 0: the stream holds none
	deleted bool   // a tombstone
	msgID   string // the write's Nats-Msg-Id, if it had a request id
}

// current reads the subject's last version. COMMITS has no direct gets:
// this asks the stream leader.
func (s *Server) current(ctx context.Context, subject string) (last, error) {
	m, err := s.stream.GetLastMsgForSubject(ctx, subject)
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return last{}, nil
	case err != nil:
		return last{}, err
	}
	return last{version: m.Sequence, deleted: m.Header.Get(envelope.Kind) == envelope.KindDelete,
		msgID: m.Header.Get(envelope.MsgID)}, nil
}

// --- reads ---

func (s *Server) checkDoc(world, id string) error {
	if err := checkWorld(world); err != nil {
		return status.Errorf(codes.InvalidArgument, "millrace: %v", err)
	}
	if err := checkID(id); err != nil {
		return status.Errorf(codes.InvalidArgument, "millrace: %v", err)
	}
	return nil
}

func (s *Server) get(ctx context.Context, world, id string, version uint64) (*commitspb.Document, error) {
	if err := s.checkDoc(world, id); err != nil {
		return nil, err
	}
	subject := subjects.Commits(world, id)
	var (
		m   *jetstream.RawStreamMsg
		err error
	)
	if version == 0 {
		m, err = s.stream.GetLastMsgForSubject(ctx, subject)
	} else {
		m, err = s.stream.GetMsg(ctx, version)
		if err == nil && m.Subject != subject {
			return nil, status.Errorf(codes.NotFound, "millrace: version %d is not a version of document %q of world %q", version, id, world)
		}
	}
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return s.getFolded(ctx, world, id, version)
	case err != nil:
		return nil, unavailable(err)
	}
	doc := &commitspb.Document{World: world, Id: id, Version: m.Sequence, Body: m.Data,
		Deleted: m.Header.Get(envelope.Kind) == envelope.KindDelete, CommittedAt: timestamppb.New(m.Time)}
	return s.answer(doc, version)
}

// answer returns doc, unless the latest version was asked for and it is a
// tombstone.
func (s *Server) answer(doc *commitspb.Document, version uint64) (*commitspb.Document, error) {
	if version == 0 && doc.Deleted {
		return nil, status.Errorf(codes.NotFound, "millrace: document %q of world %q was deleted at version %d", doc.Id, doc.World, doc.Version)
	}
	return doc, nil
}

// getFolded looks for a version the stream does not hold in the bucket:
// the compactor deletes a version from the stream only after a checkpoint
// holds it.
func (s *Server) getFolded(ctx context.Context, world, id string, version uint64) (*commitspb.Document, error) {
	notFound := func() error {
		if version == 0 {
			return status.Errorf(codes.NotFound, "millrace: world %q has no document %q", world, id)
		}
		return status.Errorf(codes.NotFound, "millrace: version %d is not a version of document %q of world %q", version, id, world)
	}
	if s.folded == nil {
		return nil, notFound()
	}
	asked := time.Now()
	var (
		r    *layout.Record
		err  error
		what = "version"
	)
	if version == 0 {
		what = "latest"
		r, err = s.folded.latest(ctx, world, id, asked)
	} else {
		r, err = s.folded.version(ctx, world, id, version, asked)
	}
	if err != nil {
		return nil, unavailable(err)
	}
	if r == nil {
		return nil, notFound()
	}
	s.m.folded.WithLabelValues(what).Inc()
	doc := &commitspb.Document{World: world, Id: id, Version: r.Version, Body: r.Body,
		Deleted: r.Deleted, CommittedAt: timestamppb.New(r.Time)}
	return s.answer(doc, version)
}

func (s *Server) history(ctx context.Context, world, id string, after uint64, pageSize uint32) (*commitspb.HistoryResponse, error) {
	if err := s.checkDoc(world, id); err != nil {
		return nil, err
	}
	switch {
	case pageSize == 0:
		pageSize = defaultPageSize
	case pageSize > MaxPageSize:
		return nil, status.Errorf(codes.InvalidArgument, "millrace: page size %d is more than %d", pageSize, MaxPageSize)
	}
	subject := subjects.Commits(world, id)
	var page []*commitspb.Version
	next := after + 1
	for uint32(len(page)) < pageSize {
		m, err := s.stream.GetMsg(ctx, next, jetstream.WithGetMsgSubject(subject))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			break
		}
		if err != nil {
			return nil, unavailable(err)
		}
		page = append(page, &commitspb.Version{Version: m.Sequence, Size: uint32(len(m.Data)),
			Deleted: m.Header.Get(envelope.Kind) == envelope.KindDelete, CommittedAt: timestamppb.New(m.Time)})
		next = m.Sequence + 1
	}
	if s.folded != nil {
		// Versions folded out of the stream before it was read are in a
		// checkpoint read after that: merge the first pageSize of both.
		recs, _, err := s.folded.history(ctx, world, id, after, int(pageSize), time.Now())
		if err != nil {
			return nil, unavailable(err)
		}
		if len(recs) > 0 {
			s.m.folded.WithLabelValues("history").Inc()
			inStream := make(map[uint64]bool, len(page))
			for _, v := range page {
				inStream[v.Version] = true
			}
			for _, r := range recs {
				if !inStream[r.Version] {
					page = append(page, &commitspb.Version{Version: r.Version, Size: uint32(len(r.Body)),
						Deleted: r.Deleted, CommittedAt: timestamppb.New(r.Time)})
				}
			}
			slices.SortFunc(page, func(a, b *commitspb.Version) int { return cmp.Compare(a.Version, b.Version) })
		}
	}
	resp := &commitspb.HistoryResponse{Versions: page}
	if uint32(len(page)) >= pageSize {
		// A full page: there may be more.
		resp.Versions = page[:pageSize]
		resp.NextAfterVersion = resp.Versions[pageSize-1].Version
	}
	return resp, nil
}
