package fleet

import (
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
)

// TestHandshakeResultLabel: a refused session counts under result= its
// Refusal.code (fleet.proto's words, which nodes and runbooks see:
// "sessions_full"), not under a status code. No series of the gateway has
// a label named code: in every millrace series that label holds a status
// code spelt as google.rpc.Code, and a refusal code is not one.
func TestHandshakeResultLabel(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{MaxSessions: 1})
	gw.connect(t, "n1", "p")
	c := openSession(t, gw.nodeConn(t, nil, "n2", "p"), helloMsg(testHello("n2", "p")))
	r, err := c.refused()
	checkRefusal(t, r, err, CodeSessionsFull, codes.ResourceExhausted)
	if n := counter(t, gw.reg, "millrace_fleet_handshakes_total", CodeSessionsFull); n != 1 {
		t.Errorf("handshakes{result=%q} = %v, want 1", CodeSessionsFull, n)
	}
	if n := counter(t, gw.reg, "millrace_fleet_handshakes_total", "accepted"); n != 1 {
		t.Errorf("handshakes{result=accepted} = %v, want 1", n)
	}
	mfs, err := gw.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if !strings.HasPrefix(mf.GetName(), "millrace_fleet_") {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "code" {
					t.Errorf("%s has a code label (%s)", mf.GetName(), l.GetValue())
				}
			}
		}
	}
}
