package reservations

import (
	"context"
	"crypto/sha256"
	"encoding/base32"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/millrace/millrace/internal/httpapi"
	"github.com/millrace/millrace/schemas/envelope"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// APIKeyHeader is the gRPC metadata key (and HTTP header) that may carry
// an API key instead of "authorization: Bearer KEY".
const APIKeyHeader = httpapi.APIKeyHeader

// Server serves millrace.fleet.v1.Reservations over gRPC (Register) and as
// JSON over HTTP (Handler).
type Server struct {
	fleetpb.UnimplementedReservationsServer

	cfg     Config
	store   store
	pub     *streams.Publisher
	js      jetstream.JetStream
	m       *Metrics
	log     *slog.Logger
	sub     *nats.Subscription
	waiters waiters
	quotas  quotas

	closed    chan struct{}
	closeOnce sync.Once
}

// New makes the API on the fleet projections in pool and the FLEET_RESV
// stream in js. It subscribes on nc (core NATS) to every placement
// decision, once, to wake the Creates that wait; Close ends that.
func New(cfg Config, pool *pgxpool.Pool, js jetstream.JetStream, nc *nats.Conn, m *Metrics, log *slog.Logger) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if pool == nil || js == nil || nc == nil {
		return nil, errors.New("reservations: New needs a database pool, JetStream and a NATS connection")
	}
	if m == nil {
		m = NewMetrics(nil)
	}
	if log == nil {
		log = slog.Default()
	}
	s := &Server{
		cfg:     cfg.withDefaults(),
		store:   store{db: pool},
		pub:     streams.NewPublisher(js, nil),
		js:      js,
		m:       m,
		log:     log,
		waiters: waiters{byID: map[string]map[chan struct{}]struct{}{}},
		closed:  make(chan struct{}),
	}
	sub, err := nc.Subscribe(subjects.FleetPlaceFilter, s.onDecision)
	if err != nil {
		return nil, fmt.Errorf("reservations: subscribe to placement decisions: %w", err)
	}
	// A placement storm is hundreds of decisions a second and the handler
	// only looks one up in a map; the limits only guard memory.
	if err := sub.SetPendingLimits(1<<20, 256<<20); err != nil {
		sub.Unsubscribe()
		return nil, fmt.Errorf("reservations: subscription limits: %w", err)
	}
	// The server must know of the subscription before the first waiter
	// trusts it.
	if err := nc.FlushTimeout(10 * time.Second); err != nil {
		sub.Unsubscribe()
		return nil, fmt.Errorf("reservations: subscribe to placement decisions: %w", err)
	}
	s.sub = sub
	return s, nil
}

// Register adds the Reservations service to a gRPC server.
func (s *Server) Register(g *grpc.Server) { fleetpb.RegisterReservationsServer(g, s) }

// Close ends every wait in progress (those calls return the reservation as
// it is) and the decision subscription. Calls after Close are still served,
// without waiting. Call it before stopping the gRPC and HTTP servers so that
// their graceful stops do not sit out the waits.
func (s *Server) Close() {
	s.closeOnce.Do(func() {
		close(s.closed)
		if s.sub != nil {
			s.sub.Unsubscribe()
		}
	})
}

// --- gRPC ---

// Create requests a reservation (see the package documentation).
func (s *Server) Create(ctx context.Context, req *fleetpb.CreateReservationRequest) (*fleetpb.Reservation, error) {
	return track(s, "Create", "grpc", func() (*fleetpb.Reservation, error) {
		p, err := s.authenticate(grpcKey(ctx))
		if err != nil {
			return nil, err
		}
		return s.create(ctx, p, req)
	})
}

// Get returns one of the caller's reservations.
func (s *Server) Get(ctx context.Context, req *fleetpb.GetReservationRequest) (*fleetpb.Reservation, error) {
	return track(s, "Get", "grpc", func() (*fleetpb.Reservation, error) {
		p, err := s.authenticate(grpcKey(ctx))
		if err != nil {
			return nil, err
		}
		return s.get(ctx, p, req.GetId())
	})
}

// List pages through the caller's reservations.
func (s *Server) List(ctx context.Context, req *fleetpb.ListReservationsRequest) (*fleetpb.ListReservationsResponse, error) {
	return track(s, "List", "grpc", func() (*fleetpb.ListReservationsResponse, error) {
		p, err := s.authenticate(grpcKey(ctx))
		if err != nil {
			return nil, err
		}
		return s.list(ctx, p, req)
	})
}

