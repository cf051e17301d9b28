package commitsload

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/millrace/millrace/loadtest/replay"
	"github.com/millrace/millrace/projectors/compactor"
)

// Report is what a run measured; each phase that ran has its section.
// Latencies are in milliseconds (replay.Summary: count, mean, p50, p90,
// p99, p99.9, max); README.md defines every figure.
type Report struct {
	Started  time.Time `json:"started"`
	Finished time.Time `json:"finished"`
	Setup    Setup     `json:"setup"`
	Write    *Write    `json:"write,omitempty"`
	Fold     *Fold     `json:"fold,omitempty"`
	Verify   *Verify   `json:"verify,omitempty"`
	// Processes are the CPU times of Config.PIDs over each phase.
	Processes []Process `json:"processes,omitempty"`
	// Errors are problems that did not stop the run (the first of each
	// kind).
	Errors []string `json:"errors,omitempty"`
}

// Setup describes the run.
type Setup struct {
	Addr         string   `json:"addr"`
	ReadAddr     string   `json:"read_addr"`
	Worlds       []string `json:"worlds"`
	DocsPerWorld int      `json:"docs_per_world"`
	IDForm       string   `json:"id_form"`
	BodyBytes    int      `json:"body_bytes"`
	Writers      int      `json:"writers"`
	InFlight     int      `json:"in_flight_per_writer"`
	// Writer says what one writer is.
	Writer      string  `json:"writer"`
	Connections int     `json:"grpc_connections"`
	Rate        float64 `json:"rate,omitempty"` // asked, puts/s over all writers; 0: flat out
	Fill        bool    `json:"fill"`
	Writes      int64   `json:"writes,omitempty"`
	DurationS   float64 `json:"duration_s,omitempty"`
	WarmupS     float64 `json:"warmup_s"`
	CASFraction float64 `json:"cas_fraction,omitempty"`
	Fold        bool    `json:"fold"`
	VerifyOnly  bool    `json:"verify_only,omitempty"`
	Ledger      string  `json:"ledger,omitempty"`
	Seed        uint64  `json:"seed"`
}

// Write is the write phase (the fill, then the updates).
type Write struct {
	// Attempted puts sent and answered (or timed out); Acked those that
	// returned a version.
	Attempted int64 `json:"attempted"`
	Acked     int64 `json:"acked"`
	FillAcked int64 `json:"fill_acked,omitempty"`
	// CASWrites were sent with expected_version; Conflicts of them were
	// refused (FAILED_PRECONDITION): not errors.
	CASWrites int64 `json:"cas_writes,omitempty"`
	Conflicts int64 `json:"conflicts"`
	// Errors are every other failure, by gRPC code; their documents are
	// "doubtful" for the oracle (the put may have been stored).
	Errors       int64            `json:"errors"`
	ErrorsByCode map[string]int64 `json:"errors_by_code,omitempty"`
	ErrorSamples []string         `json:"error_samples,omitempty"`
	// DuplicateVersions counts versions acknowledged for two different
	// puts: must be 0.
	DuplicateVersions int64 `json:"duplicate_versions"`

	// ElapsedS is the first send to the last answer; FillS of it the fill.
	ElapsedS float64 `json:"elapsed_s"`
	FillS    float64 `json:"fill_s,omitempty"`
	// WindowS is the measured part (after the warm-up, up to the end of
	// the duration or the last answer); WindowAcked the puts acknowledged
	// in it, AckedPerS their rate.
	WindowS     float64 `json:"window_s"`
	WindowAcked int64   `json:"window_acked"`
	AckedPerS   float64 `json:"acked_per_s"`
	// Latency of the window's acknowledged puts: send (or, paced, the
	// moment the pacer scheduled the put) to the version's arrival.
	Latency replay.Summary `json:"latency"`
	// ClientCPUS is this process's CPU time over the phase (the load
	// generator: compare it with the machine's budget).
	ClientCPUS      float64 `json:"client_cpu_s"`
	ClientCPUPer1k  float64 `json:"client_cpu_s_per_1000_writes"`
	ClientMaxRSSKiB int64   `json:"client_max_rss_kib"`
}

