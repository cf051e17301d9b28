package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/millrace/millrace/loadtest/fleetsim"
)

// Fleet scenarios: the fleet simulator (package fleetsim, in this process)
// against `millrace dev` (backbone, projectors, placer, reservations API)
// and, where a scenario measures one gateway alone, `millrace serve fleet`
// processes of their own.
const (
	scFleetSessions = "fleet-sessions"
	scFleetPlace    = "fleet-place"
	scFleetActive   = "fleet-active"
	scFleetRehome   = "fleet-rehome"
	scFleetChurn    = "fleet-churn"
)

var fleetScenarios = []string{scFleetSessions, scFleetPlacer, scFleetPlace, scFleetActive, scFleetRehome, scFleetChurn}

// fleetConfig sizes the fleet scenarios (flags of the bench).
type fleetConfig struct {
	sessions       int           // fleet-sessions: nodes on one gateway
	sessionsHold   time.Duration // fleet-sessions: how long they are held at 10 s heartbeats
	placeNodes     int           // fleet-place: nodes
	placeRate      float64       // fleet-place: reservations per second asked
	placeDuration  time.Duration
	placerRequests int     // fleet-placer: requests drained
	activeNodes    int     // fleet-active: nodes
	activeRate     float64 // fleet-active: reservations per second
	activeWindow   time.Duration
	rehomeNodes    int     // fleet-rehome: nodes on the gateway that is killed
	churnNodes     int     // fleet-churn: nodes
	churnRate      float64 // fleet-churn: reservations per second
	ramp           time.Duration
}

func (c *fleetConfig) register(fs *flag.FlagSet) {
	fs.IntVar(&c.sessions, "fleet-sessions", 19000, "fleet-sessions: nodes held by one gateway (this machine's open-file limit is 20,000 per process)")
	fs.DurationVar(&c.sessionsHold, "fleet-sessions-hold", 60*time.Second, "fleet-sessions: how long the sessions are held once all are up")
	fs.IntVar(&c.placeNodes, "fleet-place-nodes", 10000, "fleet-place: simulated nodes (8 GPUs each)")
	fs.Float64Var(&c.placeRate, "fleet-place-rate", 3000, "fleet-place: reservations per second asked of the API")
	fs.DurationVar(&c.placeDuration, "fleet-place-duration", 30*time.Second, "fleet-place: length of the reservation load")
	fs.IntVar(&c.placerRequests, "fleet-placer-requests", 20000, "fleet-placer: reservation requests published at once (1-4 GPUs each)")
	fs.IntVar(&c.activeNodes, "fleet-active-nodes", 2000, "fleet-active: simulated nodes")
	fs.Float64Var(&c.activeRate, "fleet-active-rate", 100, "fleet-active: reservations per second")
	fs.DurationVar(&c.activeWindow, "fleet-active-duration", 60*time.Second, "fleet-active: length of the reservation load")
	fs.IntVar(&c.rehomeNodes, "fleet-rehome-nodes", 10000, "fleet-rehome: nodes on the gateway that is killed")
	fs.IntVar(&c.churnNodes, "fleet-churn-nodes", 200, "fleet-churn: simulated nodes (4 GPUs each)")
	fs.Float64Var(&c.churnRate, "fleet-churn-rate", 40, "fleet-churn: reservations per second (each cancelled after 3 s)")
	fs.DurationVar(&c.ramp, "fleet-ramp", 40*time.Second, "how long the simulated nodes take to dial for the first time (spreads the TLS handshakes)")
}

// fleetStack is `millrace dev` and any extra gateways of one scenario.
type fleetStack struct {
	dir, dbURL, natsURL string
	dev                 *proc
	devGateway, resv    string
	bes                 string // dev's BES edge
	caDir, apiKey       string
	gateways            []*proc
	devEnv              []string
	devReady            string
}

