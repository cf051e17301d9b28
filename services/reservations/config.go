package reservations

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
	"unicode"

	"github.com/millrace/millrace/internal/apikey"
	"github.com/millrace/millrace/internal/knob"
)

// Config of the reservations API. A zero field takes its default; a
// negative number or duration is refused by New, unless its comment gives
// negative a meaning. Keys is required: the API authenticates every call
// and refuses to start without one.
type Config struct {
	// Keys authenticate every call. Each key belongs to one owner (a user
	// or a team) and may be limited to some pools (see ParseKeys).
	Keys Keys
	// MaxPendingPerOwner caps the reservations one owner may have PENDING
	// or PLACED (not yet active) at once; Create answers RESOURCE_EXHAUSTED
	// beyond it. Default 1,000.
	MaxPendingPerOwner int
	// MaxWait is the longest wait a Create may ask for. Default 60 s. An
	// HTTP server in front of Handler needs a WriteTimeout above it.
	MaxWait time.Duration
	// PublishTimeout bounds how long Create and Cancel wait for JetStream
	// to acknowledge their event before answering UNAVAILABLE. Default 10 s.
	PublishTimeout time.Duration
	// SettleTimeout bounds how long a call polls the database for a change
	// it knows is coming: after a placement decision woke a waiting Create,
	// and after a Cancel was stored (until the projector applied it).
	// Default 2 s.
	SettleTimeout time.Duration
	// RecountEvery is how long a count of an owner's open reservations is
	// reused (plus the creates made since) before MaxPendingPerOwner is
	// checked against a fresh one: counting reads the status view, whose
	// cost grows with the owner's reservations, so a storm of creates must
	// not count each time. Default 1s; negative counts on every Create.
	RecountEvery time.Duration
	// RecheckInterval is how often a waiting Create re-reads the database
	// in case the decision subscription missed its decision (a NATS
	// reconnect, or a cancel by another call). Default 5 s.
	RecheckInterval time.Duration
}

// Defaults.
const (
	DefaultMaxPendingPerOwner = 1000
	DefaultMaxWait            = 60 * time.Second
	DefaultPublishTimeout     = 10 * time.Second
	DefaultSettleTimeout      = 2 * time.Second
	DefaultRecheckInterval    = 5 * time.Second
	DefaultRecountEvery       = time.Second
)

func (c Config) withDefaults() Config {
	if c.MaxPendingPerOwner == 0 {
		c.MaxPendingPerOwner = DefaultMaxPendingPerOwner
	}
	if c.MaxWait == 0 {
		c.MaxWait = DefaultMaxWait
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = DefaultPublishTimeout
	}
	if c.SettleTimeout == 0 {
		c.SettleTimeout = DefaultSettleTimeout
	}
	if c.RecountEvery == 0 {
		c.RecountEvery = DefaultRecountEvery
	}
	if c.RecheckInterval == 0 {
		c.RecheckInterval = DefaultRecheckInterval
	}
	return c
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if c.Keys.Len() == 0 {
		return errors.New("reservations: no API keys configured; every call needs one (owner=key,...)")
	}
	// RecountEvery is missing on purpose: negative has a meaning.
	return errors.Join(
		knob.NotNegative("reservations", "MaxPendingPerOwner", c.MaxPendingPerOwner, DefaultMaxPendingPerOwner),
		knob.NotNegative("reservations", "MaxWait", c.MaxWait, DefaultMaxWait),
		knob.NotNegative("reservations", "PublishTimeout", c.PublishTimeout, DefaultPublishTimeout),
		knob.NotNegative("reservations", "SettleTimeout", c.SettleTimeout, DefaultSettleTimeout),
		knob.NotNegative("reservations", "RecheckInterval", c.RecheckInterval, DefaultRecheckInterval),
	)
}

// Keys maps API keys to owners, each key optionally limited to pools: an
// apikey.Table, kept as digests and compared in constant time, shared by
// the copies of a Config (a reload replaces its keys for all). The zero
// value has no keys.
type Keys struct{ *apikey.Table[principal] }

// MaxOwnerBytes bounds an owner's name.
const MaxOwnerBytes = 128

var keySyntax = apikey.Syntax[principal]{
	Package: "reservations", What: "API key", Name: "owner", Form: "owner=key or owner:pool1|pool2=key",
	Principal: parsePrincipal,
}

// ParseKeys reads API keys, separated by commas or newlines (blank lines
// and lines starting with # are skipped; the syntax is apikey's):
//
//	owner=key                 the key acts for owner in every pool
//	owner:pool1|pool2=key     the key acts for owner in pool1 and pool2 only
//
// An owner may have several keys. Keys are at least 16 characters; the key
// is everything after the first '=', so it may itself contain '='. Owners
// cannot contain ':', '=', ',' or control characters; pools in a key's list
// cannot contain '|', '=', ',' or control characters.
func ParseKeys(s string) (Keys, error) {
	t, err := apikey.Parse(s, keySyntax)
	return Keys{t}, err
}

// parsePrincipal reads "owner" or "owner:pool1|pool2".
func parsePrincipal(who string) (principal, error) {
	owner, poolList, limited := strings.Cut(who, ":")
	owner = strings.TrimSpace(owner)
	if owner == "" || len(owner) > MaxOwnerBytes || strings.ContainsAny(owner, ":=,") || hasControl(owner) {
		return principal{}, fmt.Errorf("owner %q is not a valid owner name (1..%d bytes, no ':', '=', ',' or control characters)", owner, MaxOwnerBytes)
	}
	if !limited {
		return principal{owner: owner}, nil
	}
	var pools []string
	for _, p := range strings.Split(poolList, "|") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		if err := checkPool("pool", p); err != nil {
			return principal{}, fmt.Errorf("the API key of owner %q names an invalid pool: %v", owner, err)
		}
		pools = append(pools, p)
	}
	if len(pools) == 0 {
		return principal{}, fmt.Errorf("the API key of owner %q names no pool after ':'", owner)
	}
	slices.Sort(pools)
	return principal{owner: owner, pools: slices.Compact(pools)}, nil
}

// principal is who a key acts for.
type principal struct {
	owner string
	pools []string // sorted; nil: every pool
}

func (p principal) allows(pool string) bool {
	if p.pools == nil {
		return true
	}
	_, found := slices.BinarySearch(p.pools, pool)
	return found
}

func hasControl(s string) bool {
	for _, r := range s {
		if unicode.IsControl(r) {
			return true
		}
	}
	return false
}
