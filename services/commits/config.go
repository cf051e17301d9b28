package commits

import (
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/millrace/millrace/commitlog/layout"
	"github.com/millrace/millrace/internal/apikey"
	"github.com/millrace/millrace/internal/knob"
	"github.com/millrace/millrace/streams"
)

// Config of the commits edge. A zero field takes its default; a negative
// number or duration is refused by New. Keys is required.
type Config struct {
	// Keys are the API keys and the worlds each may use.
	Keys Keys
	// MaxBodyBytes is the largest document body. Default 1 MiB; at most
	// the backbone's largest message less 64 KiB for headers, and Start
	// lowers it to that (FitPayload).
	MaxBodyBytes int
	// Store is the bucket the compactor folds the log into: versions
	// dropped from the stream are read from its history segments, and
	// List opens a world from its latest checkpoint. Nil: the stream is
	// all there is (nothing may compact it).
	Store layout.Reader
	// CacheBytes bounds the decoded bucket objects (shards, history
	// segments) the edge keeps for reads of folded versions. Default 64 MiB.
	CacheBytes int
	// IndexWorlds is how many worlds List keeps open (each holds every
	// document id of its world in memory, about 100 bytes per document
	// plus the id); the least recently listed closes first. Default 16.
	IndexWorlds int
	// ListWait bounds how long List waits for an open world to catch up
	// with the writes acknowledged before the call. Default 10 s.
	ListWait time.Duration
	// ConflictRetries is how many times a write refused although its
	// expected version was still current (a false conflict of a replicated
	// stream) is tried again. Default 8.
	ConflictRetries int

	// limitSetting names what set MaxBodyBytes when FitPayload lowered it,
	// for refusals to name.
	limitSetting string
}

// Defaults and limits.
const (
	DefaultMaxBodyBytes    = 1 << 20
	DefaultConflictRetries = 8
	DefaultCacheBytes      = 64 << 20
	DefaultIndexWorlds     = 16
	DefaultListWait        = 10 * time.Second
	// MaxIDBytes bounds a document id (UTF-8), MaxWorldBytes a world name.
	MaxIDBytes    = 1024
	MaxWorldBytes = 128
	// MaxPageSize bounds a History page.
	MaxPageSize     = 1000
	defaultPageSize = 100
)

func (c Config) withDefaults() Config {
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if c.ConflictRetries == 0 {
		c.ConflictRetries = DefaultConflictRetries
	}
	if c.CacheBytes == 0 {
		c.CacheBytes = DefaultCacheBytes
	}
	if c.IndexWorlds == 0 {
		c.IndexWorlds = DefaultIndexWorlds
	}
	if c.ListWait == 0 {
		c.ListWait = DefaultListWait
	}
	return c
}

// FitPayload returns c with MaxBodyBytes lowered to what the backbone's
// largest message leaves room for (pl.Room), when that is less, and a
// sentence for the operator saying so (empty when nothing changed): a NATS
// cluster at the stock max_payload of 1 MiB takes bodies up to 960 KiB,
// and a larger one is refused with a message naming pl's setting.
func (c Config) FitPayload(pl streams.PayloadLimit) (Config, string, error) {
	asked := c.withDefaults().MaxBodyBytes
	room, lowered, err := pl.Fit(asked)
	if err != nil || !lowered {
		if err != nil {
			err = fmt.Errorf("commits: document bodies: %w", err)
		}
		return c, "", err
	}
	c.MaxBodyBytes, c.limitSetting = room, pl.Setting
	return c, fmt.Sprintf("commit log body limit lowered from %d to %d bytes to fit %s: larger bodies are refused; raise max_payload on every NATS server (ops/nats/nats-server.conf) to accept them",
		asked, room, pl.Setting), nil
}

// tooLarge is the refusal of a body over the limit, naming what to raise.
func (c Config) tooLarge(size int) string {
	raise := "raise MILLRACE_COMMITS_MAX_BODY_BYTES"
	if c.limitSetting != "" {
		raise = "the limit follows " + c.limitSetting + "; raise max_payload on the NATS servers"
	}
	if size < 0 {
		return fmt.Sprintf("millrace: the body is larger than the limit of %d bytes (%s)", c.MaxBodyBytes, raise)
	}
	return fmt.Sprintf("millrace: the body is %d bytes, more than the limit of %d (%s)", size, c.MaxBodyBytes, raise)
}

// Validate reports what is wrong with c.
func (c Config) Validate() error {
	if c.Keys.Len() == 0 {
		return errors.New("commits: no API keys: writers and readers authenticate with one (world=key)")
	}
	return errors.Join(
		knob.NotNegative("commits", "MaxBodyBytes", c.MaxBodyBytes, DefaultMaxBodyBytes),
		knob.NotNegative("commits", "CacheBytes", c.CacheBytes, DefaultCacheBytes),
		knob.NotNegative("commits", "IndexWorlds", c.IndexWorlds, DefaultIndexWorlds),
		knob.NotNegative("commits", "ListWait", c.ListWait, DefaultListWait),
		knob.NotNegative("commits", "ConflictRetries", c.ConflictRetries, DefaultConflictRetries),
	)
}

// Keys are API keys, each for one world or for all of them: an
// apikey.Table of worlds ("*": every world), kept as digests and compared
// in constant time, shared by the copies of a Config (a reload replaces its
// keys for all). The zero value has no keys.
type Keys struct{ *apikey.Table[string] }

var keySyntax = apikey.Syntax[string]{
	Package: "commits", What: "API key", Name: "world", Form: "world=key (or *=key for every world)",
	Principal: func(world string) (string, error) {
		if world == "*" {
			return world, nil
		}
		return world, checkWorld(world)
	},
}

// ParseKeys reads API keys separated by commas or newlines (blank lines and
// lines starting with # are skipped; the syntax is apikey's): world=key for
// one world, *=key for every world. A world may have several keys; keys are
// at least 16 characters and may themselves contain '='.
func ParseKeys(s string) (Keys, error) {
	t, err := apikey.Parse(s, keySyntax)
	return Keys{t}, err
}

// allows reports whether key may use world, and whether it is a key at
// all.
func (k Keys) allows(key, world string) (known, allowed bool) {
	w, known := k.Lookup(key)
	return known, known && (w == "*" || w == world)
}

// checkWorld: 1..MaxWorldBytes of UTF-8 without control characters or
// '*', '=' and ',' (which the key syntax uses).
func checkWorld(w string) error {
	switch {
	case w == "":
		return errors.New("the world is empty")
	case len(w) > MaxWorldBytes:
		return fmt.Errorf("the world is %d bytes, more than %d", len(w), MaxWorldBytes)
	case !utf8.ValidString(w):
		return errors.New("the world is not UTF-8")
	case strings.ContainsAny(w, "*=,"):
		return fmt.Errorf("the world %q contains '*', '=' or ','", w)
	case hasControl(w):
		return fmt.Errorf("the world %q contains control characters", w)
	}
	return nil
}

// checkID: any UTF-8 of 1..MaxIDBytes bytes (control characters included:
// ids go into subjects encoded and never into headers).
func checkID(id string) error {
	switch {
	case id == "":
		return errors.New("the document id is empty")
	case len(id) > MaxIDBytes:
		return fmt.Errorf("the document id is %d bytes, more than %d", len(id), MaxIDBytes)
	case !utf8.ValidString(id):
		return errors.New("the document id is not UTF-8")
	}
	return nil
}

func hasControl(s string) bool {
	for _, r := range s {
		if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) {
			return true
		}
	}
	return false
}
