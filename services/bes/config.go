package bes

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/millrace/millrace/internal/apikey"
	"github.com/millrace/millrace/internal/knob"
	"github.com/millrace/millrace/internal/netlimit"
	"github.com/millrace/millrace/services/bes/redact"
	"github.com/millrace/millrace/streams"
)

// Config of the BES edge. A zero field takes its default; a negative
// number or duration is refused by New and Validate.
type Config struct {
	// MaxEventBytes is the largest single build event accepted. Default
	// 4 MiB; it must leave 64 KiB of the backbone's largest message for
	// headers, and Start lowers it to do so (FitPayload).
	MaxEventBytes int
	// MaxStreams is the most event streams open at once; more get
	// RESOURCE_EXHAUSTED, which Bazel retries with backoff. Default 2000.
	MaxStreams int
	// MaxStreamsPerProject caps what one project can hold. Default
	// MaxStreams/2.
	MaxStreamsPerProject int
	// MaxInFlight is how many events of one stream may await storage
	// before the edge stops reading from it. Default 1000.
	MaxInFlight int
	// Keys, when not empty, makes every stream and lifecycle event
	// authenticate with an API key; each key belongs to one project.
	Keys Keys
	// DefaultProject names events that carry no project id. Default "default".
	DefaultProject string
	// Redactor removes secrets from every build event before it is
	// published (see package redact). Default: the built-in rules, with
	// redact.DefaultAllow.
	Redactor *redact.Redactor
	// NoRedaction stores events exactly as sent. It exists to measure what
	// redaction costs; never set it where real builds arrive.
	NoRedaction bool

	// FirstMessageTimeout is how long a new stream may wait before its
	// first request: a stream is authenticated by that request (Bazel 4
	// sends its key as project_id), and until then it must not hold the
	// server's resources for long. Past it the stream ends with
	// DEADLINE_EXCEEDED. Default 20 s (Bazel sends at once).
	FirstMessageTimeout time.Duration
	// IdleTimeout ends a stream whose client has sent nothing for this
	// long while the edge was waiting to read (DEADLINE_EXCEEDED; Bazel
	// retries, resuming after the last acknowledged event). Time the edge
	// spends waiting on the backbone does not count. Default 30 min, the
	// builds projector's abandon time: a build silent that long is taken
	// for abandoned anyway.
	IdleTimeout time.Duration
	// MaxStreamsPerConn caps the streams one client connection may hold
	// open (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS). A Bazel client holds
	// one or two. Default 100.
	MaxStreamsPerConn int
	// MaxPendingPerAddr caps the streams one client address may hold
	// before their first request (the key of a Bazel 4 client), so that one
	// host's silent streams cannot fill the MaxStreams of them the edge
	// allows and lock every other client out. A Bazel client sends its
	// first request at once, so even a proxy for many builds rarely holds
	// more than a few. Streams with a valid key in their headers are
	// authenticated already and not counted. Default 64.
	MaxPendingPerAddr int

	// limitSetting names what set MaxEventBytes when FitPayload lowered it
	// to the backbone's largest message, for refusals to name; asked is
	// what MaxEventBytes was before, which the edge still reads whole so
	// that an event between the two gets that refusal, not gRPC's.
	limitSetting string
	asked        int
}

// Defaults.
const (
	DefaultMaxEventBytes = 4 << 20
	DefaultMaxStreams    = 2000
	DefaultMaxInFlight   = 1000

	DefaultFirstMessageTimeout = 20 * time.Second
	DefaultIdleTimeout         = 30 * time.Minute
	DefaultMaxStreamsPerConn   = 100
	DefaultMaxPendingPerAddr   = 64
)

func (c Config) withDefaults() Config {
	if c.MaxEventBytes == 0 {
		c.MaxEventBytes = DefaultMaxEventBytes
	}
	if c.MaxStreams == 0 {
		c.MaxStreams = DefaultMaxStreams
	}
	if c.MaxStreamsPerProject == 0 {
		c.MaxStreamsPerProject = max(1, c.MaxStreams/2)
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = DefaultMaxInFlight
	}
	if c.DefaultProject == "" {
		c.DefaultProject = "default"
	}
	if c.Redactor == nil {
		c.Redactor = redact.MustNew(redact.Config{Allow: redact.DefaultAllow})
	}
	if c.FirstMessageTimeout == 0 {
		c.FirstMessageTimeout = DefaultFirstMessageTimeout
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = DefaultIdleTimeout
	}
	if c.MaxStreamsPerConn == 0 {
		c.MaxStreamsPerConn = DefaultMaxStreamsPerConn
	}
	if c.MaxPendingPerAddr == 0 {
		c.MaxPendingPerAddr = DefaultMaxPendingPerAddr
	}
	return c
}

