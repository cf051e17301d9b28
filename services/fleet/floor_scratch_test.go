package fleet

import (
	"bufio"
	"net"
	"os"
	"os/exec"
	"strconv"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

type floorServer struct {
	fleetpb.UnimplementedGatewayServer
	open atomic.Int64
}

func (f *floorServer) Session(st fleetpb.Gateway_SessionServer) error {
	if _, err := st.Recv(); err != nil {
		return err
	}
	f.open.Add(1)
	defer f.open.Add(-1)
	st.Send(&fleetpb.GatewayMessage{Body: &fleetpb.GatewayMessage_Welcome{Welcome: &fleetpb.Welcome{}}})
	if os.Getenv("FLOOR_PAIR") != "" {
		done := make(chan error, 1)
		go func() {
			for {
				if _, err := st.Recv(); err != nil {
					done <- err
					return
				}
			}
		}()
		return <-done
	}
	for {
		if _, err := st.Recv(); err != nil {
			return err
		}
	}
}

func BenchmarkFloor(b *testing.B) {
	n := 2000
	dir := b.TempDir()
	ca, _ := LoadOrCreateCA(dir)
	tc, _ := ca.ServerTLS([]string{"127.0.0.1"})
	s, _ := New(Config{CA: ca, TLS: tc, GatewayID: "x"}, &gatedPublisher{}, nil, nil, nil)
	opts := s.ServerOptions()
	if os.Getenv("FLOOR_PLAIN") != "" {
		opts = opts[1:]
	}
	g := grpc.NewServer(opts...)
	fs := &floorServer{}
	fleetpb.RegisterGatewayServer(g, fs)
	lis, _ := net.Listen("tcp", "127.0.0.1:0")
	go g.Serve(lis)
	before := sample()
	cmd := exec.Command(os.Args[0], "-test.run=^TestSessionClients$")
	cmd.Env = append(os.Environ(), "FLEET_BENCH_ADDR="+lis.Addr().String(), "FLEET_BENCH_CA="+dir, "FLEET_BENCH_N="+strconv.Itoa(n))
	cmd.Stderr = os.Stderr
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Start()
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		if sc.Text() == "ready" {
			break
		}
	}
	after := sample()
	b.Logf("stacks: %s", stackHistogram())
	b.Logf("floor %d sessions (%d open): heap+stack %d B/session, stacks %d B/session, goroutines %d", n, fs.open.Load(),
		(after.heapStack-before.heapStack)/uint64(n), (after.stack-before.stack)/uint64(n), after.goroutines-before.goroutines)
	stdin.Close()
	cmd.Wait()
}
