package bes

import (
	"strings"
	"testing"
	"time"
)

// TestNewRefusesNegatives: a negative limit or timeout is an operator's
// mistake, refused at start with a message naming the field, never taken
// for the default.
func TestNewRefusesNegatives(t *testing.T) {
	for field, set := range map[string]func(*Config){
		"MaxEventBytes":        func(c *Config) { c.MaxEventBytes = -1 },
		"MaxStreams":           func(c *Config) { c.MaxStreams = -1 },
		"MaxStreamsPerProject": func(c *Config) { c.MaxStreamsPerProject = -1 },
		"MaxInFlight":          func(c *Config) { c.MaxInFlight = -1 },
		"FirstMessageTimeout":  func(c *Config) { c.FirstMessageTimeout = -time.Second },
		"IdleTimeout":          func(c *Config) { c.IdleTimeout = -time.Second },
		"MaxStreamsPerConn":    func(c *Config) { c.MaxStreamsPerConn = -1 },
		"MaxPendingPerAddr":    func(c *Config) { c.MaxPendingPerAddr = -1 },
	} {
		var cfg Config
		set(&cfg)
		_, err := New(cfg, nil, nil, NewMetrics(nil), nil)
		if err == nil || !strings.Contains(err.Error(), "bes: "+field+" -1") || !strings.Contains(err.Error(), "set 0 for the default") {
			t.Errorf("%s negative: New returned %v, want an error naming it and saying what to set", field, err)
		}
	}
}

func TestNewTakesDefaults(t *testing.T) {
	s := newServer(t, Config{})
	want := Config{
		MaxEventBytes: DefaultMaxEventBytes, MaxStreams: DefaultMaxStreams, MaxStreamsPerProject: DefaultMaxStreams / 2,
		MaxInFlight: DefaultMaxInFlight, DefaultProject: "default",
		FirstMessageTimeout: DefaultFirstMessageTimeout, IdleTimeout: DefaultIdleTimeout,
		MaxStreamsPerConn: DefaultMaxStreamsPerConn, MaxPendingPerAddr: DefaultMaxPendingPerAddr,
	}
	got := s.cfg
	if got.Redactor == nil {
		t.Error("no default redactor")
	}
	got.Redactor = nil
	if got != want {
		t.Errorf("defaults\n got %+v\nwant %+v", got, want)
	}
}

// TestNewChecksTheStream: an event limit the BES stream could not store
// fails at start, not on the first large event.
func TestNewChecksTheStream(t *testing.T) {
	b := newBackbone(t, 30*time.Second)
	max := int(b.stream.CachedInfo().Config.MaxMsgSize)
	if max <= 0 {
		t.Fatalf("the test stream has no message limit (%d)", max)
	}
	if _, err := New(Config{MaxEventBytes: max}, nil, b.stream, NewMetrics(nil), nil); err == nil || !strings.Contains(err.Error(), "max payload") {
		t.Errorf("MaxEventBytes = the stream's largest message: New returned %v, want the payload refused", err)
	}
	if _, err := New(Config{MaxEventBytes: max - 64<<10}, nil, b.stream, NewMetrics(nil), nil); err != nil {
		t.Errorf("MaxEventBytes that fits: %v", err)
	}
}
