package fleet

import (
	"context"
	"math"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/millrace/millrace/schemas/envelope"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// MaxLivenessBatch is the most nodes in one LivenessBatch message; a pool
// with more heard in one flush gets several (about 0.5 MB each at typical
// id lengths, well under the backbone's max payload).
const MaxLivenessBatch = 10000

// liveness is one node heard since the last flush.
type liveness struct {
	sess     *session
	key      nodeKey
	session  string
	lastSeen int64
}

// flushLiveness publishes the nodes heard from since the last flush, one
// LivenessBatch per pool (chunked), and waits (bounded) for them to be
// stored. Heartbeats never become one message each.
func (s *Server) flushLiveness(ctx context.Context) {
	s.flushMu.Lock()
	defer s.flushMu.Unlock()
	s.liveMu.Lock()
	list := make([]liveness, len(s.heard))
	for i, sess := range s.heard {
		// Read under liveMu: a heartbeat after this point sees heard false
		// and goes into the next batch.
		sess.heard.Store(false)
		list[i] = liveness{sess: sess, key: sess.key, session: sess.id, lastSeen: sess.lastSeen.Load()}
	}
	clear(s.heard)
	s.heard = s.heard[:0]
	s.liveMu.Unlock()
	if len(list) == 0 {
		return
	}
	s.flushSeq++
	out := s.livenessBatches(list, s.now(), s.flushSeq)

	type pending struct {
		f   *streams.Future
		out livenessMsg
	}
	var futures []pending
	for _, o := range out {
		f, err := s.pub.PublishAsync(o.msg)
		if err != nil {
			s.m.publishErrors.WithLabelValues(kindLiveness).Inc()
			s.log.Warn("liveness batch not published", "subject", o.msg.Subject, "err", err)
			s.hearAgain(o.sessions)
			continue
		}
		futures = append(futures, pending{f: f, out: o})
	}
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), storeTimeout)
	defer cancel()
	for _, p := range futures {
		if _, err := p.f.Wait(wctx); err != nil {
			s.m.publishErrors.WithLabelValues(kindLiveness).Inc()
			s.log.Warn("liveness batch not stored", "err", err)
			s.hearAgain(p.out.sessions)
			continue
		}
		s.m.events.WithLabelValues(kindLiveness).Inc()
		s.m.livenessBatches.Inc()
		s.m.livenessNodes.Observe(float64(len(p.out.sessions)))
	}
}

// hearAgain puts the sessions of a batch that was not stored back among
// those heard, so that the next flush carries them (with the age of their
// last heartbeat, which has not moved). Without it a node whose batch was
// lost waited for its next heartbeat, and one in batches lost several
// flushes running (a backbone slow to store, under load) aged towards
// unreachable while it was heard all along. A batch that was stored after
// all (an acknowledgement that timed out) is harmless twice: last_seen
// only moves forward.
func (s *Server) hearAgain(sessions []*session) {
	s.liveMu.Lock()
	defer s.liveMu.Unlock()
	for _, sess := range sessions {
		if !sess.heard.Load() && !sess.isClosing() {
			sess.heard.Store(true)
			s.heard = append(s.heard, sess)
		}
	}
}

type livenessMsg struct {
	msg      *nats.Msg
	sessions []*session // the sessions it names
}

// livenessBatches groups list by pool, in order of first appearance, and
// chunks each pool at s.livenessChunk nodes. Ages are taken at observedAt.
func (s *Server) livenessBatches(list []liveness, observedAt time.Time, seq uint64) []livenessMsg {
	byPool := map[string][]*fleetpb.NodeAge{}
	sessByPool := map[string][]*session{}
	var pools []string
	at := observedAt.UnixNano()
	for _, l := range list {
		age := max(0, (at-l.lastSeen)/int64(time.Millisecond))
		if _, ok := byPool[l.key.pool]; !ok {
			pools = append(pools, l.key.pool)
		}
		byPool[l.key.pool] = append(byPool[l.key.pool], &fleetpb.NodeAge{
			NodeId:    l.key.node,
			SessionId: l.session,
			AgeMs:     uint32(min(age, math.MaxUint32)),
		})
		sessByPool[l.key.pool] = append(sessByPool[l.key.pool], l.sess)
	}
	ts := timestamppb.New(observedAt)
	prefix := s.cfg.GatewayID + "-" + s.nonce + "/live/" + strconv.FormatUint(seq, 10) + "/"
	var out []livenessMsg
	for _, pool := range pools {
		nodes, sessions := byPool[pool], sessByPool[pool]
		for chunk := 0; len(nodes) > 0; chunk++ {
			n := min(len(nodes), s.livenessChunk)
			data, err := proto.Marshal(&fleetpb.LivenessBatch{
				GatewayId:  s.cfg.GatewayID,
				Pool:       pool,
				ObservedAt: ts,
				Nodes:      nodes[:n],
			})
			if err != nil {
				panic(err)
			}
			out = append(out, livenessMsg{sessions: sessions[:n], msg: &nats.Msg{
				Subject: subjects.FleetLiveness(pool),
				Data:    data,
				Header: nats.Header{
					envelope.MsgID:   {prefix + subjects.Token(pool) + "/" + strconv.Itoa(chunk)},
					envelope.Schema:  {envelope.SchemaFleetV1},
					envelope.Kind:    {envelope.KindLiveness},
					envelope.Pool:    {pool},
					envelope.Gateway: {s.cfg.GatewayID},
				},
			}})
			nodes, sessions = nodes[n:], sessions[n:]
		}
	}
	return out
}

// resync republishes the Connected event of every session whose time has
// come, so that FLEET_NODES (kept for days) always holds the inventory of
// every live node. A full queue leaves the rest for the next tick.
func (s *Server) resync(now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, sess := range s.sessions {
		if !sess.established || now.Before(sess.resyncAt) || sess.isClosing() {
			continue
		}
		if !s.tryEnqueue(s.connectedEvent(sess, kindResync)) {
			return
		}
		sess.resyncAt = now.Add(jitter(s.cfg.ResyncEvery, 0.9, 1.1))
	}
}