// Fold is the in-process compactor pass over each world.
type Fold struct {
	Worlds []FoldWorld `json:"worlds"`
	// Totals over the worlds.
	Versions      int `json:"versions"`
	DocsChanged   int `json:"docs_changed"`
	Docs          int `json:"docs"`
	Dropped       int `json:"versions_dropped"`
	BucketGets    int `json:"bucket_gets"`
	BucketCreates int `json:"bucket_creates"`
	// Seconds is the wall time of the passes (stream read over NATS, fold
	// into the bucket, deletions from the stream); the rates are over it.
	Seconds      float64 `json:"seconds"`
	VersionsPerS float64 `json:"versions_per_s"`
	DocsPerS     float64 `json:"docs_per_s"`
	// BucketOpsPerDoc is (gets + creates) per changed document (the
	// compactor's count; the checkpoint lookup at the start of each pass
	// is one list and one get more); DeletionsPerDoc is stream message
	// deletions per changed document.
	BucketOpsPerDoc float64 `json:"bucket_ops_per_doc"`
	DeletionsPerDoc float64 `json:"deletions_per_doc"`
	// CPUS is this process's CPU time over the passes: the compactor and
	// its NATS client (the server's share is in Processes).
	CPUS        float64 `json:"cpu_s"`
	DocsPerCPUS float64 `json:"docs_per_cpu_s"`
}

// FoldWorld is one world's pass: the compactor's result, and the time of
// the whole commitlog.FoldWorld call.
type FoldWorld struct {
	compactor.Result
	PassS float64 `json:"pass_s"`
}

// Verify is the oracle: every acknowledged version read back.
type Verify struct {
	Addr string `json:"addr"`
	// Docs with acknowledged versions, and those versions. DocsSampled
	// are the documents to read back with Get and History
	// (Config.VerifyFraction of them, evenly spread; all by default);
	// DocsChecked and VersionsChecked those read back. Unchecked counts
	// sampled documents left when Config.VerifyTimeout stopped the
	// oracle: a finding, since their versions were not seen.
	Docs            int     `json:"docs"`
	Versions        int64   `json:"versions"`
	Fraction        float64 `json:"fraction"`
	DocsSampled     int64   `json:"docs_sampled"`
	DocsChecked     int64   `json:"docs_checked"`
	VersionsChecked int64   `json:"versions_checked"`
	Unchecked       int64   `json:"unchecked_docs,omitempty"`
	// Lost: Get of an acknowledged version answered NOT_FOUND.
	// Mismatched: it answered another body (hash), version, or a
	// tombstone. ReadErrors: it failed otherwise, three times.
	Lost       int64 `json:"lost"`
	Mismatched int64 `json:"mismatched"`
	ReadErrors int64 `json:"read_errors"`
	// From History, per document: Gaps are acknowledged versions it does
	// not list; Disorder counts pages not in ascending order;
	// Unexpected are listed versions nobody acknowledged (possible only
	// where a put failed without an answer: UnexpectedAfterErrors counts
	// those on such documents, Unexpected the rest); Earlier are
	// unacknowledged versions older than the ledger's first (written
	// before the run).
	Gaps                  int64 `json:"gaps"`
	Disorder              int64 `json:"disorder"`
	Unexpected            int64 `json:"unexpected"`
	UnexpectedAfterErrors int64 `json:"unexpected_after_errors"`
	Earlier               int64 `json:"earlier"`
	HistoryErrors         int64 `json:"history_errors"`
	// List is the per-world List check; ListError is set when List could
	// not be used at all (e.g. UNIMPLEMENTED by the edge).
	List      []ListWorld `json:"list,omitempty"`
	ListError string      `json:"list_error,omitempty"`
	// Examples are the first problems found, for a person to look at.
	Examples []string `json:"examples,omitempty"`

	Seconds    float64 `json:"seconds"`
	ReadsPerS  float64 `json:"reads_per_s"` // Gets and History pages per second
	ClientCPUS float64 `json:"client_cpu_s"`
	// OK: nothing lost, mismatched, unread, unchecked, missing or out of
	// order.
	OK bool `json:"ok"`
}

