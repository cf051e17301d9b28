package streams_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

func TestAssignSpreadsEveryPartitionOnce(t *testing.T) {
	for n := 1; n <= 9; n++ {
		for k := 1; k <= 5; k++ {
			var members []string
			for i := range k {
				members = append(members, fmt.Sprintf("m%d", i))
			}
			owner := map[int]string{}
			for _, m := range members {
				got := streams.Assign(n, members, m)
				if len(got) < n/k || len(got) > (n+k-1)/k {
					t.Errorf("n=%d k=%d: %s runs %v, want %d or %d partitions", n, k, m, got, n/k, (n+k-1)/k)
				}
				for _, p := range got {
					if o, ok := owner[p]; ok {
						t.Fatalf("n=%d k=%d: partition %d runs on %s and %s", n, k, p, o, m)
					}
					owner[p] = m
				}
			}
			if len(owner) != n {
				t.Fatalf("n=%d k=%d: %d partitions run, want %d", n, k, len(owner), n)
			}
		}
	}
	if got := streams.Assign(4, []string{"a", "b"}, "c"); got != nil {
		t.Errorf("a member not among the members runs %v", got)
	}
}

func TestGroupConfigValidate(t *testing.T) {
	for _, c := range []streams.GroupConfig{
		{Partitions: 4},
		{Group: "g"},
		{Group: "g", Partitions: 2, HeartbeatEvery: time.Second, MemberTTL: time.Second},
		{Group: "g", Partitions: 2, HeartbeatEvery: -time.Second},
	} {
		if err := c.Validate(); err == nil {
			t.Errorf("%+v: no error", c)
		}
	}
	if err := (streams.GroupConfig{Group: "g", Partitions: 2}).Validate(); err != nil {
		t.Errorf("defaults refused: %v", err)
	}
}

// groupEnv is a backbone with build events in four partitions and a
// database with runner_rows.
type groupEnv struct {
	js     jetstream.JetStream
	pool   *pgxpool.Pool
	pub    *streams.Publisher
	layout subjects.BESLayout
	sent   int
}

func setupGroup(t *testing.T, partitions int) *groupEnv {
	t.Helper()
	js := jsClient(t)
	ctx := context.Background()
	c := streams.Config{BESPartitions: partitions}
	if err := streams.Apply(ctx, js, streams.StreamSpecs(c)); err != nil {
		t.Fatal(err)
	}
	pool, _ := testenv.Pool(t)
	_, err := pool.Exec(ctx, `create table runner_rows (consumer text, seq bigint, body text, member text, primary key (consumer, seq))`)
	if err != nil {
		t.Fatal(err)
	}
	return &groupEnv{js: js, pool: pool, pub: streams.NewPublisher(js, nil), layout: c.BESLayout()}
}

// publish sends n events of n different builds, so that they fall in
// every partition.
func (e *groupEnv) publish(t *testing.T, n int) {
	t.Helper()
	for range n {
		e.sent++
		msg := nats.NewMsg(e.layout.Subject("p", fmt.Sprintf("inv-%d", e.sent)))
		msg.Header.Set(envelope.MsgID, fmt.Sprintf("%s-%d", t.Name(), e.sent))
		msg.Data = fmt.Appendf(nil, "event %d", e.sent)
		if err := e.pub.Publish(context.Background(), msg); err != nil {
			t.Fatal(err)
		}
	}
}

func (e *groupEnv) applied(t *testing.T) int {
	var n int
	if err := e.pool.QueryRow(context.Background(), `select count(*) from runner_rows`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// memberRows writes, per partition consumer, the member that applied it.
type memberRows struct {
	name, member string
	gate         *gate
}

func (p *memberRows) Name() string { return p.name }

func (p *memberRows) Apply(ctx context.Context, tx pgx.Tx, batch []projection.Message) error {
	if p.gate != nil {
		p.gate.pass()
	}
	for _, m := range batch {
		if _, err := tx.Exec(ctx, `insert into runner_rows (consumer, seq, body, member) values ($1, $2, $3, $4)`,
			p.name, int64(m.Seq()), string(m.Data()), p.member); err != nil {
			return err
		}
	}
	return nil
}

// groupMember is one instance of the group, as a process runs it.
type groupMember struct {
	name     string
	mu       sync.Mutex
	assigned []int
	stop     func()
}

func (m *groupMember) partitions() []int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.assigned)
}

