package commitsload

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/knob"
	"github.com/millrace/millrace/projectors/compactor"
)

// Config is one run. The zero value of a field takes the default named in
// its flag (RegisterFlags); Validate checks the rest.
type Config struct {
	// Addr is the commits edge's gRPC address (host:port) the writers use;
	// ReadAddr is where the oracle reads back (default Addr): point it at
	// a freshly started edge to check what a cold start serves.
	Addr, ReadAddr string
	// APIKey is sent as "authorization: Bearer KEY"; it must be allowed
	// every world of the run.
	APIKey string

	// World names the world, or with Worlds > 1 the prefix of the worlds
	// World-0 ... World-(Worlds-1).
	World  string
	Worlds int
	// Docs is the number of documents per world; their ids are IDPrefix
	// and a number zero-padded to at least 7 digits.
	Docs     int
	IDPrefix string
	// BodyBytes is every body's size (at least 8: each body starts with a
	// number unique to its write, so that no two versions look alike).
	BodyBytes int

	// Writers and InFlight: a writer is one client, with its own gRPC
	// connection (all share one with SharedConn), that keeps up to
	// InFlight puts outstanding; the run has Writers × InFlight puts in
	// flight at most.
	Writers, InFlight int
	SharedConn        bool
	// Rate is the total puts per second asked of all writers (0: flat
	// out). Paced puts measure their latency from the moment the pacer
	// scheduled them, so a writer that falls behind shows it.
	Rate float64
	// Fill first writes every document once, in order (world by world
	// within each document number), before the random updates.
	Fill bool
	// Writes is the number of random updates after the fill; Duration
	// bounds the update phase in time. Both 0: no updates after a fill,
	// otherwise DefaultDuration.
	Writes   int64
	Duration time.Duration
	// Warmup is left out of the latency histogram and the rate: puts sent
	// before it ends still count as acknowledged versions for the oracle.
	Warmup time.Duration
	// CASFraction is the fraction of updates sent with compare-and-set
	// (expected_version = the latest version this run saw acknowledged for
	// the document, 0 for one it never wrote); refusals count as conflicts,
	// not errors.
	CASFraction float64
	// RPCTimeout bounds each call.
	RPCTimeout time.Duration

	// Fold runs one compactor pass per world in this process after the
	// writes (commitlog.FoldWorld with the compactor), reading the stream at
	// NATSURL and writing the bucket at BucketURL (the one the edge reads:
	// `serve commits --bucket-url`).
	Fold      bool
	NATSURL   string
	BucketURL string
	// Bucket, when set, is used instead of opening BucketURL: a caller
	// in the same process as the edge shares its bucket (a mem:// bucket
	// is a new one at each Open).
	Bucket compactor.Store

	// NoVerify skips the oracle; VerifyOnly skips the writes and checks the
	// acknowledged versions in Ledger (written by earlier runs).
	NoVerify, VerifyOnly bool
	// Ledger is a file of every acknowledged put (world, id, version, body
	// hash) and every put that failed without a clear answer: written
	// after the writes (appended to with LedgerAppend), read by
	// VerifyOnly.
	Ledger       string
	LedgerAppend bool
	// VerifyConcurrency is how many documents the oracle checks at once.
	VerifyConcurrency int
	// VerifyFraction is the fraction of the ledger's documents whose
	// every acknowledged version is read back with Get and History (0:
	// all; evenly spread over the documents); List checks every document
	// whatever it is. Reading a million versions back takes longer than
	// writing them: a benchmark may check a sample.
	VerifyFraction float64
	// VerifyTimeout, when positive, stops reading documents back after
	// that long (List is always paged through first, whatever it takes):
	// the report then says how many of the documents were not checked,
	// and that counts as a finding.
	VerifyTimeout time.Duration

	// PIDs are processes on this machine (name=pid) whose CPU time is
	// measured over each phase: the edge and NATS, to give CPU-seconds per
	// 1,000 writes.
	PIDs map[string]int

	// ProgressEvery is the progress line's period (negative: none).
	ProgressEvery time.Duration
	// Out is where the caller writes the JSON report ("-": stdout); Run
	// itself does not write it (WriteReport does).
	Out string
	// Seed makes the random choices repeatable; 0 picks one.
	Seed uint64

	// flags is the flag set RegisterFlags registered on: Validate reports
	// its environment variables that did not parse and its negative values.
	flags *flag.FlagSet
}

