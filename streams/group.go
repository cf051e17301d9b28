package streams

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	retry "github.com/millrace/millrace/internal/backoff"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/knob"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

// A partitioned consumer group: the instances of one partitioned projector
// (docs/design.md, "Partitions") share its partitions. Each partition is a
// consumer of its own, with its own durable, position and lease (a Runner
// named for the partition); the group only decides which instance runs
// which partitions. Every member writes a row in consumer_members and
// renews it every HeartbeatEvery; each reads the live rows, sorts them,
// and runs the partitions p with p mod members equal to its own place:
// so the partitions spread evenly, and every member computes the same
// assignment from the same rows. When one joins or leaves, the members
// that lose partitions stop their runners, which give up their leases
// once their step ends; the members that gain them are on standby for
// those leases meanwhile, and take them as they are given up.
//
// The group never decides who writes: the lease does. A partition's
// runner leads by its PGLease, the advisory lock of the connection its
// transactions commit on, so two members that briefly both think a
// partition theirs (their reads of the rows a heartbeat apart) never both
// apply it: the second stands by until the first lets go, and a runner
// whose connection was lost can commit nothing more
// (TestGroupLeaseLostStopsApplying).

// GroupConfig tunes a partitioned consumer group.
type GroupConfig struct {
	// Group names the group in consumer_members and in the logs: the
	// projector's name.
	Group string
	// Partitions is how many partitions the group has; at least 1.
	Partitions int
	// Member names this instance among the group's; default host, process
	// id and a random suffix. Two instances must not share one.
	Member string
	// HeartbeatEvery is how often a member renews its row and reads the
	// others'. Default 2s.
	HeartbeatEvery time.Duration
	// MemberTTL is how long a member that no longer renews its row counts:
	// a member that died gives up its partitions this long after its last
	// renewal. Default 5 x HeartbeatEvery; at least 2 x HeartbeatEvery.
	MemberTTL time.Duration
	// Assigned, if set, is called with the partitions this member runs
	// each time they change (in order; empty when none).
	Assigned func([]int)
	Logger   *slog.Logger
}

// DefaultGroupHeartbeat is GroupConfig.HeartbeatEvery's default.
const DefaultGroupHeartbeat = 2 * time.Second