// startMember starts member name of group (the consumers are "rows"'s
// whatever the group, so that two groups can contend for them).
func startMember(t *testing.T, e *groupEnv, name, group string, g *gate) *groupMember {
	t.Helper()
	m := &groupMember{name: name}
	cfg := streams.GroupConfig{Group: group, Partitions: e.layout.N(), Member: name,
		HeartbeatEvery: 100 * time.Millisecond, Logger: quietLog(),
		Assigned: func(ps []int) { m.mu.Lock(); m.assigned = ps; m.mu.Unlock() }}
	grp, err := streams.NewGroup(e.pool, cfg, func(ctx context.Context, p int) error {
		rc := runnerConfig()
		rc.Stream, rc.Filter = e.layout.Stream(p), e.layout.Filter(p)
		rc.StandbyEvery, rc.Logger = 50*time.Millisecond, quietLog()
		r, err := streams.NewRunner(e.js, e.pool, &memberRows{name: e.layout.Durable("rows", p), member: name, gate: g}, rc, nil)
		if err != nil {
			return err
		}
		return r.Run(ctx)
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		grp.Run(ctx)
	}()
	var once sync.Once
	m.stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(m.stop)
	return m
}

// appliers are the members that applied each partition's events since
// seq after, by partition consumer.
func (e *groupEnv) appliers(t *testing.T, after int) map[string][]string {
	rows, err := e.pool.Query(context.Background(), `select consumer, array_agg(distinct member order by member) from runner_rows
		where seq > $1 group by consumer`, after)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]string{}
	var c string
	var ms []string
	if _, err := pgx.ForEachRow(rows, []any{&c, &ms}, func() error { out[c] = slices.Clone(ms); return nil }); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestGroupRebalances: one member runs every partition; a second joins
// and takes half; the first leaves and the second takes them all. Every
// event is applied once (the primary key refuses a second), and after
// each change each partition's new events are applied by the member it
// falls to.
func TestGroupRebalances(t *testing.T) {
	e := setupGroup(t, 4)
	a := startMember(t, e, "a", "rows", nil)
	poll.Until(t, "a to run every partition", func() bool { return slices.Equal(a.partitions(), []int{0, 1, 2, 3}) }, waitWithin)
	e.publish(t, 40)
	poll.Until(t, "a to apply 40 events", func() bool { return e.applied(t) == 40 }, waitWithin)

	b := startMember(t, e, "b", "rows", nil)
	poll.Until(t, "a and b to share the partitions", func() bool {
		return slices.Equal(a.partitions(), []int{0, 2}) && slices.Equal(b.partitions(), []int{1, 3})
	}, waitWithin)
	// The events after the join: each partition's applied by its new
	// member alone, once a's runners let go (a sent event waits meanwhile).
	e.publish(t, 40)
	poll.Until(t, "80 events applied", func() bool { return e.applied(t) == 80 }, waitWithin)
	checkAppliers(t, e, 40, map[string]string{"rows_0": "a", "rows_1": "b", "rows_2": "a", "rows_3": "b"})

	a.stop()
	poll.Until(t, "b to run every partition once a left", func() bool { return slices.Equal(b.partitions(), []int{0, 1, 2, 3}) }, waitWithin)
	e.publish(t, 40)
	poll.Until(t, "120 events applied", func() bool { return e.applied(t) == 120 }, waitWithin)
	checkAppliers(t, e, 80, map[string]string{"rows_0": "b", "rows_1": "b", "rows_2": "b", "rows_3": "b"})
}

// checkAppliers checks that the events sent after the first `after`
// were applied, partition by partition, by the member want names.
func checkAppliers(t *testing.T, e *groupEnv, after int, want map[string]string) {
	t.Helper()
	rows, err := e.pool.Query(context.Background(), `select consumer, array_agg(distinct member order by member) from runner_rows
		where body in (select format('event %s', g) from generate_series($1::int + 1, $2::int) g) group by consumer`, after, e.sent)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	var c string
	var ms []string
	if _, err := pgx.ForEachRow(rows, []any{&c, &ms}, func() error { got[c] = fmt.Sprint(ms); return nil }); err != nil {
		t.Fatal(err)
	}
	for c, m := range want {
		if got[c] != "["+m+"]" {
			t.Errorf("events %d-%d of %s applied by %s, want [%s]", after+1, e.sent, c, got[c], m)
		}
	}
}

// TestGroupMemberThatDiedAgesOut: a member that stops renewing its row
// (a process killed: it never deletes it) keeps its partitions from the
// others only until its row is older than the member TTL.
func TestGroupMemberThatDiedAgesOut(t *testing.T) {
	e := setupGroup(t, 2)
	ctx := context.Background()
	if _, err := e.pool.Exec(ctx, `insert into consumer_members (consumer_group, member, seen_at) values ('rows', 'b-dead', now() + interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	a := startMember(t, e, "a", "rows", nil)
	poll.Until(t, "a to run partition 0 beside the member it sees", func() bool { return slices.Equal(a.partitions(), []int{0}) }, waitWithin)
	e.publish(t, 20)
	poll.Until(t, "partition 0's events applied", func() bool {
		var n int
		e.pool.QueryRow(ctx, `select count(*) from runner_rows where consumer = 'rows_0'`).Scan(&n)
		return n > 0
	}, waitWithin)
	if got := e.appliers(t, 0)["rows_1"]; got != nil {
		t.Fatalf("partition 1, the dead member's, was applied by %v", got)
	}
	// Its last renewal, long ago: past the TTL, a takes its partition.
	if _, err := e.pool.Exec(ctx, `update consumer_members set seen_at = now() - interval '1 hour' where member = 'b-dead'`); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "a to take partition 1", func() bool { return slices.Equal(a.partitions(), []int{0, 1}) }, waitWithin)
	poll.Until(t, "every event applied", func() bool { return e.applied(t) == 20 }, waitWithin)
	var left int
	e.pool.QueryRow(ctx, `select count(*) from consumer_members where member = 'b-dead'`).Scan(&left)
	if left != 0 {
		t.Errorf("the dead member's row is still there")
	}
}

// TestGroupLeaseLostStopsApplying: while members disagree about who runs
// a partition (here two members of two groups' views, the way two
// members a heartbeat apart would), the lease decides. The holder is held
// inside a batch, its lease's connection is terminated, the other takes
// the partition and applies it; the first's batch, let go, commits
// nothing. Every event is applied once, by the second.
func TestGroupLeaseLostStopsApplying(t *testing.T) {
	e := setupGroup(t, 1)
	ctx := context.Background()
	var g gate
	g.arm()
	// Two members that each see only themselves: both run partition 0
	// (a member row they do not share, under two group names).
	startMember(t, e, "a", "rows-a", &g)
	e.publish(t, 10)
	g.waitBlocked(t)
	startMember(t, e, "b", "rows-b", nil)
	// b stands by: a holds the lease, inside its batch.
	var pid int
	if err := e.pool.QueryRow(ctx, `select pid from pg_locks where locktype = 'advisory' and granted
		and database = (select oid from pg_database where datname = current_database())`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, "select pg_terminate_backend($1)", pid); err != nil {
		t.Fatal(err)
	}
	consumer := e.layout.Durable("rows", 0)
	poll.Until(t, "b to apply the 10 events", func() bool { return fmt.Sprint(e.appliers(t, 0)[consumer]) == "[b]" && e.applied(t) == 10 }, waitWithin)
	g.open() // a's batch goes on, on a connection that is gone
	e.publish(t, 10)
	poll.Until(t, "20 events applied", func() bool { return e.applied(t) == 20 }, waitWithin)
	if got := fmt.Sprint(e.appliers(t, 0)[consumer]); got != "[b]" {
		t.Fatalf("partition 0 applied by %s, want b alone", got)
	}
	var pos int64
	if err := e.pool.QueryRow(ctx, `select stream_seq from consumer_positions where consumer = $1`, consumer).Scan(&pos); err != nil || pos != 20 {
		t.Fatalf("position %d (%v), want 20", pos, err)
	}
}

// TestPauseTakesOverADeadReplay: a partition paused by a replay that runs
// is refused to another; one whose replay stopped renewing its pause
// (killed) is taken over; resume deletes only the pauser's own rows.
func TestPauseTakesOverADeadReplay(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `insert into consumer_paused (consumer_group, partition, paused_by, paused_at) values
		('rows', 0, 'running replay', now()), ('rows', 1, 'dead replay', now() - interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	if _, err := streams.Pause(ctx, pool, "rows", []int{0}, "new replay"); err == nil || !strings.Contains(err.Error(), "paused by another replay") {
		t.Fatalf("a pause another replay renews was taken: %v", err)
	}
	resume, err := streams.Pause(ctx, pool, "rows", []int{1, 2}, "new replay")
	if err != nil {
		t.Fatalf("the dead replay's pause was not taken over: %v", err)
	}
	pausedBy := func() map[int]string {
		rows, err := pool.Query(ctx, `select partition, paused_by from consumer_paused where consumer_group = 'rows'`)
		if err != nil {
			t.Fatal(err)
		}
		out := map[int]string{}
		var p int
		var by string
		pgx.ForEachRow(rows, []any{&p, &by}, func() error { out[p] = by; return nil })
		return out
	}
	if got := fmt.Sprint(pausedBy()); got != "map[0:running replay 1:new replay 2:new replay]" {
		t.Fatalf("paused: %s", got)
	}
	if err := resume(ctx); err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(pausedBy()); got != "map[0:running replay]" {
		t.Fatalf("after resume: %s", got)
	}
}

// jsClient is a JetStream client of a server of the test's own.
func jsClient(t *testing.T) jetstream.JetStream {
	t.Helper()
	nc, err := streams.Connect(testenv.NATS(t).ClientURL(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}