// Validate reports what is wrong with c, checking the event limit against
// the backbone's max payload (0: not checked).
func (c Config) Validate(maxPayload int64) error {
	errs := []error{
		knob.NotNegative("bes", "MaxEventBytes", c.MaxEventBytes, DefaultMaxEventBytes),
		knob.NotNegative("bes", "MaxStreams", c.MaxStreams, DefaultMaxStreams),
		knob.NotNegative("bes", "MaxStreamsPerProject", c.MaxStreamsPerProject, "MaxStreams/2"),
		knob.NotNegative("bes", "MaxInFlight", c.MaxInFlight, DefaultMaxInFlight),
		knob.NotNegative("bes", "FirstMessageTimeout", c.FirstMessageTimeout, DefaultFirstMessageTimeout),
		knob.NotNegative("bes", "IdleTimeout", c.IdleTimeout, DefaultIdleTimeout),
		knob.NotNegative("bes", "MaxStreamsPerConn", c.MaxStreamsPerConn, DefaultMaxStreamsPerConn),
		knob.NotNegative("bes", "MaxPendingPerAddr", c.MaxPendingPerAddr, DefaultMaxPendingPerAddr),
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	c = c.withDefaults()
	// Headers and the envelope around the event take a few hundred bytes.
	if maxPayload > 0 && int64(c.MaxEventBytes)+streams.HeaderRoom > maxPayload {
		return fmt.Errorf("bes: max event size %d does not fit the backbone's max payload %d (minus 64 KiB for headers)", c.MaxEventBytes, maxPayload)
	}
	if c.MaxStreamsPerProject > c.MaxStreams {
		return fmt.Errorf("bes: per-project stream limit %d is above the total %d", c.MaxStreamsPerProject, c.MaxStreams)
	}
	if uint64(c.MaxStreamsPerConn) > math.MaxUint32 {
		return fmt.Errorf("bes: MaxStreamsPerConn %d is above HTTP/2's limit of %d", c.MaxStreamsPerConn, uint32(math.MaxUint32))
	}
	return nil
}

// FitPayload returns c with MaxEventBytes lowered to what the backbone's
// largest message leaves room for (pl.Room), when that is less, and a
// sentence for the operator saying so (empty when nothing changed). A NATS
// cluster left at the stock max_payload of 1 MiB then carries events up to
// 960 KiB instead of the edge refusing to start; a larger event is refused
// with a message that names pl's setting, which is the one to raise. An
// event limit of the edge's own below pl is kept as it is.
func (c Config) FitPayload(pl streams.PayloadLimit) (Config, string, error) {
	asked := c.withDefaults().MaxEventBytes
	room, lowered, err := pl.Fit(asked)
	if err != nil || !lowered {
		if err != nil {
			err = fmt.Errorf("bes: build events: %w", err)
		}
		return c, "", err
	}
	c.asked, c.MaxEventBytes, c.limitSetting = asked, room, pl.Setting
	return c, fmt.Sprintf("BES event limit lowered from %d to %d bytes to fit %s: larger events are refused; raise max_payload on every NATS server (ops/nats/nats-server.conf) to accept them",
		c.asked, room, pl.Setting), nil
}

// raise is what a refusal of an oversized event tells the client to change.
func (c Config) raise() string {
	if c.limitSetting != "" {
		return "the limit follows " + c.limitSetting + "; raise max_payload on the NATS servers"
	}
	return "raise MILLRACE_BES_MAX_EVENT_BYTES"
}

// ErrOpenWithoutKeys is returned by CheckExposure.
var ErrOpenWithoutKeys = errors.New("bes: refusing to serve without API keys on an address other hosts can reach")

// CheckExposure refuses an edge without API keys on anything but a
// loopback address: without keys any host that reaches it may publish
// build events as any project. insecureOpen is the operator saying that
// is intended (a private network, a proxy that authenticates).
func CheckExposure(listen string, keys int, insecureOpen bool) error {
	if keys > 0 || insecureOpen || netlimit.IsLoopback(listen) {
		return nil
	}
	return fmt.Errorf("%w: %s accepts connections from other hosts and no key is configured, so anyone who reaches it could publish build events to any project; "+
		"give keys (--bes-api-keys-file, $MILLRACE_BES_API_KEYS_FILE), listen on 127.0.0.1, or pass --bes-insecure-open ($MILLRACE_BES_INSECURE_OPEN=true) if this is intended",
		ErrOpenWithoutKeys, listen)
}

// Keys maps API keys to the project each belongs to: an apikey.Table,
// kept as digests and compared in constant time, shared by the copies of a
// Config (a reload replaces its keys for all). The zero value has no keys.
type Keys struct{ *apikey.Table[string] }

var keySyntax = apikey.Syntax[string]{
	Package: "bes", What: "API key", Name: "project", Form: "project=key",
	Principal: func(project string) (string, error) { return project, nil },
}

// ParseKeys reads "project=key,project=key" (or one pair per line; the
// syntax is apikey's). A project may have several keys.
func ParseKeys(s string) (Keys, error) {
	t, err := apikey.Parse(s, keySyntax)
	return Keys{t}, err
}

// Project returns the project a key belongs to.
func (k Keys) Project(key string) (string, bool) { return k.Lookup(key) }
