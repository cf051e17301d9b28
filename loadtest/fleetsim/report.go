package fleetsim

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/millrace/millrace/loadtest/replay"
)

// Report is what a run measured. Durations are in milliseconds (Summary:
// count, mean, p50, p90, p99, p99.9, max); see README.md for the exact
// definition of every figure.
type Report struct {
	Started  time.Time `json:"started"`
	Finished time.Time `json:"finished"`
	// DurationS is the load's length (Config.Duration, or less when the
	// run was interrupted); LoadStarted is the first dial.
	DurationS float64 `json:"duration_s"`
	Setup     Setup   `json:"setup"`

	Sessions   Sessions         `json:"sessions"`
	Refusals   map[string]int64 `json:"refusals"`
	Disconnect map[string]int64 `json:"disconnects"`
	Heartbeats int64            `json:"heartbeats"`
	// StatusChanges are the status changes the simulator made (each should
	// make one status report and one status_changed event).
	StatusChanges int64 `json:"status_changes"`

	Rehome Rehome  `json:"rehome"`
	Storm  *Storm  `json:"storm,omitempty"`
	Crash  Crashes `json:"crashes"`

	Reservations Reservations `json:"reservations"`
	Placements   Placements   `json:"placements"`
	Binds        Binds        `json:"binds"`

	Gateways []GatewayProcess `json:"gateways,omitempty"`
	// RSSPerSessionKiB is the gateways' resident memory at the peak of
	// sessions, less their baseline before any node connected, divided by
	// the sessions held then (all gateways together).
	RSSPerSessionKiB float64 `json:"rss_per_session_kib,omitempty"`

	Simulator Simulator `json:"simulator"`

	Liveness *Liveness `json:"liveness,omitempty"`
	// DoubleBookings counts GPUs held by two live allocations (and
	// whole-node allocations sharing a node with another live one) in
	// fleet_allocations at the end; must be 0. Nil without a database.
	DoubleBookings *DoubleBookings `json:"double_bookings,omitempty"`

	// Errors are problems that did not stop the run (a measurement that
	// could not be taken, the first errors of each kind).
	Errors []string `json:"errors,omitempty"`
}

// Setup describes the run.
type Setup struct {
	Nodes          int      `json:"nodes"`
	FirstNode      int      `json:"first_node"`
	Pool           string   `json:"pool"`
	GPUsPerNode    int      `json:"gpus_per_node"`
	Models         []string `json:"models"`
	Gateways       []string `json:"gateways"`
	LocalAddrs     []string `json:"local_addrs,omitempty"`
	Certificates   string   `json:"certificates"` // "ca" or "join"
	CertSetupS     float64  `json:"cert_setup_s"`
	OpenFilesLimit uint64   `json:"open_files_limit"`
	RampS          float64  `json:"ramp_s"`
	StatusRate     float64  `json:"status_rate"`
	CrashRate      float64  `json:"crash_rate_per_min"`
	CrashForS      float64  `json:"crash_for_s"`
	StormAtS       float64  `json:"storm_at_s,omitempty"`
	ReservationRPS float64  `json:"reservation_rate"`
	UnreachableS   float64  `json:"unreachable_after_s"`
	Seed           uint64   `json:"seed"`
}

// Sessions counts welcomed sessions.
type Sessions struct {
	// Held is the sessions held at the end of the load; Peak the most
	// held at once.
	Held int64 `json:"held"`
	Peak int64 `json:"peak"`
	// AllHeldS is the time from the first dial until every node held a
	// session at once (-1: never).
	AllHeldS float64 `json:"all_held_s"`
	// Welcomes counts every Welcome (first sessions and re-homes).
	Welcomes int64 `json:"welcomes"`
	// NeverConnected is nodes that never got a Welcome.
	NeverConnected int `json:"never_connected"`
	// FirstWelcome is each node's time from its first dial to its first
	// Welcome.
	FirstWelcome replay.Summary `json:"first_welcome"`
}

// Rehome is the time from a node's session break (the moment its agent
// noticed it) to its next Welcome, for breaks the simulator did not cause
// itself (a gateway killed, closed or draining, a refusal after Welcome).
type Rehome struct {
	replay.Summary
}

// Storm is the reconnect storm.
type Storm struct {
	At      time.Time `json:"at"`
	Dropped int       `json:"dropped"`
	// Rehome is each dropped node's drop-to-Welcome time.
	Rehome replay.Summary `json:"rehome"`
	// RecoveredS is the time from the drop until the sessions held were
	// back to what they were before it (-1: never within the run).
	RecoveredS float64 `json:"recovered_s"`
}

// Crashes are the simulated crashes (silent nodes).
type Crashes struct {
	Started   int64 `json:"started"`
	Resumed   int64 `json:"resumed"`
	Forever   int64 `json:"forever"`
	Reconnect int64 `json:"reconnected"` // crashed nodes that needed a new session
	// SessionSurvived counts crashes after which the node's session was
	// still up (the silence was shorter than the gateway's timeout).
	SessionSurvived int64 `json:"session_survived"`
}

// Reservations are the requests made through the Reservations API.
type Reservations struct {
	Created      int64            `json:"created"`
	CreateErrors map[string]int64 `json:"create_errors,omitempty"`
	Skipped      int64            `json:"skipped"` // not sent: too many in flight
	Cancelled    int64            `json:"cancelled"`
	CancelErrors map[string]int64 `json:"cancel_errors,omitempty"`
	CreateTime   replay.Summary   `json:"create_latency"`
}