// Cancel cancels one of the caller's reservations.
func (s *Server) Cancel(ctx context.Context, req *fleetpb.CancelReservationRequest) (*fleetpb.Reservation, error) {
	return track(s, "Cancel", "grpc", func() (*fleetpb.Reservation, error) {
		p, err := s.authenticate(grpcKey(ctx))
		if err != nil {
			return nil, err
		}
		return s.cancel(ctx, p, req.GetId())
	})
}

// track counts a call by method, transport and answer.
func track[T any](s *Server, method, transport string, f func() (T, error)) (T, error) {
	start := time.Now()
	v, err := f()
	s.m.request(method, transport, status.Code(err), time.Since(start))
	return v, err
}

// grpcKey finds the API key in the call's metadata.
func grpcKey(ctx context.Context) string {
	md, _ := metadata.FromIncomingContext(ctx)
	return httpapi.APIKey(first(md.Get("authorization")), first(md.Get(APIKeyHeader)))
}

func first(v []string) string {
	if len(v) == 0 {
		return ""
	}
	return v[0]
}

func (s *Server) authenticate(key string) (principal, error) {
	if key == "" {
		return principal{}, status.Error(codes.Unauthenticated,
			"millrace: this API needs an API key: send \"authorization: Bearer KEY\" or \""+APIKeyHeader+": KEY\"")
	}
	p, ok := s.cfg.Keys.Lookup(key)
	if !ok {
		return principal{}, status.Error(codes.Unauthenticated, "millrace: the API key is not valid")
	}
	return p, nil
}

func (p principal) checkPool(pool string) error {
	if p.allows(pool) {
		return nil
	}
	return status.Errorf(codes.PermissionDenied, "millrace: this API key may not use pool %q (it may use %s)", pool, strings.Join(p.pools, ", "))
}

// --- the calls, for both transports ---

// idEncoding keeps ids in the byte order of what they encode (a uuid v7
// sorts by time) and lower case.
var idEncoding = base32.HexEncoding.WithPadding(base32.NoPadding)

// requestReservationID is the id of the reservation that request_id asks
// for: the same owner and request_id always name the same reservation, and
// two owners' request_ids never collide (130 bits of SHA-256).
func requestReservationID(owner, requestID string) string {
	h := sha256.Sum256([]byte(owner + "\x00" + requestID))
	return "r-" + strings.ToLower(idEncoding.EncodeToString(h[:]))[:26]
}

// newReservationID is a random id, ordered by time like a uuid v7.
func newReservationID() string {
	u, err := uuid.NewV7()
	if err != nil {
		u = uuid.New()
	}
	return "r-" + strings.ToLower(idEncoding.EncodeToString(u[:]))
}

func (s *Server) create(ctx context.Context, p principal, req *fleetpb.CreateReservationRequest) (*fleetpb.Reservation, error) {
	if err := checkCreate(req, s.cfg.MaxWait); err != nil {
		return nil, err
	}
	spec := proto.Clone(req.GetSpec()).(*fleetpb.ReservationSpec)
	if err := p.checkPool(spec.GetPool()); err != nil {
		return nil, err
	}
	wait := req.GetWait().AsDuration() // 0 when not set

	var id string
	if req.GetRequestId() != "" {
		id = requestReservationID(p.owner, req.GetRequestId())
		r, err := s.store.get(ctx, id)
		if err != nil {
			return nil, s.dbError(ctx, "look up request_id", err)
		}
		if r != nil {
			if r.GetOwner() != p.owner || !proto.Equal(r.GetSpec(), spec) {
				return nil, requestIDConflict(req.GetRequestId(), id)
			}
			if wait <= 0 || r.GetState() != fleetpb.ReservationState_RESERVATION_STATE_PENDING {
				return r, nil
			}
			ch := s.waiters.add(id)
			defer s.waiters.remove(id, ch)
			return s.wait(ctx, r, ch, wait)
		}
	} else {
		id = newReservationID()
	}

	quota := s.quotas.of(p.owner)
	n, err := quota.open(ctx, s.cfg.RecountEvery, func(ctx context.Context) (int, error) {
		return s.store.countOpen(ctx, p.owner, s.cfg.MaxPendingPerOwner)
	})
	if err != nil {
		return nil, s.dbError(ctx, "count open reservations", err)
	}
	if n >= s.cfg.MaxPendingPerOwner {
		return nil, status.Errorf(codes.ResourceExhausted,
			"millrace: owner %q has %d reservations pending or placed, the limit; cancel some or wait until they are active", p.owner, n)
	}

	// The waiter is in place before the event is published, so no decision
	// can come between the two unseen.
	var ch chan struct{}
	if wait > 0 {
		ch = s.waiters.add(id)
		defer s.waiters.remove(id, ch)
	}
	now := time.Now()
	ev := &fleetpb.ReservationEvent{
		ReservationId: id,
		Owner:         p.owner,
		At:            timestamppb.New(now),
		Body: &fleetpb.ReservationEvent_Requested{Requested: &fleetpb.ReservationRequested{
			Spec: spec, RequestId: req.GetRequestId(),
		}},
	}
	ack, err := s.publish(ctx, id, "requested", spec.GetPool(), ev, req.GetRequestId() != "")
	if err != nil {
		return nil, err
	}
	created := now
	if ack.Duplicate {
		// The request_id's event is in the stream but not yet projected
		// (or the check above raced the projector): JetStream dropped this
		// publish as a resend of that event. Answer with what is stored,
		// or refuse when it asked for another spec.
		first, err := s.storedRequest(ctx, ack)
		if err != nil {
			return nil, err
		}
		if first.GetOwner() != p.owner || !proto.Equal(first.GetRequested().GetSpec(), spec) {
			return nil, requestIDConflict(req.GetRequestId(), id)
		}
		created = first.GetAt().AsTime()
	} else {
		quota.created()
	}
	view := &fleetpb.Reservation{
		Id: id, Spec: spec, State: fleetpb.ReservationState_RESERVATION_STATE_PENDING,
		Owner: p.owner, CreatedAt: timestamppb.New(created),
	}
	if wait <= 0 {
		return view, nil
	}
	return s.wait(ctx, view, ch, wait)
}

