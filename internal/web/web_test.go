package web

import (
	"context"
	"errors"
	"flag"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace/millrace/internal/envflag/envflagtest"
	"github.com/millrace/millrace/internal/keyfile"
	"github.com/millrace/millrace/internal/poll"
)

// options registers the server's flags and parses args.
func options(t *testing.T, args ...string) Options {
	t.Helper()
	var o Options
	envflagtest.Parse(t, func(fs *flag.FlagSet) { o.RegisterFlags(fs, "", "") }, args...)
	return o
}

// start starts the server on a fresh registry.
func start(ctx context.Context, o Options, mux *http.ServeMux) (*Server, error) {
	reg := prometheus.NewRegistry()
	return Start(ctx, o, mux, func(context.Context) error { return nil }, reg, keyfile.NewMetrics(reg), slog.Default())
}

// replaceFile writes path anew and renames it into place, as an operator's
// tooling or a secret mount does.
func replaceFile(t *testing.T, path, text string) {
	t.Helper()
	if err := os.WriteFile(path+".tmp", []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		t.Fatal(err)
	}
}

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
	bare := options(t, "-http-listen", "0.0.0.0:0")
	if _, err := start(ctx, bare, nil); err == nil ||
		!strings.Contains(err.Error(), "--http-console-keys-file") || !strings.Contains(err.Error(), "--http-metrics-token-file") {
		t.Fatalf("keyless HTTP on 0.0.0.0: %v", err)
	}

	o := options(t, "-http-listen", "0.0.0.0:0",
		"-http-console-keys-file", consoleKeys, "-http-metrics-token-file", metricsToken, "-http-max-conns", "3", "-http-idle-timeout", "7s")
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "console") })
	mux.HandleFunc("GET /v1/reservations", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "api") })
	web, err := start(ctx, o, mux)
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
	poll.Until(t, "key1 refused", func() bool { return get(t, base+"/", withBasic(key1)) == 401 })
	if got := get(t, base+"/", withBasic(key2)); got != 200 {
		t.Fatalf("key2 after rotation: %d", got)
	}

	if web.Server.IdleTimeout != 7*time.Second || web.Server.ReadHeaderTimeout <= 0 {
		t.Fatalf("idle timeout %v (want the flag's 7s), read header timeout %v", web.Server.IdleTimeout, web.Server.ReadHeaderTimeout)
	}
	// The connection cap: three held, a fourth is closed unanswered.
	http.DefaultClient.CloseIdleConnections()
	poll.Until(t, "idle connections closed", func() bool { return web.lis.Open() == 0 })
	var held []net.Conn
	for range 3 {
		c, err := net.Dial("tcp", "127.0.0.1:"+port)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	poll.Until(t, "three connections held", func() bool { return web.lis.Open() == 3 })
	c, err := net.Dial("tcp", "127.0.0.1:"+port)
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
	// Closed at once, not left unanswered until the deadline.
	if n, err := c.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("a fourth connection over --http-max-conns 3: read %d bytes, %v; want it closed", n, err)
	}
	c.Close()
	for _, c := range held {
		c.Close()
	}
}

// /readyz answers what ready says, /metrics the registry's metrics, on a
// loopback listener that needs no keys.
func TestReadyAndMetrics(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "web_test_total", Help: "A counter of the test."})
	reg.MustRegister(c)
	var down atomic.Bool
	ready := func(context.Context) error {
		if down.Load() {
			return errors.New("backbone disconnected")
		}
		return nil
	}
	web, err := Start(ctx, options(t, "-http-listen", "127.0.0.1:0"), nil, ready,
		reg, keyfile.NewMetrics(reg), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	go web.Serve(ctx)
	defer web.Stop(context.Background())
	base := "http://" + web.Addr().String()
	body := func(path string) (int, string) {
		res, err := http.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(b)
	}
	if code, b := body("/readyz"); code != 200 || b != "ready\n" {
		t.Fatalf("/readyz when ready: %d %q", code, b)
	}
	down.Store(true)
	if code, b := body("/readyz"); code != 503 || !strings.Contains(b, "not ready: backbone disconnected") {
		t.Fatalf("/readyz when not ready: %d %q", code, b)
	}
	c.Inc()
	if code, b := body("/metrics"); code != 200 || !strings.Contains(b, "web_test_total 1") {
		t.Fatalf("/metrics: %d %q", code, b)
	}
}