// ListWorld is the List check of one world: paged through fully, each
// document of the ledger must be listed at its latest acknowledged version.
type ListWorld struct {
	World string `json:"world"`
	// FirstPageMS is the first List call on this world (on a fresh edge:
	// the world's cold start, its checkpoint and stream tail loaded).
	FirstPageMS float64 `json:"first_page_ms"`
	Seconds     float64 `json:"seconds"`
	Pages       int     `json:"pages"`
	Entries     int64   `json:"entries"`
	// Docs: documents of the ledger listed; Missing: of the ledger, not
	// listed; Stale: listed at a version older than the latest
	// acknowledged (an acknowledged write lost to List); Newer: listed at
	// a version nobody acknowledged; Foreign: listed, not of the ledger;
	// OutOfOrder: ids not ascending.
	Docs       int64  `json:"docs"`
	Missing    int64  `json:"missing"`
	Stale      int64  `json:"stale"`
	Newer      int64  `json:"newer"`
	Foreign    int64  `json:"foreign"`
	OutOfOrder int64  `json:"out_of_order"`
	Error      string `json:"error,omitempty"`
}

// Process is one measured process's CPU time (utime + stime from
// /proc/<pid>/stat) over each phase, and per 1,000 acknowledged writes
// over the write phase.
type Process struct {
	Name        string  `json:"name"`
	PID         int     `json:"pid"`
	WriteCPUS   float64 `json:"write_cpu_s"`
	Per1kWrites float64 `json:"cpu_s_per_1000_writes"`
	FoldCPUS    float64 `json:"fold_cpu_s,omitempty"`
	VerifyCPUS  float64 `json:"verify_cpu_s,omitempty"`
	Gone        bool    `json:"gone,omitempty"`
}

// Failed lists what the run found wrong (empty: nothing): lost,
// mismatched, gaps and the like, and a List that disagrees.
func (r *Report) Failed() []string {
	var out []string
	if w := r.Write; w != nil && w.DuplicateVersions > 0 {
		out = append(out, fmt.Sprintf("%d versions acknowledged twice", w.DuplicateVersions))
	}
	v := r.Verify
	if v == nil {
		return out
	}
	add := func(n int64, what string) {
		if n > 0 {
			out = append(out, fmt.Sprintf("%d %s", n, what))
		}
	}
	add(v.Lost, "lost")
	add(v.Mismatched, "mismatched")
	add(v.ReadErrors, "unread (read errors)")
	add(v.Gaps, "gaps in History")
	add(v.Disorder, "History pages out of order")
	add(v.Unexpected, "unexpected versions (no failed put explains them)")
	add(v.HistoryErrors, "History errors")
	add(v.Unchecked, "sampled documents not read back within the time limit")
	for _, l := range v.List {
		add(l.Missing, "documents missing from List of "+l.World)
		add(l.Stale, "stale List entries of "+l.World)
		add(l.OutOfOrder, "List entries out of order in "+l.World)
		if l.Error != "" {
			out = append(out, "List of "+l.World+": "+l.Error)
		}
	}
	return out
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

func ms(d time.Duration) float64 { return round(float64(d)/1e6, 3) }

func round(v float64, digits int) float64 {
	p := 1.0
	for range digits {
		p *= 10
	}
	if v < 0 {
		return -float64(int64(-v*p+0.5)) / p
	}
	return float64(int64(v*p+0.5)) / p
}

func per(n float64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return round(n/d.Seconds(), 1)
}