// requestIDConflict is the refusal of a request_id reused with another
// spec, the same whether the first Create is projected yet or not.
func requestIDConflict(requestID, id string) error {
	return status.Errorf(codes.AlreadyExists,
		"millrace: request_id %q was already used for reservation %s with another spec; use a new request_id for a new reservation", requestID, id)
}

// storedRequest reads the event a duplicate publish was dropped for: the
// ack of a duplicate names the sequence of the message stored first.
func (s *Server) storedRequest(ctx context.Context, ack *jetstream.PubAck) (*fleetpb.ReservationEvent, error) {
	rctx, cancel := context.WithTimeout(ctx, s.cfg.PublishTimeout)
	defer cancel()
	unavailable := func(err error) error {
		if ctx.Err() != nil {
			return status.FromContextError(ctx.Err()).Err()
		}
		s.log.Warn("stored reservation request not read", "stream", ack.Stream, "seq", ack.Sequence, "err", err)
		return status.Errorf(codes.Unavailable, "millrace: the reservation with this request_id is stored but could not be read back to compare; retry with the same request_id")
	}
	st, err := s.js.Stream(rctx, ack.Stream)
	if err != nil {
		return nil, unavailable(err)
	}
	m, err := st.GetMsg(rctx, ack.Sequence)
	if err != nil {
		return nil, unavailable(err)
	}
	ev := &fleetpb.ReservationEvent{}
	if err := proto.Unmarshal(m.Data, ev); err != nil || ev.GetRequested() == nil {
		// Only this API writes "<id>/requested"; anything else there is a
		// fault of the backbone, not of the caller.
		s.log.Error("stored reservation request does not decode", "stream", ack.Stream, "seq", ack.Sequence, "err", err)
		return nil, status.Errorf(codes.Internal, "millrace: the stored request of this request_id does not decode; tell the operators")
	}
	return ev, nil
}

// publish stores one reservation event and waits for JetStream's ack.
func (s *Server) publish(ctx context.Context, id, what, pool string, ev *fleetpb.ReservationEvent, retrySafe bool) (*jetstream.PubAck, error) {
	data, err := proto.Marshal(ev)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "millrace: encode reservation event: %v", err)
	}
	msg := &nats.Msg{Subject: subjects.FleetResv(pool), Data: data, Header: nats.Header{
		envelope.MsgID:       {id + "/" + what},
		envelope.Schema:      {envelope.SchemaFleetV1},
		envelope.Kind:        {envelope.KindReservation},
		envelope.Pool:        {pool},
		envelope.Reservation: {id},
	}}
	pctx, cancel := context.WithTimeout(ctx, s.cfg.PublishTimeout)
	defer cancel()
	ack, err := s.pub.PublishAck(pctx, msg)
	if err != nil {
		if ctx.Err() != nil {
			return nil, status.FromContextError(ctx.Err()).Err()
		}
		s.log.Warn("reservation event not stored", "reservation", id, "kind", what, "err", err)
		hint := "retry the call"
		switch {
		case what == "cancelled":
			hint = "retry the cancel"
		case retrySafe:
			hint = "retry with the same request_id"
		default:
			hint = "retry (set request_id so that a retry cannot create a second reservation)"
		}
		return nil, status.Errorf(codes.Unavailable, "millrace: the event backbone did not store the reservation %s; %s", what, hint)
	}
	return ack, nil
}

