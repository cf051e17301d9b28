package fleetsim

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/google/uuid"
	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/millrace/millrace/internal/tlsfiles"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// maxInFlight bounds the Reservations calls under way; a request due while
// that many are pending is skipped (and counted).
const maxInFlight = 256

// reserver makes reservations at a rate through the Reservations API and
// cancels each after the hold time.
type reserver struct {
	s      *sim
	conn   *grpc.ClientConn
	client fleetpb.ReservationsClient
	rnd    *rand.Rand
	wg     sync.WaitGroup

	mu     sync.Mutex
	closed bool
	timers map[*time.Timer]struct{}
}

func newReserver(s *sim) (*reserver, error) {
	c := s.cfg
	creds := insecure.NewCredentials()
	if c.ReservationsCA != "" {
		tc, err := tlsfiles.Client{CA: c.ReservationsCA}.Config()
		if err != nil {
			return nil, err
		}
		creds = credentials.NewTLS(tc)
	}
	conn, err := grpc.NewClient("passthrough:///"+c.ReservationsAddr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return nil, fmt.Errorf("reservations %s: %w", c.ReservationsAddr, err)
	}
	return &reserver{
		s: s, conn: conn, client: fleetpb.NewReservationsClient(conn),
		rnd: s.newRand(3), timers: map[*time.Timer]struct{}{},
	}, nil
}

func (r *reserver) authed(ctx context.Context) context.Context {
	if r.s.cfg.APIKey == "" {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+r.s.cfg.APIKey)
}

// spec is a random request: 1-8 GPUs on one node (80 %) or 1-2 whole
// nodes, of a model of the inventory (70 %) or any.
func (r *reserver) spec() *fleetpb.ReservationSpec {
	c := r.s.cfg
	sp := &fleetpb.ReservationSpec{Pool: c.Pool}
	if r.rnd.Float64() < 0.2 {
		sp.Nodes = 1 + uint32(r.rnd.IntN(2))
	} else {
		sp.Gpus = 1 + uint32(r.rnd.IntN(min(8, c.GPUsPerNode)))
	}
	if r.rnd.Float64() < 0.7 {
		sp.Model = c.Models[r.rnd.IntN(len(c.Models))].Name
	}
	return sp
}

// run makes reservations until ctx is done.
func (r *reserver) run(ctx context.Context) {
	lim := rate.NewLimiter(rate.Limit(r.s.cfg.ReservationRate), 1)
	sem := make(chan struct{}, maxInFlight)
	r.s.resvStarted(time.Now())
	for {
		if err := lim.Wait(ctx); err != nil {
			return
		}
		select {
		case sem <- struct{}{}:
		default:
			r.s.resvSkipped.Add(1)
			continue
		}
		sp := r.spec()
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			defer func() { <-sem }()
			r.create(ctx, sp)
		}()
	}
}

func (r *reserver) create(ctx context.Context, sp *fleetpb.ReservationSpec) {
	// A call under way when the load ends is let finish (close waits).
	cctx, cancel := context.WithTimeout(r.authed(context.WithoutCancel(ctx)), 30*time.Second)
	defer cancel()
	start := time.Now()
	res, err := r.client.Create(cctx, &fleetpb.CreateReservationRequest{Spec: sp, RequestId: uuid.NewString()})
	if err != nil {
		r.s.count(&r.s.createErrors, status.Code(err).String())
		r.s.errorf("create a reservation: %v", err)
		return
	}
	r.s.resvCreated.Add(1)
	r.s.createTime.Record(time.Since(start))
	if hold := r.s.cfg.ReservationHold; hold > 0 {
		id := res.GetId()
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.closed {
			return
		}
		var t *time.Timer
		t = time.AfterFunc(hold, func() {
			r.mu.Lock()
			_, live := r.timers[t]
			delete(r.timers, t)
			if live {
				r.wg.Add(1) // under mu: close has not started waiting
			}
			r.mu.Unlock()
			if live {
				defer r.wg.Done()
				r.cancel(id)
			}
		})
		r.timers[t] = struct{}{}
	}
}

func (r *reserver) cancel(id string) {
	ctx, cancel := context.WithTimeout(r.authed(context.Background()), 30*time.Second)
	defer cancel()
	if _, err := r.client.Cancel(ctx, &fleetpb.CancelReservationRequest{Id: id}); err != nil {
		r.s.count(&r.s.cancelErrors, status.Code(err).String())
		return
	}
	r.s.resvCancelled.Add(1)
}

// close stops the pending cancels (reservations still held stay), waits
// for the calls under way and closes the connection. run must have
// returned.
func (r *reserver) close() {
	r.mu.Lock()
	r.closed = true
	for t := range r.timers {
		t.Stop()
	}
	r.timers = map[*time.Timer]struct{}{}
	r.mu.Unlock()
	r.wg.Wait()
	r.conn.Close()
}
