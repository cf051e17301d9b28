package fleet

import (
	"encoding/json"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/millrace/millrace/schemas/envelope"
)

// FuzzDecode feeds message bodies, as they come from the network, to the
// body decoders and the in-memory fold: neither may panic, and whatever
// they accept must come out as rows PostgreSQL stores (valid UTF-8, no
// NUL, JSON that jsonb accepts, GPU indices that fit an int).
//
//	go test ./projectors/fleet -run '^$' -fuzz FuzzDecode -fuzztime 1m
func FuzzDecode(f *testing.F) {
	for _, m := range scenario().msgs {
		f.Add(m.data, m.hdr[envelope.Kind] == envelope.KindLiveness)
	}
	f.Fuzz(func(t *testing.T, data []byte, liveness bool) {
		ev := event{seq: 1, at: t0.Add(time.Hour)}
		var err error
		if liveness {
			ev.kind = kindLiveness
			ev.live, err = decodeLiveness(data)
		} else {
			ev.kind, ev.node, err = decodeNodeEvent(data)
		}
		if err != nil {
			return
		}
		fo := newFold(mustNew(Config{}).cfg)
		fo.mention(&ev)
		fo.hasClock, fo.clock = true, t0.Add(59*time.Minute)
		// Every node it names is known, in the event's own session, so that
		// every path of the fold runs.
		for _, id := range fo.order {
			fo.nodes[id] = &node{nodeKey: id, session: ev.node.GetSessionId(), connected: true,
				state: StateSuspect, stateSince: t0, lastSeen: t0}
		}
		fo.run([]event{ev})
		texts := append([]string(nil), fo.fast.id...)
		for _, id := range fo.order {
			n := fo.nodes[id]
			if fo.simple(id) {
				continue // its entry is in fo.fast
			}
			texts = append(texts, n.pool, n.id, n.session, n.gateway)
			for _, p := range []*string{n.labels, n.agent, n.statusHash, n.conditions} {
				if p != nil {
					texts = append(texts, *p)
				}
			}
			for _, js := range []*string{n.labels, n.conditions} {
				if js != nil && (!json.Valid([]byte(*js)) || strings.Contains(*js, `\u0000`)) {
					t.Fatalf("JSON jsonb would refuse: %s", *js)
				}
			}
			for _, d := range n.devices {
				texts = append(texts, d.model, d.uuid, d.health)
				if d.index > 1<<31-1 || d.memory > 1<<63-1 {
					t.Fatalf("device out of range: %+v", d)
				}
			}
			for i, h := range n.health {
				texts = append(texts, h)
				if i > 1<<31-1 {
					t.Fatalf("GPU index %d out of range", i)
				}
			}
			if n.state != StateHealthy && n.state != StateSuspect && n.state != StateUnreachable {
				t.Fatalf("state %q", n.state)
			}
		}
		for _, id := range fo.repIDs {
			r := fo.reports[id]
			texts = append(texts, id.alloc, id.node.pool, id.node.id, r.state, r.err)
		}
		for _, s := range texts {
			if !utf8.ValidString(s) || strings.ContainsRune(s, 0) {
				t.Fatalf("text not storable: %q", s)
			}
		}
	})
}
