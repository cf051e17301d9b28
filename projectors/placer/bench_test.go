package placer

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// BenchmarkPlace measures placements per second at 10,000 nodes x 8 GPUs
// in one pool, in batches of 500 requests, with the fleet about half
// booked: each batch also cancels the 500 oldest reservations (so it frees
// as much as it books, as in a steady state). Every placement goes through
// the whole commit path (locks, guards, outbox) on PostgreSQL.
//
//	go test -run '^$' -bench BenchmarkPlace -benchtime 40x ./projectors/placer/
func BenchmarkPlace(b *testing.B) {
	const (
		nodes  = 10000
		batch  = 500
		steady = 15000 // live reservations, about 40k of 80k GPUs
	)
	e := newEnv(b)
	ctx := context.Background()
	e.exec(`insert into fleet_nodes (node_id, pool, labels, connected, state, state_since, first_seen, last_seen)
		select 'node-' || lpad(i::text, 5, '0'), 'bench', jsonb_build_object('rack', 'r' || (i % 40)), true, 'healthy', $1, $1, $1
		from generate_series(0, $2 - 1) i`, e.now, nodes)
	e.exec(`insert into fleet_devices (node_id, gpu_index, model, memory_mib, health)
		select 'node-' || lpad(i::text, 5, '0'), g, case when i % 4 = 0 then 'A100' else 'H100' end, 81920, 'ok'
		from generate_series(0, $1 - 1) i, generate_series(0, 7) g`, nodes)
	p := e.placer(Config{BindTimeout: time.Hour, PendingTimeout: 2 * time.Hour}) // no node binds here
	e.sweep(p)
	rng := rand.New(rand.NewPCG(1, 2))
	var live []string
	next := 0
	step := func() {
		ms := make([]*msg, 0, 2*batch)
		for j := 0; j < batch; j++ {
			id := fmt.Sprintf("res-%07d", next)
			next++
			var opts []specOpt
			gpus := []int{1, 1, 1, 2, 2, 2, 4, 4, 8, 8}[rng.IntN(10)]
			switch r := rng.IntN(100); {
			case r < 3:
				opts = append(opts, wholeNodes(1))
			case r < 13:
				opts = append(opts, model("A100"))
			case r < 16:
				opts = append(opts, label("rack", fmt.Sprintf("r%d", rng.IntN(40))))
			}
			ms = append(ms, e.request(id, "bench", gpus, opts...))
			live = append(live, id)
		}
		for len(live) > steady {
			ms = append(ms, e.cancel(live[0], "bench"))
			live = live[1:]
		}
		e.apply(p, ms...)
		e.advance(time.Second)
	}
	for len(live) < steady {
		step()
	}
	count := func() int {
		var n int
		if err := e.pool.QueryRow(ctx, `select count(*) from fleet_placements`).Scan(&n); err != nil {
			b.Fatal(err)
		}
		return n
	}
	// Autovacuum would have analyzed the tables by now in a running
	// system; without statistics the planner takes them for empty.
	e.exec(`analyze`)
	before := count()
	b.ResetTimer()
	start := time.Now()
	for i := 0; i < b.N; i++ {
		step()
	}
	elapsed := time.Since(start)
	b.StopTimer()
	placed := count() - before
	b.ReportMetric(float64(placed)/elapsed.Seconds(), "placements/s")
	b.ReportMetric(float64(placed)/float64(b.N), "placed/batch")
}
