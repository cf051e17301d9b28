package commits

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/testenv"
)

// TestNewRefusesNegatives: a negative limit is an operator's mistake,
// refused at start with a message naming the field.
func TestNewRefusesNegatives(t *testing.T) {
	for field, set := range map[string]func(*Config){
		"MaxBodyBytes":    func(c *Config) { c.MaxBodyBytes = -1 },
		"CacheBytes":      func(c *Config) { c.CacheBytes = -1 },
		"IndexWorlds":     func(c *Config) { c.IndexWorlds = -1 },
		"ListWait":        func(c *Config) { c.ListWait = -time.Nanosecond },
		"ConflictRetries": func(c *Config) { c.ConflictRetries = -1 },
	} {
		cfg := Config{Keys: testKeys(t)}
		set(&cfg)
		// No JetStream: the config is refused before it is needed.
		_, err := New(context.Background(), cfg, nil, nil, nil)
		if err == nil || !strings.Contains(err.Error(), "commits: "+field+" -1") || !strings.Contains(err.Error(), "set 0 for the default") {
			t.Errorf("%s negative: New returned %v, want an error naming it and saying what to set", field, err)
		}
	}
}

func TestNewTakesDefaults(t *testing.T) {
	k := testKeys(t)
	s, err := New(context.Background(), Config{Keys: k}, connect(t, testenv.NATS(t).ClientURL(), 1), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	want := Config{Keys: k, MaxBodyBytes: DefaultMaxBodyBytes, CacheBytes: DefaultCacheBytes, IndexWorlds: DefaultIndexWorlds,
		ListWait: DefaultListWait, ConflictRetries: DefaultConflictRetries}
	if s.cfg != want {
		t.Errorf("defaults\n got %+v\nwant %+v", s.cfg, want)
	}
}
