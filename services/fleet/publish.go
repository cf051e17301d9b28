package fleet

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
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

// Publisher stores messages in JetStream. *streams.Publisher is one; the
// gateway needs nothing else from the backbone to publish.
type Publisher interface {
	PublishAsync(msg *nats.Msg) (*streams.Future, error)
}

// Event kinds, for metrics.
const (
	kindConnected    = "connected"
	kindResync       = "resync"
	kindDisconnected = "disconnected"
	kindStatus       = "status_changed"
	kindAllocation   = "allocation"
	kindLiveness     = "liveness"
)

// Disconnect reasons (NodeDisconnected.reason).
const (
	reasonClosed           = "closed"
	reasonHeartbeatTimeout = "heartbeat_timeout"
	reasonReplaced         = "replaced"
	reasonDraining         = "draining"
	reasonError            = "error"
	reasonRevoked          = "revoked"
)

const (
	// enqueueWait bounds how long a session goroutine waits for room in
	// the publish queue before it drops an event.
	enqueueWait = time.Second
	// storeTimeout bounds the wait for one store acknowledgement.
	storeTimeout = 30 * time.Second
)

var errStopped = errors.New("fleet: gateway stopped publishing")

// outgoing is one message for the backbone. Node events of the whole
// gateway go through one FIFO queue and one publishing goroutine, so a
// node's events are stored in the order they happened (a session's last
// events before its disconnect, a replaced session's disconnect before its
// successor's connect), and a session goroutine never blocks on a slow
// backbone for longer than enqueueWait.
type outgoing struct {
	msg  *nats.Msg // nil: a barrier, done when everything before it is
	kind string
	done chan error // nil, or buffered: the store's result
	// share is the sending session's share of the queue (enqueueOwn); a
	// token is taken back when the event is stored or fails.
	share chan struct{}
}

type inFlight struct {
	f *streams.Future
	o *outgoing
}

// tryEnqueue queues o unless the queue is full.
func (s *Server) tryEnqueue(o *outgoing) bool {
	select {
	case s.outbox <- o:
		return true
	default:
		return false
	}
}

// enqueue queues o, waiting up to enqueueWait for room; a dropped event is
// counted and logged.
func (s *Server) enqueue(o *outgoing) bool {
	if s.tryEnqueue(o) {
		return true
	}
	t := time.NewTimer(enqueueWait)
	defer t.Stop()
	select {
	case s.outbox <- o:
		return true
	case <-t.C:
		s.m.publishErrors.WithLabelValues(o.kind).Inc()
		s.log.Warn("publish queue full: event dropped", "kind", o.kind, "subject", o.msg.Subject)
		return false
	}
}

// publishLoop hands queued messages to the publisher in order and their
// futures to waitLoop.
func (s *Server) publishLoop(ctx context.Context, futures chan<- inFlight) {
	defer close(futures)
	for {
		select {
		case o := <-s.outbox:
			if o.msg == nil {
				futures <- inFlight{o: o}
				continue
			}
			f, err := s.pub.PublishAsync(o.msg)
			if err != nil {
				s.finish(o, err)
				continue
			}
			futures <- inFlight{f: f, o: o}
		case <-ctx.Done():
			for {
				select {
				case o := <-s.outbox:
					s.finish(o, errStopped)
				default:
					return
				}
			}
		}
	}
}

// waitLoop waits for each store acknowledgement in order.
func (s *Server) waitLoop(futures <-chan inFlight) {
	for in := range futures {
		var err error
		if in.f != nil {
			ctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
			_, err = in.f.Wait(ctx)
			cancel()
		}
		s.finish(in.o, err)
	}
}

func (s *Server) finish(o *outgoing, err error) {
	if o.share != nil {
		<-o.share
	}
	if o.msg != nil {
		if err != nil {
			s.m.publishErrors.WithLabelValues(o.kind).Inc()
			s.log.Warn("node event not stored", "kind", o.kind, "subject", o.msg.Subject, "err", err)
		} else {
			s.m.events.WithLabelValues(o.kind).Inc()
		}
	}
	if o.done != nil {
		o.done <- err
	}
}

// barrier waits until everything queued before it has been stored (or
// failed).
func (s *Server) barrier(ctx context.Context) error {
	o := &outgoing{done: make(chan error, 1)}
	select {
	case s.outbox <- o:
	case <-s.runDone:
		return errStopped
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-o.done:
		return err
	case <-s.runDone:
		return errStopped
	case <-ctx.Done():
		return ctx.Err()
	}
}