// Defaults.
const (
	DefaultAddr              = "127.0.0.1:1987"
	DefaultWorld             = "load"
	DefaultDocs              = 10_000
	DefaultIDPrefix          = "doc-"
	DefaultBodyBytes         = 100
	DefaultWriters           = 3
	DefaultInFlight          = 16
	DefaultDuration          = 30 * time.Second
	DefaultRPCTimeout        = 10 * time.Second
	DefaultVerifyConcurrency = 32
	DefaultProgressEvery     = time.Second
)

func (c Config) withDefaults() Config {
	if c.Addr == "" {
		c.Addr = DefaultAddr
	}
	if c.ReadAddr == "" {
		c.ReadAddr = c.Addr
	}
	if c.World == "" {
		c.World = DefaultWorld
	}
	if c.Worlds == 0 {
		c.Worlds = 1
	}
	if c.Docs == 0 {
		c.Docs = DefaultDocs
	}
	if c.IDPrefix == "" {
		c.IDPrefix = DefaultIDPrefix
	}
	if c.BodyBytes == 0 {
		c.BodyBytes = DefaultBodyBytes
	}
	if c.Writers == 0 {
		c.Writers = DefaultWriters
	}
	if c.InFlight == 0 {
		c.InFlight = DefaultInFlight
	}
	if c.Writes == 0 && c.Duration == 0 && !c.Fill {
		c.Duration = DefaultDuration
	}
	if c.RPCTimeout == 0 {
		c.RPCTimeout = DefaultRPCTimeout
	}
	if c.VerifyConcurrency == 0 {
		c.VerifyConcurrency = DefaultVerifyConcurrency
	}
	if c.VerifyFraction == 0 {
		c.VerifyFraction = 1
	}
	if c.ProgressEvery == 0 {
		c.ProgressEvery = DefaultProgressEvery
	}
	return c
}

// WorldNames are the run's worlds.
func (c Config) WorldNames() []string {
	c = c.withDefaults()
	if c.Worlds == 1 {
		return []string{c.World}
	}
	out := make([]string, c.Worlds)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%d", c.World, i)
	}
	return out
}

// Validate checks the configuration (with defaults applied).
func (c Config) Validate() error {
	c = c.withDefaults()
	var errs []error
	if c.flags != nil {
		errs = append(errs, envflag.Errors(c.flags))
	}
	for _, a := range []string{c.Addr, c.ReadAddr} {
		if _, _, err := net.SplitHostPort(a); err != nil {
			errs = append(errs, fmt.Errorf("edge address %q: want host:port", a))
		}
	}
	if c.APIKey == "" {
		errs = append(errs, errors.New("no API key: give -api-key (a key allowed every world of the run, e.g. one of MILLRACE_COMMITS_API_KEYS's *=KEY)"))
	}
	if c.Worlds < 1 || c.Worlds > 1<<16 {
		errs = append(errs, fmt.Errorf("worlds %d: want 1..65536", c.Worlds))
	}
	if c.Docs < 1 || c.Docs > 1<<31 {
		errs = append(errs, fmt.Errorf("docs %d: want at least 1", c.Docs))
	}
	if c.BodyBytes < 8 {
		errs = append(errs, fmt.Errorf("body size %d: want at least 8 bytes (each body starts with its write's number)", c.BodyBytes))
	}
	if c.Writers < 1 || c.InFlight < 1 {
		errs = append(errs, errors.New("writers and in-flight must be at least 1"))
	}
	errs = append(errs,
		knob.NotNegative("", "-rate", c.Rate, "flat out"),
		knob.NotNegative("", "-writes", c.Writes, "bounded by -duration"),
		knob.NotNegative("", "-duration", c.Duration, DefaultDuration),
		knob.NotNegative("", "-warmup", c.Warmup, "none"),
		knob.NotNegative("", "-rpc-timeout", c.RPCTimeout, DefaultRPCTimeout),
		knob.NotNegative("", "-verify-timeout", c.VerifyTimeout, "no limit"),
	)
	if c.CASFraction < 0 || c.CASFraction > 1 {
		errs = append(errs, fmt.Errorf("cas fraction %v: want 0..1", c.CASFraction))
	}
	if c.Fold && (c.NATSURL == "" || (c.BucketURL == "" && c.Bucket == nil)) {
		errs = append(errs, errors.New("fold needs -nats-url (the edge's NATS) and -bucket-url (the bucket the edge reads: serve commits --bucket-url)"))
	}
	if c.Fold && c.VerifyOnly {
		errs = append(errs, errors.New("fold and verify-only do not go together: fold once after the writes"))
	}
	if c.VerifyOnly && c.Ledger == "" {
		errs = append(errs, errors.New("verify-only needs -ledger: the file of acknowledged versions an earlier run wrote"))
	}
	if c.VerifyOnly && c.NoVerify {
		errs = append(errs, errors.New("verify-only and no-verify contradict each other"))
	}
	if c.VerifyFraction < 0 || c.VerifyFraction > 1 {
		errs = append(errs, fmt.Errorf("verify fraction %v: want 0..1", c.VerifyFraction))
	}
	if c.VerifyConcurrency < 1 {
		errs = append(errs, errors.New("verify concurrency must be at least 1"))
	}
	return errors.Join(errs...)
}