func (s *Server) get(ctx context.Context, p principal, id string) (*fleetpb.Reservation, error) {
	if err := checkID(id); err != nil {
		return nil, err
	}
	r, err := s.store.get(ctx, id)
	if err != nil {
		return nil, s.dbError(ctx, "read reservation", err)
	}
	if r == nil || r.GetOwner() != p.owner {
		// Another owner's reservation is not found either, so ids tell
		// nothing about other owners.
		return nil, status.Errorf(codes.NotFound,
			"millrace: reservation %q not found (a reservation shows here about a second after Create returned it)", id)
	}
	if err := p.checkPool(r.GetSpec().GetPool()); err != nil {
		return nil, err
	}
	return r, nil
}

func ended(st fleetpb.ReservationState) bool {
	return st == fleetpb.ReservationState_RESERVATION_STATE_CANCELLED || st == fleetpb.ReservationState_RESERVATION_STATE_FAILED
}

// cancel is idempotent: an ended reservation (cancelled or failed) comes
// back unchanged and nothing is published.
func (s *Server) cancel(ctx context.Context, p principal, id string) (*fleetpb.Reservation, error) {
	r, err := s.get(ctx, p, id)
	if err != nil {
		return nil, err
	}
	if ended(r.GetState()) {
		return r, nil
	}
	ev := &fleetpb.ReservationEvent{
		ReservationId: id,
		Owner:         p.owner,
		At:            timestamppb.Now(),
		Body:          &fleetpb.ReservationEvent_Cancelled{Cancelled: &fleetpb.ReservationCancelled{}},
	}
	if _, err := s.publish(ctx, id, "cancelled", r.GetSpec().GetPool(), ev, true); err != nil {
		return nil, err
	}
	// The cancel is stored; show it once the projector has applied it, or
	// the view as it is when that takes longer.
	if now := s.settle(ctx, id, func(r *fleetpb.Reservation) bool { return ended(r.GetState()) }); now != nil {
		return now, nil
	}
	return r, nil
}

func (s *Server) list(ctx context.Context, p principal, req *fleetpb.ListReservationsRequest) (*fleetpb.ListReservationsResponse, error) {
	if err := checkList(req); err != nil {
		return nil, err
	}
	if req.GetPool() != "" {
		if err := p.checkPool(req.GetPool()); err != nil {
			return nil, err
		}
	}
	q := listQuery{owner: p.owner, pool: req.GetPool(), state: stateName(req.GetState()), pools: p.pools, limit: DefaultPageSize}
	if n := int(req.GetPageSize()); n > 0 {
		q.limit = min(n, MaxPageSize)
	}
	filter := filterDigest(q.owner, q.pool, q.state)
	if tok := req.GetPageToken(); tok != "" {
		c, err := decodeToken(filter, tok)
		switch {
		case errors.Is(err, errFilterChanged):
			return nil, invalid("page_token belongs to a List with other pool or state filters; start again without page_token")
		case err != nil:
			return nil, invalid("page_token is not one this server issued; pass next_page_token of the previous page as it was")
		}
		q.after = c
	}
	rows, more, err := s.store.list(ctx, q)
	if err != nil {
		return nil, s.dbError(ctx, "list reservations", err)
	}
	resp := &fleetpb.ListReservationsResponse{Reservations: make([]*fleetpb.Reservation, len(rows))}
	for i, r := range rows {
		resp.Reservations[i] = r.r
	}
	if more {
		last := rows[len(rows)-1]
		resp.NextPageToken = encodeToken(filter, cursor{micros: last.requestedAt.UnixMicro(), id: last.r.GetId()})
	}
	return resp, nil
}

// dbError turns a failed read into a status a client can act on; the
// detail goes to the log, not to the client.
func (s *Server) dbError(ctx context.Context, what string, err error) error {
	if ctx.Err() != nil {
		return status.FromContextError(ctx.Err()).Err()
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) && (strings.HasPrefix(pe.Code, "42") || strings.HasPrefix(pe.Code, "22")) {
		// A missing table or column, or a value that does not convert:
		// retrying will not help.
		s.log.Error("reservations database error", "op", what, "err", err)
		return status.Errorf(codes.Internal, "millrace: %s failed on the server (SQLSTATE %s); tell the operators", what, pe.Code)
	}
	s.log.Warn("reservations database unavailable", "op", what, "err", err)
	return status.Errorf(codes.Unavailable, "millrace: the reservations database did not answer (%s); retry in a moment", what)
}
