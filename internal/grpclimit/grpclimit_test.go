package grpclimit

import (
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
)

func TestServerOptionsRefusesNegatives(t *testing.T) {
	for field, c := range map[string]Config{
		"HandshakeTimeout": {HandshakeTimeout: -time.Second},
		"KeepaliveTime":    {KeepaliveTime: -time.Second},
	} {
		if _, err := ServerOptions(c); err == nil || !strings.Contains(err.Error(), "grpclimit: "+field+" -1s is negative") {
			t.Errorf("%s negative: %v, want an error naming it", field, err)
		}
	}
}

// TestServerOptionsDefaults: a zero Config serves with the documented
// defaults; the streams per connection are read from what a client is
// told.
func TestServerOptionsDefaults(t *testing.T) {
	want := Config{MaxStreamsPerConn: DefaultMaxStreamsPerConn, HandshakeTimeout: DefaultHandshakeTimeout, KeepaliveTime: DefaultKeepaliveTime}
	if got := (Config{}).withDefaults(); got != want {
		t.Errorf("defaults %+v, want %+v", got, want)
	}
	opts, err := ServerOptions(Config{})
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(opts...)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go g.Serve(lis)
	t.Cleanup(g.Stop)
	n, err := ReadMaxStreams(lis.Addr().String())
	if err != nil || n != DefaultMaxStreamsPerConn {
		t.Errorf("max streams advertised %d (%v), want %d", n, err, DefaultMaxStreamsPerConn)
	}
}
