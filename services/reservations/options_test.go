package reservations

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/envflag/envflagtest"
	"github.com/millrace/millrace/internal/poll"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

func parseOptions(t *testing.T, args ...string) Options {
	t.Helper()
	var o Options
	envflagtest.Parse(t, o.RegisterFlags, args...)
	return o
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// Load keeps the flags' fields and adds the keys: the configured ones, or
// else a development key kept in DevSecrets.
func TestOptionsLoad(t *testing.T) {
	o := parseOptions(t, "-fleet-api-keys", "ci="+aliceKey+",ops="+bobKey, "-fleet-max-wait", "7s", "-fleet-max-pending-per-owner", "3")
	c, err := o.Load(t.Context(), nil, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if c.Keys.Len() != 2 || c.MaxWait != 7*time.Second || c.MaxPendingPerOwner != 3 {
		t.Fatalf("%d keys, MaxWait %s, MaxPendingPerOwner %d", c.Keys.Len(), c.MaxWait, c.MaxPendingPerOwner)
	}

	o = parseOptions(t)
	o.DevSecrets = t.TempDir()
	if c, err = o.Load(t.Context(), nil, quiet); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(o.DevSecrets, "api-keys")); err != nil || c.Keys.Len() != 1 {
		t.Fatalf("without keys: %d keys, the development key file: %v", c.Keys.Len(), err)
	}
}

// A certificate without its key is a mistake in the command line.
func TestStartHalfPair(t *testing.T) {
	o := parseOptions(t, "-reservations-listen", "127.0.0.1:0", "-reservations-tls-cert", "server.crt")
	_, err := Start(t.Context(), o, nil, nil, nil)
	var usage envflag.UsageError
	if !errors.As(err, &usage) || usage.Msg != "--reservations-tls-cert and --reservations-tls-key go together" {
		t.Fatalf("got %v, want the usage error", err)
	}
}

// A started edge answers UNAVAILABLE over gRPC and HTTP until Run hands
// it the database; then Stop answers a Create waiting for its placement
// at once, with the reservation as it is, rather than sitting out its
// wait.
func TestStopAnswersWaitingCalls(t *testing.T) {
	e := newEnv(t, Config{})
	g, err := Start(t.Context(), parseOptions(t, "-reservations-listen", "127.0.0.1:0", "-fleet-api-keys", "alice="+aliceKey), nil, nil, quiet)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	g.Mount(mux)
	web := httptest.NewServer(mux)
	defer web.Close()
	served := make(chan error, 1)
	go func() { served <- g.Serve(context.Background()) }()
	conn, err := grpc.NewClient(g.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := fleetpb.NewReservationsClient(conn)

	if _, err := client.Get(as(t, aliceKey), &fleetpb.GetReservationRequest{Id: "r-none"}); status.Code(err) != codes.Unavailable {
		t.Fatalf("gRPC before Run: %v, want UNAVAILABLE", err)
	}
	req, _ := http.NewRequest("GET", web.URL+"/v1/reservations/r-none", nil)
	req.Header.Set("Authorization", "Bearer "+aliceKey)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("HTTP before Run: %d, want 503", res.StatusCode)
	}

	runCtx, stopRun := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- g.Run(runCtx, e.db, e.js, e.nc) }()
	poll.Until(t, "Run to hand the database over", func() bool { return g.late.s.Load() != nil })
	res2 := make(chan created, 1)
	go func() {
		r, err := client.Create(as(t, aliceKey), &fleetpb.CreateReservationRequest{Spec: spec("a100", 1), RequestId: "s", Wait: durationpb.New(longWait)})
		res2 <- created{r: r, err: err}
	}()
	id := requestReservationID("alice", "s")
	poll.Until(t, "the Create to wait", func() bool { return g.late.s.Load().waiters.has(id) }, poll.Within(20*time.Second))

	ctx, cancel := context.WithTimeout(context.Background(), longWait/5)
	defer cancel()
	if err := g.Stop(ctx); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if c := <-res2; c.err != nil || c.r.State != pending {
		t.Fatalf("the waiting Create: %v %v", c.r, c.err)
	}
	if err := <-served; err != nil {
		t.Fatalf("Serve: %v", err)
	}
	stopRun()
	if err := <-ran; err != nil {
		t.Fatalf("Run: %v", err)
	}
}