// Placements are the placer's decisions for this simulator's nodes.
type Placements struct {
	Source string `json:"source"` // "nats" (PlacementDecision messages) or "database" (fleet_allocations)
	// Placed counts Placed decisions; Allocations the allocations in them
	// on this process' nodes.
	Placed      int64 `json:"placed"`
	Released    int64 `json:"released"`
	Failed      int64 `json:"failed"`
	Allocations int64 `json:"allocations"`
	// PerSecond is Placed over WindowS, the time from the first
	// reservation request to the end of the load.
	PerSecond float64 `json:"per_second"`
	WindowS   float64 `json:"window_s"`
	// PlaceToActive is, per allocation, the time from the decision's `at`
	// (the placer's clock) to the moment the node answered the Bind with
	// BOUND (the report handed to gRPC). Same machine, same clock.
	PlaceToActive replay.Summary `json:"place_to_active"`
	// NotBound counts allocations placed but not bound by the end of the
	// settle time (and not released first).
	NotBound int64 `json:"not_bound"`
	// ReleasedUnbound counts allocations released before the node bound them.
	ReleasedUnbound int64 `json:"released_unbound"`
}

// Binds are what the simulated nodes saw.
type Binds struct {
	Received int64 `json:"received"`
	Repeats  int64 `json:"repeats"`
	// Conflicts are Binds for GPUs the node already held for another
	// allocation (answered FAILED): a double booking seen by the node.
	Conflicts int64 `json:"conflicts"`
	Invalid   int64 `json:"invalid"` // GPU indices the node does not have
	Unbinds   int64 `json:"unbinds"`
	// ConflictSamples are the first conflicts, to trace them in the
	// decisions (FLEET_PLACE, fleet_allocations).
	ConflictSamples []Conflict `json:"conflict_samples,omitempty"`
}

// Conflict is one Bind that met a GPU held for another allocation.
type Conflict struct {
	At   time.Time `json:"at"`
	Node string    `json:"node"`
	GPU  int32     `json:"gpu"` // -1: a whole-node bind or holder
	// Bound is the allocation of the Bind; Held the one the node holds,
	// which it bound at HeldSince.
	Bound     string    `json:"bound"`
	Held      string    `json:"held"`
	HeldSince time.Time `json:"held_since"`
}

// GatewayProcess is one gateway process's resident set (VmRSS, from
// /proc/<pid>/status, sampled every second) and CPU time (utime + stime
// from /proc/<pid>/stat, from before the first dial to the end of the
// load, or to its last sample if it exited).
type GatewayProcess struct {
	PID          int     `json:"pid"`
	BaselineKiB  int64   `json:"baseline_kib"`
	AtPeakKiB    int64   `json:"at_peak_sessions_kib"`
	MaxKiB       int64   `json:"max_kib"`
	EndKiB       int64   `json:"end_kib"`
	CPUS         float64 `json:"cpu_s"`
	Gone         bool    `json:"gone,omitempty"` // exited during the run
	peakSessions int64   // sessions held when AtPeakKiB was read
	cpu0, cpu    time.Duration
}

// Simulator is the simulator process' own cost, to tell whether it (not
// the system under test) was the limit: CPU time over the load, peak
// resident set, most goroutines seen.
type Simulator struct {
	CPUS           float64 `json:"cpu_s"`
	MaxRSSKiB      int64   `json:"max_rss_kib"`
	PeakGoroutines int     `json:"peak_goroutines"`
}

// Liveness is what the database showed.
type Liveness struct {
	// Lag is, for sampled heartbeats, the time from the node sending it to
	// the first poll (every 50 ms) that finds fleet_nodes.last_seen at or
	// after the send time (less 5 ms). Unseen counts samples not covered
	// within a minute.
	Lag    replay.Summary `json:"lag"`
	Unseen int64          `json:"unseen"`
	// UnreachableMarks counts this process' nodes seen (polled every 2 s,
	// and at the end) with state 'unreachable' and state_since after the
	// run started; FalseUnreachable those among them whose longest outage
	// as the simulator saw it (last heartbeat sent before it to the next
	// Welcome or heartbeat) was shorter than the grace.
	UnreachableMarks int64            `json:"unreachable_marks"`
	FalseUnreachable int64            `json:"false_unreachable"`
	FalseExamples    []FalseMark      `json:"false_examples,omitempty"`
	States           map[string]int64 `json:"states_at_end,omitempty"`
}

// FalseMark is one false unreachable mark.
type FalseMark struct {
	Node          string    `json:"node"`
	StateSince    time.Time `json:"state_since"`
	LongestDownMS float64   `json:"longest_down_ms"`
}

// DoubleBookings is the end-of-run check of fleet_allocations.
type DoubleBookings struct {
	GPUs        int64  `json:"gpus"`
	WholeNode   int64  `json:"whole_node"`
	Total       int64  `json:"total"`
	LiveAllocs  int64  `json:"live_allocations"`
	CheckedPool string `json:"pool"`
}

// WriteReport writes r as indented JSON to path ("-": w).
func WriteReport(path string, r *Report, w io.Writer) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	b = append(b, '\n')
	if path == "-" {
		_, err = w.Write(b)
		return err
	}
	if dir := filepath.Dir(path); dir != "." {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		return fmt.Errorf("write report: %w", err)
	}
	return nil
}