// nodeEvent wraps ev (about sess's node) in a message with the fleet
// headers. msgID makes a republish of the same event a no-op.
func (s *Server) nodeEvent(sess *session, ev *fleetpb.NodeEvent, kind, msgID string) *outgoing {
	ev.NodeId = sess.key.node
	ev.Pool = sess.key.pool
	ev.GatewayId = s.cfg.GatewayID
	ev.SessionId = sess.id
	ev.At = timestamppb.New(s.now())
	data, err := proto.Marshal(ev)
	if err != nil {
		panic(err) // every field was checked; a NodeEvent always encodes
	}
	return &outgoing{kind: kind, msg: &nats.Msg{
		Subject: subjects.FleetNode(sess.key.pool, sess.key.node),
		Data:    data,
		Header: nats.Header{
			envelope.MsgID:   {msgID},
			envelope.Schema:  {envelope.SchemaFleetV1},
			envelope.Kind:    {envelope.KindNode},
			envelope.Pool:    {sess.key.pool},
			envelope.Node:    {sess.key.node},
			envelope.Gateway: {s.cfg.GatewayID},
		},
	}}
}

// nextMsgID is "<session_id>/<n>": n counts the session's events, so a
// republish of one is a no-op and session ids (unique per gateway process)
// keep sessions apart.
func (sess *session) nextMsgID() string {
	return sess.id + "/" + strconv.FormatUint(sess.events.Add(1), 10)
}

// inventory is what a session keeps of its Hello for its Connected events:
// the labels, GPUs and agent version, encoded (a few hundred bytes, where
// the decoded Hello with its map and pointers takes several times that).
func inventory(h *fleetpb.Hello) []byte {
	b, err := proto.Marshal(&fleetpb.NodeConnected{Labels: h.GetLabels(), Gpus: h.GetGpus(), AgentVersion: h.GetAgentVersion()})
	if err != nil {
		panic(err) // a checked Hello always encodes
	}
	return b
}

// connectedEvent is the session's inventory and the allocations the node
// holds now (s.mu held).
func (s *Server) connectedEvent(sess *session, kind string) *outgoing {
	c := &fleetpb.NodeConnected{}
	if err := proto.Unmarshal(sess.inventory, c); err != nil {
		panic(err) // encoded by inventory
	}
	c.Allocations = sess.heldLocked()
	ev := &fleetpb.NodeEvent{Body: &fleetpb.NodeEvent_Connected{Connected: c}}
	return s.nodeEvent(sess, ev, kind, sess.nextMsgID())
}

func (s *Server) disconnectedEvent(sess *session, reason string) *outgoing {
	ev := &fleetpb.NodeEvent{Body: &fleetpb.NodeEvent_Disconnected{Disconnected: &fleetpb.NodeDisconnected{Reason: reason}}}
	return s.nodeEvent(sess, ev, kindDisconnected, sess.nextMsgID())
}

// allocationEvent's id names the node, allocation and state, so that a
// node repeating a report (after a resent bind) stores it once.
func (s *Server) allocationEvent(sess *session, r *fleetpb.AllocationReport) *outgoing {
	ev := &fleetpb.NodeEvent{Body: &fleetpb.NodeEvent_Allocation{Allocation: r}}
	id := subjects.Token(sess.key.pool) + "/" + subjects.Token(sess.key.node) + "/alloc/" +
		subjects.Token(r.GetAllocationId()) + "/" + r.GetState().String()
	return s.nodeEvent(sess, ev, kindAllocation, id)
}

// StatusHash is NodeStatusChanged.status_hash: the hex SHA-256 of the
// report's gpus and conditions in deterministic protobuf encoding (seq and
// gauges left out).
func StatusHash(r *fleetpb.StatusReport) string {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(&fleetpb.NodeStatusChanged{
		Gpus:       r.GetGpus(),
		Conditions: r.GetConditions(),
	})
	if err != nil {
		panic(err)
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

func (s *Server) statusEvent(sess *session, r *fleetpb.StatusReport, hash string) *outgoing {
	ev := &fleetpb.NodeEvent{Body: &fleetpb.NodeEvent_StatusChanged{StatusChanged: &fleetpb.NodeStatusChanged{
		StatusHash: hash,
		Gpus:       r.GetGpus(),
		Conditions: r.GetConditions(),
	}}}
	return s.nodeEvent(sess, ev, kindStatus, sess.nextMsgID())
}
