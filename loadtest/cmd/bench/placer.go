package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/millrace/millrace/schemas/envelope"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/subjects"
)

// scFleetPlacer measures the placer on its own: 10,000 nodes are announced
// straight to FLEET_NODES (no sessions: the simulator and the gateway would
// take the machine's two cores), then a burst of reservation requests is
// published straight to FLEET_RESV, and the placer (in `millrace dev`)
// drains it: plans, guarded bookings in PostgreSQL, decisions through the
// outbox to FLEET_PLACE. Placements per second are decisions stored over
// the time from the first request to the last decision.
const scFleetPlacer = "fleet-placer"

func (b *bench) placerScenario(ctx context.Context, rep *scenarioReport) error {
	fc := b.cfg.fleet
	dir, err := mkdir(b.tmp, scFleetPlacer)
	if err != nil {
		return err
	}
	db, dbURL, err := b.pg.createDB(ctx, scFleetPlacer)
	if err != nil {
		return err
	}
	defer b.pg.dropDB(db)
	s, err := b.startFleetStack(ctx, dir, dbURL)
	if err != nil {
		return err
	}
	defer s.stop()
	nc, err := nats.Connect(s.natsURL, natsOptions(s.natsURL, nats.Timeout(5*time.Second))...)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(4096))
	if err != nil {
		return err
	}
	const pool = "bench"
	nodes, gpus := fc.placeNodes, 8
	rep.Description = fmt.Sprintf("the placer alone: %d nodes x %d GPUs announced to FLEET_NODES, then %d reservation requests published at once to FLEET_RESV; `millrace dev`'s placer drains them into PostgreSQL and FLEET_PLACE", nodes, gpus, fc.placerRequests)

	publish := func(subject string, kind string, body proto.Message, id string, hdr map[string]string) error {
		data, err := proto.Marshal(body)
		if err != nil {
			return err
		}
		m := nats.NewMsg(subject)
		m.Data = data
		m.Header.Set(envelope.MsgID, id)
		m.Header.Set(envelope.Schema, envelope.SchemaFleetV1)
		m.Header.Set(envelope.Kind, kind)
		m.Header.Set(envelope.Pool, pool)
		for k, v := range hdr {
			m.Header.Set(k, v)
		}
		_, err = js.PublishMsgAsync(m, jetstream.WithStallWait(30*time.Second))
		return err
	}
	wait := func() error {
		select {
		case <-js.PublishAsyncComplete():
			return nil
		case <-time.After(time.Minute):
			return fmt.Errorf("publishes not acknowledged within a minute")
		}
	}
	// Nodes: a connected event each, then liveness batches every few
	// seconds for as long as the scenario runs, so none goes suspect.
	inventory := make([]*fleetpb.Gpu, gpus)
	for g := range inventory {
		inventory[g] = &fleetpb.Gpu{Index: uint32(g), Model: "H100", MemoryMib: 81920, Health: fleetpb.GpuHealth_GPU_HEALTH_OK}
	}
	ids := make([]string, nodes)
	for i := range ids {
		ids[i] = fmt.Sprintf("node-%05d", i)
		ev := &fleetpb.NodeEvent{NodeId: ids[i], Pool: pool, GatewayId: "bench", SessionId: "bench-" + ids[i], At: timestamppb.Now(),
			Body: &fleetpb.NodeEvent_Connected{Connected: &fleetpb.NodeConnected{Gpus: inventory}}}
		if err := publish(subjects.FleetNode(pool, ids[i]), envelope.KindNode, ev, "bench/"+ids[i], map[string]string{envelope.Node: ids[i], envelope.Gateway: "bench"}); err != nil {
			return err
		}
	}
	if err := wait(); err != nil {
		return err
	}
	liveCtx, stopLive := context.WithCancel(ctx)
	defer stopLive()
	go func() {
		for n := 0; ; n++ {
			batch := &fleetpb.LivenessBatch{GatewayId: "bench", Pool: pool, ObservedAt: timestamppb.Now()}
			for _, id := range ids {
				batch.Nodes = append(batch.Nodes, &fleetpb.NodeAge{NodeId: id, SessionId: "bench-" + id})
			}
			publish(subjects.FleetLiveness(pool), envelope.KindLiveness, batch, "bench/live/"+strconv.Itoa(n), map[string]string{envelope.Gateway: "bench"})
			select {
			case <-liveCtx.Done():
				return
			case <-time.After(3 * time.Second):
			}
		}
	}()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var n int
		conn.QueryRow(ctx, "select count(*) from fleet_nodes where state = 'healthy'").Scan(&n)
		if n == nodes {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("only %d of %d nodes projected healthy", n, nodes)
		}
		time.Sleep(200 * time.Millisecond)
	}
	fmt.Printf("bench: %d nodes projected\n", nodes)

	// The placer in dev has settled; measure its CPU and PostgreSQL's.
	procs := map[string]*proc{"dev": s.dev}
	before, err := takeSnapshot(procs)
	if err != nil {
		return err
	}
	meter, err := b.pg.meter(ctx, db)
	if err != nil {
		return err
	}
	rng := rand.New(rand.NewPCG(1, 2))
	start := time.Now()
	for i := range fc.placerRequests {
		id := fmt.Sprintf("r-bench-%06d", i)
		ev := &fleetpb.ReservationEvent{ReservationId: id, Owner: "bench", At: timestamppb.Now(),
			Body: &fleetpb.ReservationEvent_Requested{Requested: &fleetpb.ReservationRequested{
				Spec: &fleetpb.ReservationSpec{Pool: pool, Gpus: uint32(1 + rng.IntN(4)), Model: "H100"}}}}
		if err := publish(subjects.FleetResv(pool), envelope.KindReservation, ev, id+"/requested", map[string]string{envelope.Reservation: id}); err != nil {
			return err
		}
	}
	if err := wait(); err != nil {
		return err
	}
	published := time.Since(start)
	place, err := js.Stream(ctx, subjects.StreamFleetPlace)
	if err != nil {
		return err
	}
	var decided uint64
	deadline = time.Now().Add(5 * time.Minute)
	for {
		info, err := place.Info(ctx)
		if err != nil {
			return err
		}
		decided = info.State.Msgs
		if decided >= uint64(fc.placerRequests) || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	elapsed := time.Since(start)
	after, err := takeSnapshot(procs)
	if err != nil {
		return err
	}
	pgc, err := meter.stop(ctx)
	if err != nil {
		return err
	}
	var booked, live int64
	conn.QueryRow(ctx, "select count(*) from fleet_bookings").Scan(&booked)
	conn.QueryRow(ctx, `select count(*) from (select a.node_id, g from fleet_allocations a, unnest(a.gpu_indices) g
		where a.released_at is null group by 1, 2 having count(*) > 1) d`).Scan(&live)
	cpu, machine := cpuFigures(before, after, int64(decided), &pgc)
	// "Events" here are placement decisions.
	run := runReport{Name: fmt.Sprintf("%d requests onto %d nodes", fc.placerRequests, nodes), Mode: "drain",
		NATS: "embedded in dev", NATSSync: b.cfg.natsSync,
		WindowEvents: int64(decided), ElapsedS: round(elapsed.Seconds(), 2), WindowS: round(elapsed.Seconds(), 2),
		EventsPerS: round(float64(decided)/elapsed.Seconds(), 0),
		CPU:        cpu, Machine: machine, Postgres: b.pgReport(pgc, int64(decided))}
	rep.Runs = append(rep.Runs, run)
	b.printRun(run)
	fmt.Printf("bench: %d decisions in %s (requests published in %s); %d GPUs booked; %d booked twice\n",
		decided, elapsed.Round(time.Millisecond), published.Round(time.Millisecond), booked, live)
	if decided < uint64(fc.placerRequests) {
		return fmt.Errorf("%d of %d requests decided within the deadline", decided, fc.placerRequests)
	}
	rep.Checks = append(rep.Checks,
		atLeast(fmt.Sprintf("%s: placements per second at %d nodes on PostgreSQL", scFleetPlacer, nodes), run.EventsPerS, 2000, "placements/s",
			"the placer in `millrace dev` (which also runs the gateway, API, projectors and JetStream) on 2 vCPUs"),
		atMost(scFleetPlacer+": GPUs booked twice", float64(live), 0, "GPUs", ""))
	return nil
}
