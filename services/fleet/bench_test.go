package fleet

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// BenchmarkSessions measures what an idle session costs the gateway: a
// child process (this test binary, running TestSessionClients) opens the
// sessions over TLS, so only the gateway's side is in this process. It
// reports Go heap + stacks and resident memory per session (the embedded
// JetStream server is in this process too; it holds one small Connected
// event per session). FLEET_BENCH_SESSIONS sets the count (default 2000).
//
//	go test -run='^$' -bench=Sessions -benchtime=1x ./services/fleet/
func BenchmarkSessions(b *testing.B) {
	if os.Getenv("FLEET_BENCH_HEAPPROFILE") != "" {
		runtime.MemProfileRate = 512
	}
	n := 2000
	if v, err := strconv.Atoi(os.Getenv("FLEET_BENCH_SESSIONS")); err == nil && v > 0 {
		n = v
	}
	bb := newBackbone(b)
	dir := b.TempDir()
	ca, err := LoadOrCreateCA(dir)
	if err != nil {
		b.Fatal(err)
	}
	gw := startGateway(b, bb, Config{
		CA: ca, MaxSessions: n + 100, HandshakeRate: 1e6, HandshakeBurst: n + 100,
		HeartbeatInterval: time.Hour, FlushInterval: time.Minute,
	})
	for range b.N {
		before := sample()
		cmd := exec.Command(os.Args[0], "-test.run=^TestSessionClients$")
		cmd.Env = append(os.Environ(), "FLEET_BENCH_ADDR="+gw.addr, "FLEET_BENCH_CA="+dir, "FLEET_BENCH_N="+strconv.Itoa(n))
		cmd.Stderr = os.Stderr
		stdin, err := cmd.StdinPipe()
		if err != nil {
			b.Fatal(err)
		}
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			b.Fatal(err)
		}
		start := time.Now()
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		ready := false
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if sc.Text() == "ready" {
				ready = true
				break
			}
		}
		if !ready {
			cmd.Wait()
			b.Fatal("the client process did not open its sessions")
		}
		opened := time.Since(start)
		if got := gw.srv.Sessions(); got != n {
			b.Fatalf("%d sessions open, want %d", got, n)
		}
		after := sample()
		if f := os.Getenv("FLEET_BENCH_HEAPPROFILE"); f != "" {
			writeHeapProfile(b, f)
		}
		b.ReportMetric(float64(after.heapStack-before.heapStack)/float64(n), "heap+stack-B/session")
		b.ReportMetric(float64(after.stack-before.stack)/float64(n), "stack-B/session")
		b.ReportMetric(float64(after.rss-before.rss)/float64(n), "rss-B/session")
		b.ReportMetric(float64(after.goroutines-before.goroutines)/float64(n), "goroutines/session")
		b.ReportMetric(float64(n)/opened.Seconds(), "sessions/s")
		b.Logf("stacks: %s", stackHistogram())
		b.Logf("%d sessions: heap+stack %d B, stacks %d B, RSS %d B more", n,
			after.heapStack-before.heapStack, after.stack-before.stack, after.rss-before.rss)
		stdin.Close()
		go io.Copy(io.Discard, stdout)
		cmd.Wait()
		eventually(b, "sessions closed", func() bool { return gw.srv.Sessions() == 0 })
	}
}

func writeHeapProfile(b *testing.B, name string) {
	f, err := os.Create(name)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	if err := pprof.Lookup("heap").WriteTo(f, 0); err != nil {
		b.Fatal(err)
	}
}

type memSample struct {
	heapStack, stack, rss uint64
	goroutines     int
}

func sample() memSample {
	// Several collections: each may halve a goroutine's stack, as a
	// long-running gateway's collections do.
	for range 5 {
		runtime.GC()
	}
	debug.FreeOSMemory()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	s := memSample{heapStack: ms.HeapInuse + ms.StackInuse, stack: ms.StackInuse, goroutines: runtime.NumGoroutine()}
	if b, err := os.ReadFile("/proc/self/statm"); err == nil {
		if f := strings.Fields(string(b)); len(f) > 1 {
			pages, _ := strconv.ParseUint(f[1], 10, 64)
			s.rss = pages * uint64(os.Getpagesize())
		}
	}
	return s
}

// TestSessionClients is BenchmarkSessions's child process: it opens
// FLEET_BENCH_N sessions to FLEET_BENCH_ADDR, prints "ready", and holds
// them until its stdin closes. Without FLEET_BENCH_ADDR it does nothing.
func TestSessionClients(t *testing.T) {
	addr := os.Getenv("FLEET_BENCH_ADDR")
	if addr == "" {
		t.Skip("run by BenchmarkSessions")
	}
	n, _ := strconv.Atoi(os.Getenv("FLEET_BENCH_N"))
	dir := os.Getenv("FLEET_BENCH_CA")
	ca, err := LoadCA(filepath.Join(dir, CACertFile), filepath.Join(dir, CAKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	conns := make([]*grpc.ClientConn, n)
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
		next = make(chan int)
	)
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				if err := benchSession(ctx, ca, addr, i, conns); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			}
		}()
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	if len(errs) > 0 {
		t.Fatalf("%d sessions failed, first: %v", len(errs), errs[0])
	}
	fmt.Println("ready")
	io.Copy(io.Discard, os.Stdin)
	for _, c := range conns {
		c.Close()
	}
}

func benchSession(ctx context.Context, ca *CA, addr string, i int, conns []*grpc.ClientConn) error {
	id := "bench-" + strconv.Itoa(i)
	certPEM, keyPEM, err := ca.NodeCredentials(id, "bench")
	if err != nil {
		return err
	}
	tc, err := NodeTLS(ca.CertPEM(), certPEM, keyPEM)
	if err != nil {
		return err
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(tc)))
	if err != nil {
		return err
	}
	conns[i] = conn
	st, err := fleetpb.NewGatewayClient(conn).Session(ctx)
	if err != nil {
		return err
	}
	if err := st.Send(helloMsg(testHello(id, "bench"))); err != nil {
		return err
	}
	m, err := st.Recv()
	if err != nil {
		return err
	}
	if m.GetWelcome() == nil {
		return fmt.Errorf("session %d: %v", i, m)
	}
	// A heartbeat and a status report, as every live session sends: the
	// gateway's goroutines reach their working depth.
	if err := st.Send(&fleetpb.NodeMessage{Body: &fleetpb.NodeMessage_Heartbeat{Heartbeat: &fleetpb.Heartbeat{Seq: 1}}}); err != nil {
		return err
	}
	if err := st.Send(statusMsg(2, fleetpb.GpuHealth_GPU_HEALTH_OK, 0.5)); err != nil {
		return err
	}
	for range 2 {
		m, err := st.Recv()
		if err != nil {
			return err
		}
		if m.GetAck() == nil {
			return fmt.Errorf("session %d: %v", i, m)
		}
	}
	return nil
}