func (c GroupConfig) withDefaults() GroupConfig {
	if c.HeartbeatEvery == 0 {
		c.HeartbeatEvery = DefaultGroupHeartbeat
	}
	if c.MemberTTL == 0 {
		c.MemberTTL = 5 * c.HeartbeatEvery
	}
	if c.Member == "" {
		host, _ := os.Hostname()
		c.Member = fmt.Sprintf("%s-%d-%04x", host, os.Getpid(), rand.IntN(1<<16))
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate refuses a group that cannot work.
func (c GroupConfig) Validate() error {
	errs := []error{
		knob.NotNegative("group", "HeartbeatEvery", c.HeartbeatEvery, DefaultGroupHeartbeat),
		knob.NotNegative("group", "MemberTTL", c.MemberTTL, "5 x HeartbeatEvery"),
	}
	if c.Group == "" {
		errs = append(errs, errors.New("group: no name"))
	}
	if c.Partitions < 1 {
		errs = append(errs, fmt.Errorf("group %s: %d partitions, want at least 1", c.Group, c.Partitions))
	}
	if d := c.withDefaults(); d.MemberTTL < 2*d.HeartbeatEvery {
		errs = append(errs, fmt.Errorf("group %s: member TTL %s is under two heartbeats (%s)", c.Group, d.MemberTTL, d.HeartbeatEvery))
	}
	return errors.Join(errs...)
}

// Group runs this instance's share of a partitioned consumer group.
type Group struct {
	pool *pgxpool.Pool
	cfg  GroupConfig
	run  func(ctx context.Context, partition int) error
	log  *slog.Logger
}

// NewGroup makes a member of cfg.Group whose partition p, while it is
// this member's, runs as run(ctx, p) until ctx ends: a Runner's Run, which
// leads by the partition's own lease.
func NewGroup(pool *pgxpool.Pool, cfg GroupConfig, run func(ctx context.Context, partition int) error) (*Group, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	return &Group{pool: pool, cfg: cfg, run: run, log: cfg.Logger.With("group", cfg.Group, "member", cfg.Member)}, nil
}

// partitionRun is one partition's runner while this member runs it.
type partitionRun struct {
	cancel context.CancelFunc
	done   chan struct{}
}

// Run takes part in the group until ctx ends: it renews its row, runs the
// partitions that fall to it and stops those that no longer do. On the way
// out it stops every runner, waits for them (each gives its lease up),
// and deletes its row, so that the others take its partitions at their
// next heartbeat rather than a MemberTTL later.
func (g *Group) Run(ctx context.Context) error {
	running := map[int]*partitionRun{}
	var wg sync.WaitGroup
	defer func() {
		for _, r := range running {
			r.cancel()
		}
		wg.Wait()
		g.leave()
	}()
	var assigned []int
	failing, reported := false, false
	var heldBack []int
	tick := time.NewTicker(g.cfg.HeartbeatEvery)
	defer tick.Stop()
	for {
		members, paused, err := g.beat(ctx)
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil:
			// Keep what runs: a runner that lost the database lost its
			// lease with it, and one that did not still holds it.
			if !failing {
				g.log.Warn("cannot renew the group membership; the partitions run as they were", "err", err, "retry_in", g.cfg.HeartbeatEvery)
			}
			failing = true
		default:
			failing = false
			mine := Assign(g.cfg.Partitions, members, g.cfg.Member)
			held := slices.DeleteFunc(slices.Clone(mine), func(p int) bool { return !slices.Contains(paused, p) })
			if !slices.Equal(held, heldBack) {
				heldBack = held
				if len(held) > 0 {
					// A replay's (consumer_paused): the partitions lag until it
					// resumes them, or for good if it was killed.
					g.log.Warn("partitions paused; not running them until resumed", "assigned", joinInts(held))
				}
			}
			want := slices.DeleteFunc(mine, func(p int) bool { return slices.Contains(paused, p) })
			g.reconcile(ctx, &wg, running, want)
			if !reported || !slices.Equal(want, assigned) {
				assigned, reported = want, true
				g.log.Info("partitions assigned", "assigned", joinInts(want), "members", len(members))
				if g.cfg.Assigned != nil {
					g.cfg.Assigned(slices.Clone(want))
				}
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// reconcile starts the runners of want that do not run and stops those
// that run and are not in want. A partition whose runner is still
// stopping is started at a later heartbeat.
func (g *Group) reconcile(ctx context.Context, wg *sync.WaitGroup, running map[int]*partitionRun, want []int) {
	for p, r := range running {
		select {
		case <-r.done:
			delete(running, p) // stopped, or ended by itself: started again below if still wanted
			continue
		default:
		}
		if !slices.Contains(want, p) {
			r.cancel()
		}
	}
	for _, p := range want {
		if _, ok := running[p]; ok {
			continue
		}
		pctx, cancel := context.WithCancel(ctx)
		r := &partitionRun{cancel: cancel, done: make(chan struct{})}
		running[p] = r
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer close(r.done)
			if err := g.run(pctx, p); err != nil && pctx.Err() == nil {
				g.log.Error("partition runner ended; it starts again at the next heartbeat", "partition", p, "err", err)
			}
		}()
	}
}

// sqlBeat renews this member's row, deletes rows of members gone for the
// TTL, and returns the live members (this one among them: the select
// does not see the insert of its own statement).
const sqlBeat = `
with renew as (
    insert into consumer_members (consumer_group, member, seen_at) values ($1, $2, now())
    on conflict (consumer_group, member) do update set seen_at = now()
), gone as (
    delete from consumer_members where consumer_group = $1 and member <> $2 and seen_at < now() - $3::interval
)
select member from consumer_members where consumer_group = $1 and member <> $2 and seen_at >= now() - $3::interval
union select $2
order by 1`

// beat is one heartbeat: the live members, sorted, and the paused
// partitions (Pause).
func (g *Group) beat(ctx context.Context) (members []string, paused []int, err error) {
	ctx, cancel := context.WithTimeout(ctx, g.cfg.HeartbeatEvery)
	defer cancel()
	rows, err := g.pool.Query(ctx, sqlBeat, g.cfg.Group, g.cfg.Member, g.cfg.MemberTTL.String())
	if err == nil {
		members, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if err == nil {
		rows, err = g.pool.Query(ctx, `select partition from consumer_paused where consumer_group = $1`, g.cfg.Group)
	}
	if err == nil {
		paused, err = pgx.CollectRows(rows, pgx.RowTo[int])
	}
	if err != nil {
		return nil, nil, fmt.Errorf("group %s: heartbeat: %w", g.cfg.Group, err)
	}
	return members, paused, nil
}

// PauseTTL is how old a pause is once its replay stopped renewing it (it
// died): another replay of the partition may take it over then. The
// members go on honouring it, since a replay that died left its
// partition half rebuilt: it stays paused until a replay finishes it, or
// an operator deletes the row (ops/runbooks/partitions.md).
const PauseTTL = 30 * time.Second

// Pause has the members of group stop running partitions (those that run
// them give their leases up at their next heartbeat) until the function
// it returns is called: for a replay of them, which takes their leases
// (AwaitLease). by names who paused them, for an operator who finds the
// rows. It renews the pause every third of PauseTTL meanwhile; a pause
// older than that is taken over, and one that is not is refused.
func Pause(ctx context.Context, pool *pgxpool.Pool, group string, partitions []int, by string) (resume func(context.Context) error, err error) {
	tag, err := pool.Exec(ctx, `insert into consumer_paused (consumer_group, partition, paused_by)
		select $1, p, $3 from unnest($2::int[]) p
		on conflict (consumer_group, partition) do update set paused_by = excluded.paused_by, paused_at = now()
		where consumer_paused.paused_at < now() - $4::interval`, group, partitions, by, PauseTTL.String())
	if err != nil {
		return nil, fmt.Errorf("group %s: pause: %w", group, err)
	}
	rctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	renewed := make(chan struct{})
	go func() {
		defer close(renewed)
		for retry.Sleep(rctx, PauseTTL/3) {
			pool.Exec(rctx, `update consumer_paused set paused_at = now() where consumer_group = $1 and partition = any($2) and paused_by = $3`, group, partitions, by)
		}
	}()
	resume = func(ctx context.Context) error {
		stop()
		<-renewed
		_, err := pool.Exec(ctx, `delete from consumer_paused where consumer_group = $1 and partition = any($2) and paused_by = $3`, group, partitions, by)
		if err != nil {
			return fmt.Errorf("group %s: resume: %w", group, err)
		}
		return nil
	}
	if int(tag.RowsAffected()) != len(partitions) {
		resume(ctx)
		return nil, fmt.Errorf("group %s: some of partitions %s are paused by another replay that runs (consumer_paused names it)", group, joinInts(partitions))
	}
	return resume, nil
}

// leave deletes this member's row.
func (g *Group) leave() {
	ctx, cancel := context.WithTimeout(context.Background(), ReleaseTimeout)
	defer cancel()
	if _, err := g.pool.Exec(ctx, `delete from consumer_members where consumer_group = $1 and member = $2`, g.cfg.Group, g.cfg.Member); err != nil {
		g.log.Warn("cannot delete the group membership; the others take its partitions once it ages out", "err", err)
	}
}

// Assign is the partitions of n that member runs among members (sorted,
// member among them): those p with p mod len(members) equal to member's
// place. Nil when member is not among them.
func Assign(n int, members []string, member string) []int {
	i := slices.Index(members, member)
	if i < 0 {
		return nil
	}
	var out []int
	for p := i; p < n; p += len(members) {
		out = append(out, p)
	}
	return out
}

func joinInts(v []int) string {
	s := make([]string, len(v))
	for i, n := range v {
		s[i] = strconv.Itoa(n)
	}
	return strings.Join(s, ",")
}

// AwaitLease waits until consumer name's lease is free, for up to within
// (a replay of a paused partition, whose member lets it go at its next
// heartbeat and once its step ends): it takes the lease and gives it back
// at once. waiting, if set, is called once if it has to wait.
func AwaitLease(ctx context.Context, pool *pgxpool.Pool, name string, within time.Duration, waiting func()) error {
	l := ConsumerLease(pool, name)
	deadline := time.Now().Add(within)
	for said := false; ; {
		h, err := l.AcquirePG(ctx)
		if err == nil {
			releaseHeld(h)
			return nil
		}
		if !errors.Is(err, ErrLocked) {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("consumer %s: its lease was not given up within %s: %w", name, within, err)
		}
		if !said && waiting != nil {
			waiting()
		}
		said = true
		if !retry.Sleep(ctx, 200*time.Millisecond) {
			return ctx.Err()
		}
	}
}

// RunByPartition runs a projection of the backbone's build events until
// ctx ends: of(0)'s one Runner in the one-stream layout, or this
// instance's share of the partitions (a Group named gc.Group), partition
// p applied by a Runner of of(p) (whose Name is the partition's consumer,
// subjects.BESLayout.Durable) on p's stream. rc is every runner's config
// but for its stream and filter.
func (b *Backbone) RunByPartition(ctx context.Context, pool *pgxpool.Pool, rc RunnerConfig, gc GroupConfig, m *Metrics, of func(part int) projection.Projector) error {
	l := b.Layout
	run := func(ctx context.Context, part int) error {
		c := rc
		c.Stream, c.Filter = l.Stream(part), l.Filter(part)
		r, err := NewRunner(b.JS, pool, of(part), c, m)
		if err != nil {
			return err
		}
		return r.Run(ctx)
	}
	if !l.Partitioned() {
		return run(ctx, 0)
	}
	gc.Partitions = l.N()
	g, err := NewGroup(pool, gc, run)
	if err != nil {
		return err
	}
	return g.Run(ctx)
}

// ReplayByPartition calls replay for partition part of layout l, or with
// part -1 for each partition in turn. When l is partitioned, each
// partition is paused in group while it is replayed (Pause, by names the
// replay) and replayed once its member let its lease go (AwaitLease on
// group's durable of it, saying so on w while it waits); the members run
// on with the others, and each partition resumes once replayed.
func ReplayByPartition(ctx context.Context, pool *pgxpool.Pool, l subjects.BESLayout, group string, part int, by string, w io.Writer, replay func(part int) error) error {
	parts := []int{part}
	switch {
	case part == -1:
		parts = parts[:0]
		for p := range l.N() {
			parts = append(parts, p)
		}
	case !l.Partitioned():
		return envflag.Usage("--partition: build events are not partitioned (--bes-partitions 1)")
	case part < 0 || part >= l.N():
		return envflag.Usagef("--partition %d: the partitions are 0 to %d", part, l.N()-1)
	}
	if !l.Partitioned() {
		return replay(0)
	}
	for _, p := range parts {
		wait := func() {
			fmt.Fprintf(w, "replay %s, partition %d of %d: waiting for the projector that runs it to let it go\n", group, p, l.N())
		}
		if err := replayPaused(ctx, pool, l.Durable(group, p), group, p, by, wait, replay); err != nil {
			return err
		}
	}
	return nil
}

// replayPaused replays partition p of group, whose consumer is durable,
// paused meanwhile.
func replayPaused(ctx context.Context, pool *pgxpool.Pool, durable, group string, p int, by string, waiting func(), replay func(part int) error) error {
	resume, err := Pause(ctx, pool, group, []int{p}, by)
	if err != nil {
		return err
	}
	defer resume(context.WithoutCancel(ctx))
	deadline := time.Now().Add(time.Minute)
	for {
		// Its member lets it go at its next heartbeat, once its step ends.
		if err := AwaitLease(ctx, pool, durable, time.Until(deadline), waiting); err != nil {
			return err
		}
		// A member that had not yet seen the pause may have taken the
		// lease back since (it stood by for it): it lets it go at its next
		// heartbeat, and the replay, which took nothing, waits again.
		err := replay(p)
		if !errors.Is(err, ErrLocked) || time.Now().After(deadline) {
			return err
		}
	}
}
