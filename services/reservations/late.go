package reservations

import (
	"context"
	"fmt"
	"net/http"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// Late serves the API before its Server exists: a process that starts its
// edges before PostgreSQL answers (a development process, whose BES edge
// must serve within seconds of a restart) registers a Late on its gRPC
// server and HTTP mux at once and Sets the Server once the database is
// there (Edge does: Start, Mount, Run).
// Until then every call is UNAVAILABLE (HTTP 503 with Retry-After), which
// clients retry. The zero value is ready and waiting.
type Late struct {
	fleetpb.UnimplementedReservationsServer
	s atomic.Pointer[Server]
}

var errNoDatabaseYet = status.Error(codes.Unavailable, "the reservations API is waiting for its database; retry shortly")

// Set lets calls through to s.
func (l *Late) Set(s *Server) { l.s.Store(s) }

// Close closes the Server once Set (see Server.Close); before that it
// does nothing.
func (l *Late) Close() {
	if s := l.s.Load(); s != nil {
		s.Close()
	}
}

// Register serves the API on g and under /v1/reservations on mux; either
// may be nil.
func (l *Late) Register(g *grpc.Server, mux *http.ServeMux) {
	if g != nil {
		fleetpb.RegisterReservationsServer(g, l)
	}
	if mux != nil {
		mux.Handle("/v1/reservations", l)
		mux.Handle("/v1/reservations/", l)
	}
}

// Create is Server.Create once Set.
func (l *Late) Create(ctx context.Context, r *fleetpb.CreateReservationRequest) (*fleetpb.Reservation, error) {
	if s := l.s.Load(); s != nil {
		return s.Create(ctx, r)
	}
	return nil, errNoDatabaseYet
}

// Get is Server.Get once Set.
func (l *Late) Get(ctx context.Context, r *fleetpb.GetReservationRequest) (*fleetpb.Reservation, error) {
	if s := l.s.Load(); s != nil {
		return s.Get(ctx, r)
	}
	return nil, errNoDatabaseYet
}

// List is Server.List once Set.
func (l *Late) List(ctx context.Context, r *fleetpb.ListReservationsRequest) (*fleetpb.ListReservationsResponse, error) {
	if s := l.s.Load(); s != nil {
		return s.List(ctx, r)
	}
	return nil, errNoDatabaseYet
}

// Cancel is Server.Cancel once Set.
func (l *Late) Cancel(ctx context.Context, r *fleetpb.CancelReservationRequest) (*fleetpb.Reservation, error) {
	if s := l.s.Load(); s != nil {
		return s.Cancel(ctx, r)
	}
	return nil, errNoDatabaseYet
}

// ServeHTTP is Server.Handler once Set.
func (l *Late) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if s := l.s.Load(); s != nil {
		s.Handler().ServeHTTP(w, r)
		return
	}
	w.Header().Set("Retry-After", "2")
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusServiceUnavailable)
	fmt.Fprintln(w, `{"error": "the reservations API is waiting for its database; retry shortly", "code": "UNAVAILABLE"}`)
}