func (b *bench) startFleetStack(ctx context.Context, dir, dbURL string, extraEnv ...string) (*fleetStack, error) {
	addrs := make([]string, 7)
	for i := range addrs {
		a, err := freeAddr()
		if err != nil {
			return nil, err
		}
		addrs[i] = a
	}
	s := &fleetStack{dir: dir, dbURL: dbURL, natsURL: "nats://" + addrs[0], devGateway: addrs[2], resv: addrs[3], bes: addrs[1],
		caDir: filepath.Join(dir, "fleet", "ca")}
	s.apiKey = "bench-" + strconv.FormatInt(time.Now().UnixNano(), 36) + "-key"
	embeddedNATS(s.natsURL, filepath.Join(dir, "nats"))
	env := []string{
		"DATABASE_URL=" + dbURL,
		"MILLRACE_NATS_DIR=" + filepath.Join(dir, "nats"),
		"MILLRACE_NATS_LISTEN=" + addrs[0],
		"MILLRACE_NATS_SYNC=" + b.cfg.natsSync,
		"MILLRACE_BES_LISTEN=" + addrs[1],
		"MILLRACE_FLEET_LISTEN=" + addrs[2],
		"MILLRACE_RESERVATIONS_LISTEN=" + addrs[3],
		"MILLRACE_COMMITS_LISTEN=" + addrs[6],
		// The compactor's bucket, in the scenario's directory (the
		// default, var/bucket, is under the bench's working directory).
		"MILLRACE_BUCKET_URL=" + filepath.Join(dir, "bucket"),
		"MILLRACE_HTTP_LISTEN=" + addrs[4],
		"MILLRACE_FLEET_CA_DIR=" + s.caDir,
		"MILLRACE_FLEET_API_KEYS=bench=" + s.apiKey,
		"MILLRACE_FLEET_MAX_PENDING_PER_OWNER=1000000",
		"MILLRACE_FLEET_GATEWAY_ID=dev",
		"MILLRACE_SHUTDOWN_TIMEOUT=10s",
	}
	s.devEnv = append(env, extraEnv...)
	s.devReady = "http://" + addrs[4] + "/readyz"
	if err := s.startDev(ctx, b); err != nil {
		return nil, err
	}
	return s, nil
}

func (s *fleetStack) startDev(ctx context.Context, b *bench) error {
	p, err := startProc("dev", b.cfg.bin, []string{"dev"}, s.devEnv, filepath.Join(s.dir, fmt.Sprintf("dev.%d.log", time.Now().UnixNano())))
	if err != nil {
		return err
	}
	s.dev = p
	if err := waitReady(ctx, p, s.devReady, readyTimeout); err != nil {
		p.stop(stopGrace)
		return err
	}
	return nil
}

// startGateway starts one more gateway, `millrace serve fleet`, on the
// stack's backbone and CA.
func (b *bench) startGateway(ctx context.Context, s *fleetStack, id, addr string) (*proc, error) {
	web, err := freeAddr()
	if err != nil {
		return nil, err
	}
	env := append(natsEnv(s.natsURL),
		"MILLRACE_FLEET_LISTEN="+addr,
		"MILLRACE_FLEET_GATEWAY_ID="+id,
		"MILLRACE_FLEET_CA_DIR="+s.caDir,
		"MILLRACE_HTTP_LISTEN="+web,
		"MILLRACE_SHUTDOWN_TIMEOUT=10s",
	)
	if g := os.Getenv("BENCH_GATEWAY_GOGC"); g != "" {
		env = append(env, "GOGC="+g)
	}
	if l := os.Getenv("BENCH_GATEWAY_GOMEMLIMIT"); l != "" {
		env = append(env, "GOMEMLIMIT="+l)
	}
	p, err := startProc(id, b.cfg.bin, []string{"serve", "fleet"}, env, filepath.Join(s.dir, id+".log"))
	if err != nil {
		return nil, err
	}
	if err := waitReady(ctx, p, "http://"+web+"/readyz", readyTimeout); err != nil {
		p.stop(stopGrace)
		return nil, err
	}
	s.gateways = append(s.gateways, p)
	return p, nil
}

func (s *fleetStack) stop() {
	for _, g := range s.gateways {
		if !g.exited() {
			g.stop(stopGrace)
		}
	}
	s.dev.stop(stopGrace)
}