// Description is the help of `millrace loadtest commits`, beside the flags it
// describes (RegisterFlags).
const Description = `Puts document versions through the commits edge (gRPC, --addr): --writers
clients, each with its own connection (--shared-conn: one for all) and up to
--in-flight puts outstanding, on one world or --worlds, over --docs documents
per world: first each document once (--fill), then random updates for
--writes or --duration, flat out or at --rate puts/s, blind or a
--cas-fraction with compare-and-set. With --fold it then folds every world
into the bucket in this process (the compactor over --nats-url into
--bucket-url, which must be the bucket the edge reads).

Then the oracle reads back, from --read-addr (default --addr; a freshly
started edge measures a cold start): List of each world (the first page
timed, every document at its latest acknowledged version), Get of every
acknowledged version (same body) and each document's History (every
acknowledged version, in order). Lost, mismatched and gaps must be 0.
--ledger keeps the acknowledged versions in a file; --verify-only checks
them again later without writing.

Prints progress to stderr every second and writes a JSON report (--out; -
for stdout): acked writes/s, latency p50/p99/p99.9/max, errors by gRPC code,
the fold's documents/s and bucket operations per document, the oracle's
counts, and the CPU of --pids processes per 1,000 writes. Exits non-zero
when the oracle finds a problem. See loadtest/commitsload/README.md.`

