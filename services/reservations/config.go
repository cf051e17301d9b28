package reservations

import (
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
	"unicode"

	"github.com/millrace/millrace/internal/keyfile"
)

// Config of the reservations API. The zero value takes the defaults, except
// Keys: the API authenticates every call and refuses to start without one.
type Config struct {
	// Keys authenticate every call. Each key belongs to one owner (a user
	// or a team) and may be limited to some pools (see ParseKeys).
	Keys *Keys
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
	if c.MaxPendingPerOwner <= 0 {
		c.MaxPendingPerOwner = DefaultMaxPendingPerOwner
	}
	if c.MaxWait <= 0 {
		c.MaxWait = DefaultMaxWait
	}
	if c.PublishTimeout <= 0 {
		c.PublishTimeout = DefaultPublishTimeout
	}
	if c.SettleTimeout <= 0 {
		c.SettleTimeout = DefaultSettleTimeout
	}
	if c.RecountEvery == 0 {
		c.RecountEvery = DefaultRecountEvery
	}
	if c.RecheckInterval <= 0 {
		c.RecheckInterval = DefaultRecheckInterval
	}
	return c
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if c.Keys.Len() == 0 {
		return errors.New("reservations: no API keys configured; every call needs one (owner=key,...)")
	}
	for name, v := range map[string]int64{
		"max pending per owner": int64(c.MaxPendingPerOwner),
		"max wait":              int64(c.MaxWait),
		"publish timeout":       int64(c.PublishTimeout),
		"settle timeout":        int64(c.SettleTimeout),
		"recheck interval":      int64(c.RecheckInterval),
	} {
		if v < 0 {
			return fmt.Errorf("reservations: %s must not be negative", name)
		}
	}
	return nil
}

// Keys maps API keys to owners, each key optionally limited to pools. Keys
// are kept only as SHA-256 digests and compared in constant time.
type Keys struct {
	entries keyfile.Set[keyEntry] // read without a lock: a reload swaps it whole
}

type keyEntry struct {
	digest [32]byte
	owner  string
	pools  []string // nil: every pool
}

// MaxOwnerBytes bounds an owner's name.
const MaxOwnerBytes = 128

// ParseKeys reads API keys, separated by commas or newlines (blank lines
// and lines starting with # are skipped):
//
//	owner=key                 the key acts for owner in every pool
//	owner:pool1|pool2=key     the key acts for owner in pool1 and pool2 only
//
// An owner may have several keys. Keys are at least 16 characters; the key
// is everything after the first '=', so it may itself contain '='. Owners
// cannot contain ':', '=', ',' or control characters; pools in a key's list
// cannot contain '|', '=', ',' or control characters.
func ParseKeys(s string) (*Keys, error) {
	k := &Keys{}
	for _, f := range strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == '\n' }) {
		f = strings.TrimSpace(f)
		if f == "" || strings.HasPrefix(f, "#") {
			continue
		}
		who, key, ok := strings.Cut(f, "=")
		who, key = strings.TrimSpace(who), strings.TrimSpace(key)
		if !ok || who == "" || key == "" {
			return nil, errors.New("reservations: API keys must be written owner=key or owner:pool1|pool2=key")
		}
		owner, poolList, limited := strings.Cut(who, ":")
		owner = strings.TrimSpace(owner)
		var pools []string
		if limited {
			for _, p := range strings.Split(poolList, "|") {
				if p = strings.TrimSpace(p); p != "" {
					pools = append(pools, p)
				}
			}
			if len(pools) == 0 {
				return nil, fmt.Errorf("reservations: the API key of owner %q names no pool after ':'", owner)
			}
		}
		if err := k.Add(owner, key, pools...); err != nil {
			return nil, err
		}
	}
	return k, nil
}

// Add gives owner one more key; with pools, the key may use only those.
func (k *Keys) Add(owner, key string, pools ...string) error {
	if owner == "" || len(owner) > MaxOwnerBytes || strings.ContainsAny(owner, ":=,") || hasControl(owner) {
		return fmt.Errorf("reservations: owner %q is not a valid owner name (1..%d bytes, no ':', '=', ',' or control characters)", owner, MaxOwnerBytes)
	}
	if len(key) < 16 {
		return fmt.Errorf("reservations: the API key of owner %q is shorter than 16 characters", owner)
	}
	for _, p := range pools {
		if err := checkPool("pool", p); err != nil {
			return fmt.Errorf("reservations: the API key of owner %q names an invalid pool: %v", owner, err)
		}
	}
	d := sha256.Sum256([]byte(key))
	for _, e := range k.list() {
		if e.digest == d {
			return fmt.Errorf("reservations: the API key of owner %q is given twice", owner)
		}
	}
	var ps []string
	if len(pools) > 0 {
		ps = slices.Clone(pools)
		slices.Sort(ps)
		ps = slices.Compact(ps)
	}
	k.add(keyEntry{digest: d, owner: owner, pools: ps})
	return nil
}

// Len is the number of keys.
func (k *Keys) Len() int {
	if k == nil {
		return 0
	}
	return k.entries.Len()
}

func (k *Keys) list() []keyEntry {
	if k == nil {
		return nil
	}
	return k.entries.List()
}

func (k *Keys) add(e keyEntry) { k.entries.Add(e) }

// Replace makes k hold exactly the keys of from, at once: a request sees
// either the old keys or the new ones, never a mix. It is how a file of
// keys is reloaded while the server runs (a removed one is refused from the
// next request on).
func (k *Keys) Replace(from *Keys) { k.entries.Replace(&from.entries) }

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

// lookup returns who key acts for. Every entry is compared, so the time
// taken does not tell which one matched.
func (k *Keys) lookup(key string) (principal, bool) {
	if k == nil || key == "" {
		return principal{}, false
	}
	d := sha256.Sum256([]byte(key))
	var p principal
	found := false
	for _, e := range k.list() {
		if subtle.ConstantTimeCompare(d[:], e.digest[:]) == 1 {
			p, found = principal{owner: e.owner, pools: e.pools}, true
		}
	}
	return p, found
}

func hasControl(s string) bool {
	for _, r := range s {
		if unicode.IsControl(r) {
			return true
		}
	}
	return false
}