// simulate runs the fleet simulator with args (its flags) and returns its
// report; onAllHeld, if set, runs once every node holds a session.
func (b *bench) simulate(ctx context.Context, s *fleetStack, args []string, onAllHeld func()) (*fleetsim.Report, error) {
	var cfg fleetsim.Config
	fs := flag.NewFlagSet("fleetsim", flag.ContinueOnError)
	cfg.RegisterFlags(fs)
	base := []string{
		"-ca-cert", filepath.Join(s.caDir, "ca.crt"), "-ca-key", filepath.Join(s.caDir, "ca.key"),
		"-server-name", "localhost",
		"-nats-url", s.natsURL, "-nats-nkey", natsSeed(s.natsURL), "-database-url", s.dbURL,
		"-reservations", s.resv, "-api-key", s.apiKey,
		"-ramp", b.cfg.fleet.ramp.String(),
	}
	if err := fs.Parse(append(base, args...)); err != nil {
		return nil, err
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	out := &lineWatch{w: os.Stdout, prefix: "fleetsim: all ", f: onAllHeld}
	return fleetsim.Run(ctx, cfg, out)
}

// lineWatch passes progress through and calls f once at the first line
// that starts with prefix.
type lineWatch struct {
	w      io.Writer
	prefix string
	f      func()
	once   sync.Once
	buf    []byte
}

func (l *lineWatch) Write(p []byte) (int, error) {
	l.buf = append(l.buf, p...)
	for {
		i := strings.IndexAny(string(l.buf), "\n\r")
		if i < 0 {
			break
		}
		line := string(l.buf[:i])
		l.buf = l.buf[i+1:]
		if l.f != nil && strings.HasPrefix(line, l.prefix) {
			l.once.Do(func() { go l.f() })
		}
	}
	return l.w.Write(p)
}

func (b *bench) fleetScenario(ctx context.Context, name string, rep *scenarioReport) error {
	fc := b.cfg.fleet
	dir, err := mkdir(b.tmp, name)
	if err != nil {
		return err
	}
	if !b.cfg.keep {
		defer os.RemoveAll(dir)
	}
	db, dbURL, err := b.pg.createDB(ctx, name)
	if err != nil {
		return err
	}
	defer b.pg.dropDB(db)
	var extra []string
	if name == scFleetChurn {
		// A short grace, so that crashes longer than it fit in the run.
		extra = []string{"MILLRACE_FLEET_SUSPECT_AFTER=5s", "MILLRACE_FLEET_UNREACHABLE_AFTER=10s",
			"MILLRACE_FLEET_CLOCK_SLACK=5s", "MILLRACE_PLACER_BIND_TIMEOUT=10s", "MILLRACE_PLACER_UNBIND_RETRY=2s"}
	}
	s, err := b.startFleetStack(ctx, dir, dbURL, extra...)
	if err != nil {
		return err
	}
	defer func() { s.stop() }()

	var sim *fleetsim.Report
	switch name {
	case scFleetSessions:
		rep.Description = fmt.Sprintf("%d simulated nodes hold mTLS sessions with one `millrace serve fleet` at 10 s heartbeats; the gateway's RSS per session", fc.sessions)
		addr, err := freeAddr()
		if err != nil {
			return err
		}
		g, err := b.startGateway(ctx, s, "gw-sessions", addr)
		if err != nil {
			return err
		}
		sim, err = b.simulate(ctx, s, []string{
			"-gateways", addr, "-gateway-pids", strconv.Itoa(g.pid()),
			"-nodes", strconv.Itoa(fc.sessions), "-duration", (fc.ramp + 30*time.Second + fc.sessionsHold).String(),
			"-status-rate", "20",
		}, nil)
		if err != nil {
			return err
		}
		rep.Checks = append(rep.Checks,
			atLeast(name+": sessions held at once by one gateway", float64(sim.Sessions.Peak), float64(fc.sessions), "sessions",
				"the target is 20,000; this machine allows 20,000 open files per process, which one gateway's sessions, its backbone and its listener must share"),
			atMost(name+": gateway RSS per session", sim.RSSPerSessionKiB, 1<<20/20000.0, "KiB", "1 GiB for 20,000 sessions"))
	case scFleetPlace:
		rep.Description = fmt.Sprintf("reservations at up to %.0f/s through the API onto %d simulated nodes (8 GPUs each): placements/s on PostgreSQL", fc.placeRate, fc.placeNodes)
		sim, err = b.simulate(ctx, s, []string{
			"-gateways", s.devGateway, "-nodes", strconv.Itoa(fc.placeNodes), "-gpus-per-node", "8",
			"-duration", (fc.ramp + 20*time.Second + fc.placeDuration).String(),
			"-reservation-rate", fmt.Sprint(fc.placeRate), "-reservation-hold", "5s",
		}, nil)
		if err != nil {
			return err
		}
		rep.Checks = append(rep.Checks,
			atLeast(fmt.Sprintf("%s: placements per second at %d nodes", name, fc.placeNodes), sim.Placements.PerSecond, 2000, "placements/s",
				"the whole system on 2 vCPUs: simulator, gateway, API, JetStream, placer and PostgreSQL"))
	case scFleetActive:
		rep.Description = fmt.Sprintf("reservations at %.0f/s onto %d nodes: from the placement decision to the node's BOUND answer", fc.activeRate, fc.activeNodes)
		sim, err = b.simulate(ctx, s, []string{
			"-gateways", s.devGateway, "-nodes", strconv.Itoa(fc.activeNodes),
			"-duration", (fc.ramp + 10*time.Second + fc.activeWindow).String(),
			"-reservation-rate", fmt.Sprint(fc.activeRate), "-reservation-hold", "10s",
		}, nil)
		if err != nil {
			return err
		}
		rep.Checks = append(rep.Checks,
			below(fmt.Sprintf("%s: place-to-active p99 at %.0f placements/s", name, fc.activeRate), sim.Placements.PlaceToActive.P99MS, 500, "ms", ""))
	case scFleetChurn:
		rep.Description = fmt.Sprintf("churn onto %d nodes: reservations cancelled 3 s after they are made, a reconnect storm, "+
			"crashes shorter (5 s) then longer (15 s) than the 10 s grace, and a SIGKILL of `millrace dev` (restarted); Binds that meet a GPU held for another allocation", fc.churnNodes)
		common := []string{"-gateways", s.devGateway, "-nodes", strconv.Itoa(fc.churnNodes), "-gpus-per-node", "4",
			"-reservation-rate", fmt.Sprint(fc.churnRate), "-reservation-hold", "3s", "-crash-rate", "60",
			"-unreachable-after", "10s", "-settle", "10s"}
		first, err := b.simulate(ctx, s, append(common, "-node-prefix", "churn-a-", "-crash-for", "5s",
			"-storm-at", (fc.ramp+20*time.Second).String(), "-duration", (fc.ramp+40*time.Second).String()), nil)
		if err != nil {
			return err
		}
		var killErr error
		killed := make(chan struct{})
		kill := func() {
			defer close(killed)
			time.Sleep(15 * time.Second) // into the load
			s.dev.cmd.Process.Signal(syscall.SIGKILL)
			s.dev.cmd.Wait()
			fmt.Printf("bench: killed millrace dev at %s\n", time.Now().Format(time.TimeOnly))
			killErr = s.startDev(ctx, b)
		}
		sim, err = b.simulate(ctx, s, append(common, "-node-prefix", "churn-b-", "-crash-for", "15s",
			"-duration", (fc.ramp+45*time.Second).String()), kill)
		if err != nil {
			return err
		}
		<-killed
		if killErr != nil {
			return killErr
		}
		rep.Checks = append(rep.Checks,
			atMost(name+": Binds meeting a GPU held for another allocation (short crashes, storm)", float64(first.Binds.Conflicts), 0, "binds",
				fmt.Sprintf("%d binds, %d unbinds", first.Binds.Received, first.Binds.Unbinds)),
			atMost(name+": Binds meeting a GPU held for another allocation (long crashes, kill -9)", float64(sim.Binds.Conflicts), 0, "binds",
				fmt.Sprintf("%d binds, %d unbinds", sim.Binds.Received, sim.Binds.Unbinds)))
	case scFleetRehome:
		rep.Description = fmt.Sprintf("%d nodes on one `millrace serve fleet`; it is SIGKILLed and they re-home through another", fc.rehomeNodes)
		addrA, err := freeAddr()
		if err != nil {
			return err
		}
		addrB, err := freeAddr()
		if err != nil {
			return err
		}
		a, err := b.startGateway(ctx, s, "gw-a", addrA)
		if err != nil {
			return err
		}
		var (
			killedAt time.Time
			killErr  error
			killed   = make(chan struct{})
		)
		// B is not up while the nodes dial first, so every node is on A.
		kill := func() {
			defer close(killed)
			if _, killErr = b.startGateway(ctx, s, "gw-b", addrB); killErr != nil {
				return
			}
			killedAt = time.Now()
			a.cmd.Process.Signal(syscall.SIGKILL)
			fmt.Printf("bench: killed gw-a (%d sessions) at %s\n", fc.rehomeNodes, killedAt.Format(time.TimeOnly))
		}
		sim, err = b.simulate(ctx, s, []string{
			"-gateways", addrA + "," + addrB, "-nodes", strconv.Itoa(fc.rehomeNodes),
			"-duration", (fc.ramp + 90*time.Second).String(),
		}, kill)
		if err != nil {
			return err
		}
		select {
		case <-killed:
		default:
			return errors.New("the nodes never all held sessions: gw-a was not killed")
		}
		if killErr != nil {
			return killErr
		}
		rep.Checks = append(rep.Checks,
			below(fmt.Sprintf("%s: re-home p99 of %d nodes after a gateway kill", name, fc.rehomeNodes), sim.Rehome.P99MS/1000, 15, "s", ""),
			atLeast(fmt.Sprintf("%s: nodes re-homed", name), float64(sim.Rehome.Count), float64(fc.rehomeNodes), "nodes", ""))
	}
	if sim != nil {
		rep.Fleet = sim
		if sim.DoubleBookings != nil {
			rep.Checks = append(rep.Checks, atMost(name+": double bookings", float64(sim.DoubleBookings.Total), 0, "GPUs", ""))
		}
		if sim.Liveness != nil {
			rep.Checks = append(rep.Checks, atMost(name+": false unreachable marks", float64(sim.Liveness.FalseUnreachable), 0, "nodes", ""))
		}
	}
	return nil
}