// RegisterFlags registers a flag for every field on fs, each defaulting to
// its environment variable when set (the command line wins over the
// environment, the environment over the default): MILLRACE_COMMITSLOAD_*,
// plus MILLRACE_NATS_URL and MILLRACE_BUCKET_URL.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	c.flags = fs
	e := envflag.Set{FS: fs, Prefix: "MILLRACE_COMMITSLOAD_"}
	e.String(&c.Addr, "addr", "ADDR", DefaultAddr, "commits edge gRPC address the writers use")
	e.String(&c.ReadAddr, "read-addr", "READ_ADDR", "", "commits edge the oracle reads back from, e.g. a freshly started one (default: -addr)")
	e.String(&c.APIKey, "api-key", "API_KEY", "", "API key allowed every world of the run (sent as authorization: Bearer)")
	e.String(&c.World, "world", "WORLD", DefaultWorld, "the world, or with -worlds > 1 the prefix of WORLD-0, WORLD-1, ...")
	e.Int(&c.Worlds, "worlds", "WORLDS", 1, "number of worlds, written alike")
	e.Int(&c.Docs, "docs", "DOCS", DefaultDocs, "documents per world")
	e.String(&c.IDPrefix, "id-prefix", "ID_PREFIX", DefaultIDPrefix, "document ids are this prefix and a zero-padded number")
	e.Int(&c.BodyBytes, "body-bytes", "BODY_BYTES", DefaultBodyBytes, "size of every body (at least 8)")
	e.Int(&c.Writers, "writers", "WRITERS", DefaultWriters, "writers: clients with a gRPC connection each (see -shared-conn) and up to -in-flight puts outstanding")
	e.Int(&c.InFlight, "in-flight", "IN_FLIGHT", DefaultInFlight, "puts each writer keeps outstanding")
	e.Bool(&c.SharedConn, "shared-conn", "SHARED_CONN", "all writers share one gRPC connection")
	e.Float(&c.Rate, "rate", "RATE", 0, "total puts per second over all writers (0: flat out)")
	e.Bool(&c.Fill, "fill", "FILL", "first write every document once, in order, then the updates")
	e.Int64(&c.Writes, "writes", "WRITES", 0, "random updates after the fill (0: bounded by -duration)")
	e.Duration(&c.Duration, "duration", "DURATION", 0, fmt.Sprintf("how long the updates run (0 and -writes 0: %s, or none after -fill)", DefaultDuration))
	e.Duration(&c.Warmup, "warmup", "WARMUP", 0, "first part of the writes left out of the rate and latency figures")
	e.Float(&c.CASFraction, "cas-fraction", "CAS_FRACTION", 0, "fraction of updates sent with compare-and-set on the latest version seen (conflicts are counted)")
	e.Duration(&c.RPCTimeout, "rpc-timeout", "RPC_TIMEOUT", DefaultRPCTimeout, "deadline of each call")
	e.Bool(&c.Fold, "fold", "FOLD", "after the writes, fold each world into the bucket in this process (needs -nats-url and -bucket-url)")
	envflag.String(fs, &c.NATSURL, "nats-url", "MILLRACE_NATS_URL", "", "NATS of the edge (for -fold)")
	envflag.String(fs, &c.BucketURL, "bucket-url", "MILLRACE_BUCKET_URL", "", "bucket the edge reads folded versions from, e.g. file:///abs/dir (for -fold)")
	e.Bool(&c.NoVerify, "no-verify", "NO_VERIFY", "skip the oracle (read-back of every acknowledged version)")
	e.Bool(&c.VerifyOnly, "verify-only", "VERIFY_ONLY", "write nothing: check the acknowledged versions in -ledger")
	e.String(&c.Ledger, "ledger", "LEDGER", "", "file of acknowledged versions: written after the writes, read by -verify-only")
	e.Bool(&c.LedgerAppend, "ledger-append", "LEDGER_APPEND", "append to -ledger instead of replacing it (several runs, one check)")
	e.Int(&c.VerifyConcurrency, "verify-concurrency", "VERIFY_CONCURRENCY", DefaultVerifyConcurrency, "documents the oracle checks at once")
	e.Float(&c.VerifyFraction, "verify-fraction", "VERIFY_FRACTION", 1, "fraction of the documents whose every version the oracle reads back with Get and History (List checks all)")
	e.Duration(&c.VerifyTimeout, "verify-timeout", "VERIFY_TIMEOUT", 0, "stop reading documents back after this long, reporting those left unchecked as a finding (0: no limit)")
	e.Func("pids", "PIDS", "processes whose CPU to measure per phase, name=pid, comma-separated (e.g. edge=123,nats=456)", func(s string) error {
		p, err := ParsePIDs(s)
		c.PIDs = p
		return err
	})
	e.SignedDuration(&c.ProgressEvery, "progress", "PROGRESS", DefaultProgressEvery, "progress line period (negative: none)")
	e.String(&c.Out, "out", "OUT", "", `write the JSON report here ("-": stdout)`)
	e.Var(seedValue{c}, "seed", "SEED", "random seed (0: random)")
}

// ParsePIDs reads "name=pid,name=pid".
func ParsePIDs(s string) (map[string]int, error) {
	out := map[string]int{}
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		name, v, ok := strings.Cut(p, "=")
		n, err := strconv.Atoi(v)
		if !ok || name == "" || err != nil || n <= 0 {
			return nil, fmt.Errorf("pid %q: want name=pid", p)
		}
		out[name] = n
	}
	return out, nil
}

// seedValue writes -seed straight into Config.Seed.
type seedValue struct{ c *Config }

func (v seedValue) String() string {
	if v.c == nil {
		return "0"
	}
	return strconv.FormatUint(v.c.Seed, 10)
}

func (v seedValue) Set(s string) error {
	n, err := strconv.ParseUint(s, 10, 64)
	v.c.Seed = n
	return err
}
