package main

import (
	"context"
	"log/slog"
	"testing"

	"github.com/millrace/millrace/internal/grpclimit"
	"github.com/millrace/millrace/services/commits"
	"github.com/millrace/millrace/services/reservations"
)

// The commits and reservations gRPC servers bound the streams of one
// connection, as the BES and fleet servers do.
func TestAPIServersCapStreamsPerConn(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	tel := newTelemetry()
	bb := testBackbone(t, tel)
	var co commits.Options
	parseFlags(t, co.RegisterFlags, "-commits-listen", "127.0.0.1:0", "-commits-api-keys", "*=0123456789abcdef0123")
	ce, err := commits.Start(ctx, co, bb, nil, tel.reg, tel.kf, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	go ce.Serve(ctx)
	defer ce.Stop(context.Background())
	if n, err := grpclimit.ReadMaxStreams(ce.Addr().String()); err != nil || n != grpclimit.DefaultMaxStreamsPerConn {
		t.Fatalf("commits: SETTINGS_MAX_CONCURRENT_STREAMS %d, %v; want %d", n, err, grpclimit.DefaultMaxStreamsPerConn)
	}
	var ro reservations.Options
	parseFlags(t, ro.RegisterFlags, "-reservations-listen", "127.0.0.1:0")
	rg, err := reservations.Start(ctx, ro, tel.reg, tel.kf, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	go rg.Serve(ctx)
	defer rg.Stop(context.Background())
	if n, err := grpclimit.ReadMaxStreams(rg.Addr().String()); err != nil || n != grpclimit.DefaultMaxStreamsPerConn {
		t.Fatalf("reservations: SETTINGS_MAX_CONCURRENT_STREAMS %d, %v; want %d", n, err, grpclimit.DefaultMaxStreamsPerConn)
	}
}
