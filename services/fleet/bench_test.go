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

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/millrace/millrace/internal/testenv"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/streams"
)

// BenchmarkSessions measures what a session costs the gateway. A child
// process (this test binary, running TestSessionClients) runs the
// JetStream server and the nodes, so that only the gateway is in this
// process; each node opens a session over TLS, sends a heartbeat and a
// status report (as live nodes do: the goroutines reach their working
// depth) and then idles. It reports Go heap + stacks and resident memory
// per session. FLEET_BENCH_SESSIONS sets the count (default 2000).
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
	dir := b.TempDir()
	ca, err := LoadOrCreateCA(dir)
	if err != nil {
		b.Fatal(err)
	}
	for range b.N {
		child := startChild(b, dir, n)
		bb := connectBackbone(b, child.natsURL)
		gw := startGateway(b, bb, Config{
			CA: ca, MaxSessions: n + 100, HandshakeRate: 1e6, HandshakeBurst: n + 100,
			HeartbeatInterval: time.Hour, FlushInterval: time.Minute,
		})
		before := sample()
		start := time.Now()
		child.say("sessions " + gw.addr)
		child.expect("ready")
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
		b.ReportMetric(float64(after.rss)/(1<<20), "process-rss-MiB")
		b.Logf("%d sessions: heap+stack %d B, stacks %d B, RSS %d B more", n,
			after.heapStack-before.heapStack, after.stack-before.stack, after.rss-before.rss)
		gw.stop()
		child.stop()
	}
}

// child is BenchmarkSessions's other process.
type child struct {
	b       *testing.B
	cmd     *exec.Cmd
	stdin   io.WriteCloser
	lines   *bufio.Scanner
	natsURL string
}

func startChild(b *testing.B, caDir string, n int) *child {
	cmd := exec.Command(os.Args[0], "-test.run=^TestSessionClients$")
	cmd.Env = append(os.Environ(), "FLEET_BENCH_CHILD=1", "FLEET_BENCH_CA="+caDir, "FLEET_BENCH_N="+strconv.Itoa(n))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	c := &child{b: b, cmd: cmd, stdin: stdin, lines: bufio.NewScanner(stdout)}
	b.Cleanup(c.stop)
	c.natsURL = strings.TrimPrefix(c.expect("nats "), "nats ")
	return c
}

// expect reads lines until one starts with prefix.
func (c *child) expect(prefix string) string {
	for c.lines.Scan() {
		if strings.HasPrefix(c.lines.Text(), prefix) {
			return c.lines.Text()
		}
		fmt.Fprintln(os.Stderr, "client process:", c.lines.Text())
	}
	c.cmd.Wait()
	c.b.Fatalf("the client process ended before saying %q", prefix)
	return ""
}

func (c *child) say(line string) { fmt.Fprintln(c.stdin, line) }

func (c *child) stop() {
	if c.stdin != nil {
		c.stdin.Close()
		c.stdin = nil
		c.cmd.Wait()
	}
}

// connectBackbone is newBackbone on a server elsewhere.
func connectBackbone(t testing.TB, url string) *backbone {
	t.Helper()
	nc, err := streams.Connect(url, t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(streams.DefaultMaxPending))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	return &backbone{nc: nc, js: js, pub: streams.NewPublisher(js, nil)}
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
	goroutines            int
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

// TestSessionClients is BenchmarkSessions's child process: it runs a
// JetStream server and says "nats <url>"; told "sessions <addr>", it
// opens FLEET_BENCH_N sessions there and says "ready"; it holds them until
// its stdin closes. Without FLEET_BENCH_CHILD it does nothing.
func TestSessionClients(t *testing.T) {
	if os.Getenv("FLEET_BENCH_CHILD") == "" {
		t.Skip("run by BenchmarkSessions")
	}
	n, _ := strconv.Atoi(os.Getenv("FLEET_BENCH_N"))
	dir := os.Getenv("FLEET_BENCH_CA")
	ca, err := LoadCA(filepath.Join(dir, CACertFile), filepath.Join(dir, CAKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	ns := testenv.NATS(t)
	fmt.Println("nats " + ns.ClientURL())
	in := bufio.NewScanner(os.Stdin)
	var addr string
	for in.Scan() {
		if a, ok := strings.CutPrefix(in.Text(), "sessions "); ok {
			addr = a
			break
		}
	}
	if addr == "" {
		return
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
		wg.Go(func() {
			for i := range next {
				if err := benchSession(ctx, ca, addr, i, conns); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			}
		})
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
	for in.Scan() {
	}
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
	if err := st.Send(helloMsg(benchHello(id, "bench"))); err != nil {
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
	if err := st.Send(benchStatus(2)); err != nil {
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

// benchHello is a typical node: eight GPUs and a few labels.
func benchHello(id, pool string) *fleetpb.Hello {
	h := &fleetpb.Hello{
		NodeId: id, Pool: pool, AgentVersion: "millrace-agent/1.4.2",
		Labels: map[string]string{
			"zone": "eu-west-1a", "rack": "r17", "instance-type": "p5.48xlarge",
			"driver": "550.54.15", "cuda": "12.4", "fabric": "ib-ndr",
		},
	}
	for i := range 8 {
		h.Gpus = append(h.Gpus, &fleetpb.Gpu{
			Index: uint32(i), Model: "NVIDIA H100 80GB HBM3", MemoryMib: 81559,
			Health: fleetpb.GpuHealth_GPU_HEALTH_OK, Uuid: fmt.Sprintf("GPU-3f1c2a9e-55d1-4c8a-9b7e-%012d", i),
		})
	}
	return h
}

func benchStatus(seq uint64) *fleetpb.NodeMessage {
	r := &fleetpb.StatusReport{Seq: seq, Conditions: []*fleetpb.Condition{
		{Type: "Ready", Status: true}, {Type: "DiskPressure", Status: false}, {Type: "NVLinkDegraded", Status: false},
	}}
	for i := range 8 {
		r.Gpus = append(r.Gpus, &fleetpb.GpuState{Index: uint32(i), Health: fleetpb.GpuHealth_GPU_HEALTH_OK})
		r.Gauges = append(r.Gauges, &fleetpb.GpuGauges{Index: uint32(i), Utilization: 0.87, TemperatureC: 64, MemoryUsedMib: 70000})
	}
	return &fleetpb.NodeMessage{Body: &fleetpb.NodeMessage_Status{Status: r}}
}
