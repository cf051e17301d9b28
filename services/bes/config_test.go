package bes

import (
	"strings"
	"testing"
	"time"

	"github.com/millrace/millrace/streams"
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

// FitPayload lowers the event limit only when the backbone carries less,
// keeps a lower limit of the edge's own, and refuses a backbone that
// leaves no room beside the headers.
func TestFitPayload(t *testing.T) {
	stock := streams.PayloadLimit{Bytes: 1 << 20, Setting: "the NATS server's max_payload (1048576 bytes)"}
	c, note, err := Config{}.FitPayload(stock)
	if err != nil || c.MaxEventBytes != 1<<20-streams.HeaderRoom || !strings.Contains(note, "max_payload") {
		t.Errorf("default limit on a stock server: %d, %q, %v; want 983040 and a note naming max_payload", c.MaxEventBytes, note, err)
	}
	if !strings.Contains(c.raise(), "max_payload") {
		t.Errorf("a lowered limit's refusal says %q, want max_payload named", c.raise())
	}
	for _, own := range []int{64 << 10, 1<<20 - streams.HeaderRoom} {
		c, note, err := Config{MaxEventBytes: own}.FitPayload(stock)
		if err != nil || c.MaxEventBytes != own || note != "" || !strings.Contains(c.raise(), "MILLRACE_BES_MAX_EVENT_BYTES") {
			t.Errorf("own limit %d: %d, %q, %v; want it kept, no note, the edge's knob named", own, c.MaxEventBytes, note, err)
		}
	}
	if c, note, err := (Config{}).FitPayload(streams.PayloadLimit{}); err != nil || c.MaxEventBytes != 0 || note != "" {
		t.Errorf("nothing known of the backbone: %+v, %q, %v; want c unchanged", c, note, err)
	}
	if _, _, err := (Config{}).FitPayload(streams.PayloadLimit{Bytes: 64 << 10, Setting: "x"}); err == nil {
		t.Error("a backbone of 64 KiB messages: no error")
	}
}
