package reservations

import (
	"slices"
	"strings"
	"testing"
	"time"
)

func TestParseKeys(t *testing.T) {
	k, err := ParseKeys(`
# owners and their keys
alice=alice-key-0123456789
bob : a100 | h100 = bob-key-0123456789==,alice=alice-second-key-0123
`)
	if err != nil {
		t.Fatal(err)
	}
	if k.Len() != 3 {
		t.Fatalf("%d keys", k.Len())
	}
	for _, c := range []struct {
		key, owner string
		pools      []string
	}{
		{"alice-key-0123456789", "alice", nil},
		{"alice-second-key-0123", "alice", nil},
		{"bob-key-0123456789==", "bob", []string{"a100", "h100"}},
	} {
		p, ok := k.Lookup(c.key)
		if !ok || p.owner != c.owner || !slices.Equal(p.pools, c.pools) {
			t.Errorf("key %s: %v %v, want %s %v", c.key, p, ok, c.owner, c.pools)
		}
	}
	if p, _ := k.Lookup("bob-key-0123456789=="); !p.allows("h100") || p.allows("v100") {
		t.Error("bob's pools")
	}
	if p, _ := k.Lookup("alice-key-0123456789"); !p.allows("anything") {
		t.Error("alice's key is for every pool")
	}
	for _, key := range []string{"", "alice-key-012345678", "nope"} {
		if _, ok := k.Lookup(key); ok {
			t.Errorf("key %q accepted", key)
		}
	}

	for _, bad := range []struct{ in, mention string }{
		{"alice", "owner=key"},
		{"=k-0123456789abcdef", "owner=key"},
		{"alice=short", "shorter than 16"},
		{"alice:=alice-key-0123456789", "names no pool"},
		{"al ice\x01=alice-key-0123456789", "not a valid owner"},
		{"alice=alice-key-0123456789,bob=alice-key-0123456789", "given twice"},
	} {
		if _, err := ParseKeys(bad.in); err == nil || !strings.Contains(err.Error(), bad.mention) {
			t.Errorf("ParseKeys(%q) = %v, want an error mentioning %q", bad.in, err, bad.mention)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	if err := (Config{}).Validate(); err == nil || !strings.Contains(err.Error(), "no API keys") {
		t.Errorf("no keys: %v", err)
	}
	k, _ := ParseKeys("alice=alice-key-0123456789")
	if err := (Config{Keys: k}).Validate(); err != nil {
		t.Error(err)
	}
	if err := (Config{Keys: k, MaxWait: -time.Second}).Validate(); err == nil {
		t.Error("negative max wait accepted")
	}
	c := Config{Keys: k}.withDefaults()
	if c.MaxPendingPerOwner != 1000 || c.MaxWait != time.Minute || c.PublishTimeout != 10*time.Second ||
		c.SettleTimeout != 2*time.Second || c.RecheckInterval != 5*time.Second {
		t.Errorf("defaults %+v", c)
	}
}

// TestNewRefusesNegatives: a negative limit or duration is an operator's
// mistake, refused at start with a message naming the field; RecountEvery
// alone has a meaning for negative (count on every Create).
func TestNewRefusesNegatives(t *testing.T) {
	for field, set := range map[string]func(*Config){
		"MaxPendingPerOwner": func(c *Config) { c.MaxPendingPerOwner = -1 },
		"MaxWait":            func(c *Config) { c.MaxWait = -1 },
		"PublishTimeout":     func(c *Config) { c.PublishTimeout = -1 },
		"SettleTimeout":      func(c *Config) { c.SettleTimeout = -1 },
		"RecheckInterval":    func(c *Config) { c.RecheckInterval = -1 },
	} {
		cfg := Config{Keys: testKeys(t)}
		set(&cfg)
		// No database nor backbone: the config is refused before they are
		// needed.
		_, err := New(cfg, nil, nil, nil, nil, nil)
		if err == nil || !strings.Contains(err.Error(), "reservations: "+field+" -1") || !strings.Contains(err.Error(), "set 0 for the default") {
			t.Errorf("%s negative: New returned %v, want an error naming it and saying what to set", field, err)
		}
	}
	if err := (Config{Keys: testKeys(t), RecountEvery: -1}).Validate(); err != nil {
		t.Errorf("negative RecountEvery (count every time) refused: %v", err)
	}
}

func TestNewTakesDefaults(t *testing.T) {
	// newEnv sets a short SettleTimeout of its own; withDefaults' is
	// checked by TestConfigValidate.
	e := newEnv(t, Config{})
	want := Config{Keys: e.srv.cfg.Keys, MaxPendingPerOwner: DefaultMaxPendingPerOwner, MaxWait: DefaultMaxWait,
		PublishTimeout: DefaultPublishTimeout, SettleTimeout: 200 * time.Millisecond,
		RecountEvery: DefaultRecountEvery, RecheckInterval: DefaultRecheckInterval}
	if e.srv.cfg != want {
		t.Errorf("defaults\n got %+v\nwant %+v", e.srv.cfg, want)
	}
}
