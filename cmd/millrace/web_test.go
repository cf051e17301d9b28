package main

import (
	"context"
	"flag"
	"io"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/grpclimit"
	"github.com/millrace/millrace/services/commits"
	"github.com/millrace/millrace/services/reservations"
)

func get(t *testing.T, url string, setAuth func(*http.Request)) int {
	t.Helper()
	req, err := http.NewRequest("GET", url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if setAuth != nil {
		setAuth(req)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, res.Body)
	res.Body.Close()
	return res.StatusCode
}

func withBearer(tok string) func(*http.Request) {
	return func(r *http.Request) { r.Header.Set("Authorization", "Bearer "+tok) }
}

func withBasic(pw string) func(*http.Request) {
	return func(r *http.Request) { r.SetBasicAuth("me", pw) }
}

// On a listener other hosts can reach, the console needs a console key and
// /metrics a metrics token, while /healthz and /readyz answer anyone; the
// keys reload from their files; connections are capped.
func TestHTTPGuard(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dir := t.TempDir()
	consoleKeys, metricsToken := filepath.Join(dir, "console"), filepath.Join(dir, "metrics")
	const key1, key2, tok = "console-key-000000001", "console-key-000000002", "metrics-token-0000001"
	replaceFile(t, consoleKeys, key1+"\n")
	replaceFile(t, metricsToken, tok+"\n")

	// Without keys such a listener is refused, naming what is missing.
	var bare httpOptions
	parseFlags(t, func(fs *flag.FlagSet) { bare.register(fs, "", "") }, "-http-listen", "0.0.0.0:0")
	if _, err := startHTTP(ctx, bare, newTelemetry(), func(context.Context) error { return nil }, nil, slog.Default()); err == nil ||
		!strings.Contains(err.Error(), "--http-console-keys-file") || !strings.Contains(err.Error(), "--http-metrics-token-file") {
		t.Fatalf("keyless HTTP on 0.0.0.0: %v", err)
	}

	var o httpOptions
	parseFlags(t, func(fs *flag.FlagSet) { o.register(fs, "", "") }, "-http-listen", "0.0.0.0:0",
		"-http-console-keys-file", consoleKeys, "-http-metrics-token-file", metricsToken, "-http-max-conns", "3")
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "console") })
	mux.HandleFunc("GET /v1/reservations", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "api") })
	web, err := startHTTP(ctx, o, newTelemetry(), func(context.Context) error { return nil }, mux, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	go web.Serve(ctx)
	defer web.Stop(context.Background())
	_, port, _ := net.SplitHostPort(web.Addr().String())
	base := "http://127.0.0.1:" + port

	for _, c := range []struct {
		path string
		auth func(*http.Request)
		want int
	}{
		{"/healthz", nil, 200},
		{"/readyz", nil, 200},
		{"/v1/reservations", nil, 200}, // the API checks its own keys
		{"/metrics", nil, 401},
		{"/metrics", withBearer(key1), 401},
		{"/metrics", withBearer(tok), 200},
		{"/", nil, 401},
		{"/", withBearer(tok), 401},
		{"/", withBasic(key1), 200},
		{"/", withBearer(key1), 200},
		{"/", withBasic(key2), 401},
	} {
		if got := get(t, base+c.path, c.auth); got != c.want {
			t.Errorf("GET %s: %d, want %d", c.path, got, c.want)
		}
	}

	// Rotation: key2 replaces key1 in the file, with no restart.
	replaceFile(t, consoleKeys, key2+"\n")
	poll(t, "key1 refused", func() bool { return get(t, base+"/", withBasic(key1)) == 401 })
	if got := get(t, base+"/", withBasic(key2)); got != 200 {
		t.Fatalf("key2 after rotation: %d", got)
	}

	if web.Server.IdleTimeout <= 0 || web.Server.ReadHeaderTimeout <= 0 {
		t.Fatalf("idle timeout %v, read header timeout %v", web.Server.IdleTimeout, web.Server.ReadHeaderTimeout)
	}
	// The connection cap: three held, a fourth is closed unanswered.
	http.DefaultClient.CloseIdleConnections()
	poll(t, "idle connections closed", func() bool { return web.lis.Open() == 0 })
	var held []net.Conn
	for range 3 {
		c, err := net.Dial("tcp", "127.0.0.1:"+port)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	poll(t, "three connections held", func() bool { return web.lis.Open() == 3 })
	c, err := net.Dial("tcp", "127.0.0.1:"+port)
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
	if n, _ := c.Read(make([]byte, 1)); n != 0 {
		t.Fatal("a fourth connection was answered over --http-max-conns 3")
	}
	c.Close()
	for _, c := range held {
		c.Close()
	}
}

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
	rg, err := reservations.StartGRPC(ro, &reservations.Late{}, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	go rg.Serve(ctx)
	defer rg.Stop(context.Background())
	if n, err := grpclimit.ReadMaxStreams(rg.Addr().String()); err != nil || n != grpclimit.DefaultMaxStreamsPerConn {
		t.Fatalf("reservations: SETTINGS_MAX_CONCURRENT_STREAMS %d, %v; want %d", n, err, grpclimit.DefaultMaxStreamsPerConn)
	}
}
