package testenv

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	osexec "os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/poll"
)

// ProcessCluster is a JetStream cluster of nats-server processes on
// loopback, at NATS's stock settings (max_payload 1 MiB): the servers an
// operator runs, which a test kills with SIGKILL and starts again on the
// same store, as a host would lose one. The nats-server is the release
// go.mod pins, built once per test binary.
type ProcessCluster struct {
	t     testing.TB
	bin   string
	nodes []*natsNode
}

type natsNode struct {
	name, conf     string
	port, httpPort int
	mu             sync.Mutex
	cmd            *natsProc
	log            *syncLog
}

// natsProc is a running server.
type natsProc struct {
	cmd  *osexec.Cmd
	done chan struct{}
}

type syncLog struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *syncLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *syncLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

var (
	natsBinOnce sync.Once
	natsBin     string
	natsBinErr  error
)

// natsServerBinary builds the nats-server of go.mod's version.
func natsServerBinary(t testing.TB) string {
	t.Helper()
	natsBinOnce.Do(func() {
		dir, err := os.MkdirTemp("", "nats-server-bin-")
		if err != nil {
			natsBinErr = err
			return
		}
		natsBin = filepath.Join(dir, "nats-server")
		cmd := osexec.Command("go", "build", "-o", natsBin, "github.com/nats-io/nats-server/v2")
		cmd.Dir = repoRoot()
		if out, err := cmd.CombinedOutput(); err != nil {
			natsBinErr = fmt.Errorf("go build nats-server: %v\n%s", err, out)
		}
	})
	if natsBinErr != nil {
		t.Fatal(natsBinErr)
	}
	return natsBin
}

// NATSProcesses starts n nats-server processes clustered over loopback
// routes, each with its store under the test's temporary directory, and
// waits until every one reports itself healthy (JetStream current).
func NATSProcesses(t testing.TB, n int) *ProcessCluster {
	t.Helper()
	c := &ProcessCluster{t: t, bin: natsServerBinary(t)}
	free := func() int {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		return l.Addr().(*net.TCPAddr).Port
	}
	routePorts := make([]int, n)
	routes := make([]string, n)
	for i := range routePorts {
		routePorts[i] = free()
		routes[i] = fmt.Sprintf("nats-route://127.0.0.1:%d", routePorts[i])
	}
	name := randomName("c")
	dir := t.TempDir()
	for i := range n {
		nd := &natsNode{name: fmt.Sprintf("%s-n%d", name, i+1), port: free(), httpPort: free()}
		nd.conf = filepath.Join(dir, nd.name+".conf")
		conf := fmt.Sprintf(`server_name: %q
listen: "127.0.0.1:%d"
http: "127.0.0.1:%d"
jetstream { store_dir: %q }
cluster {
  name: %q
  listen: "127.0.0.1:%d"
  routes: [%s]
}
`, nd.name, nd.port, nd.httpPort, filepath.Join(dir, nd.name), name, routePorts[i], strings.Join(routes, ", "))
		if err := os.WriteFile(nd.conf, []byte(conf), 0o600); err != nil {
			t.Fatal(err)
		}
		c.nodes = append(c.nodes, nd)
	}
	for i := range c.nodes {
		c.start(i)
	}
	t.Cleanup(func() {
		for i := range c.nodes {
			c.Kill(i)
		}
	})
	for i := range c.nodes {
		c.WaitHealthy(i)
	}
	return c
}

// URL lists every node's client URL, for a client to fail over between.
func (c *ProcessCluster) URL() string {
	urls := make([]string, len(c.nodes))
	for i, nd := range c.nodes {
		urls[i] = fmt.Sprintf("nats://127.0.0.1:%d", nd.port)
	}
	return strings.Join(urls, ",")
}

// Name is node i's server name (a stream's leader is named so).
func (c *ProcessCluster) Name(i int) string { return c.nodes[i].name }

// Index is the node named name, or -1.
func (c *ProcessCluster) Index(name string) int {
	for i, nd := range c.nodes {
		if nd.name == name {
			return i
		}
	}
	return -1
}

func (c *ProcessCluster) start(i int) {
	c.t.Helper()
	nd := c.nodes[i]
	nd.mu.Lock()
	defer nd.mu.Unlock()
	if nd.cmd != nil {
		c.t.Fatalf("nats node %s is running", nd.name)
	}
	if nd.log == nil {
		nd.log = &syncLog{}
	}
	cmd := osexec.Command(c.bin, "-c", nd.conf)
	cmd.Stdout, cmd.Stderr = nd.log, nd.log
	if err := cmd.Start(); err != nil {
		c.t.Fatalf("nats node %s: %v", nd.name, err)
	}
	e := &natsProc{cmd: cmd, done: make(chan struct{})}
	go func() { cmd.Wait(); close(e.done) }()
	nd.cmd = e
}

// Start starts nodes again on their stores after Kill, then waits until
// each is healthy (a node alone is not: it waits for a quorum, so nodes
// that must come back together start together).
func (c *ProcessCluster) Start(nodes ...int) {
	c.t.Helper()
	for _, i := range nodes {
		c.start(i)
	}
	for _, i := range nodes {
		c.WaitHealthy(i)
	}
}

// Kill ends node i with SIGKILL, as the loss of its host would, and waits
// for the process to be gone; a node not running is left alone.
func (c *ProcessCluster) Kill(i int) {
	nd := c.nodes[i]
	nd.mu.Lock()
	e := nd.cmd
	nd.cmd = nil
	nd.mu.Unlock()
	if e == nil {
		return
	}
	e.cmd.Process.Signal(syscall.SIGKILL)
	<-e.done
}

// WaitHealthy waits until node i's monitoring endpoint says it is healthy:
// connected to the cluster with its JetStream assets current.
func (c *ProcessCluster) WaitHealthy(i int) {
	c.t.Helper()
	nd := c.nodes[i]
	url := fmt.Sprintf("http://127.0.0.1:%d/healthz", nd.httpPort)
	poll.Until(c.t, "nats node "+nd.name+" healthy", func() bool {
		res, err := http.Get(url)
		if err != nil {
			return false
		}
		res.Body.Close()
		return res.StatusCode == http.StatusOK
	}, poll.Within(60*time.Second), poll.Every(100*time.Millisecond))
}

// Log is what node i printed.
func (c *ProcessCluster) Log(i int) string {
	nd := c.nodes[i]
	nd.mu.Lock()
	defer nd.mu.Unlock()
	if nd.log == nil {
		return ""
	}
	return nd.log.String()
}

// Leader is the index of the node leading stream, asked of the cluster
// through any node that answers.
func (c *ProcessCluster) Leader(ctx context.Context, stream string) (int, error) {
	nc, err := nats.Connect(c.URL(), nats.Timeout(2*time.Second))
	if err != nil {
		return -1, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return -1, err
	}
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return -1, err
	}
	info := s.CachedInfo()
	if info.Cluster == nil || info.Cluster.Leader == "" {
		return -1, fmt.Errorf("stream %s has no leader", stream)
	}
	return c.Index(info.Cluster.Leader), nil
}
