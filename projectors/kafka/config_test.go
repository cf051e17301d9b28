package kafka

import (
	"strings"
	"testing"
	"time"
)

// TestNewConfig: New refuses each negative field, naming it (-1 has a
// meaning for Partitions and ReplicationFactor: the brokers' default); a
// zero field takes its default.
func TestNewConfig(t *testing.T) {
	base := func() Config { return Config{Brokers: []string{"127.0.0.1:1"}, Routes: []Route{{"a.>", "t"}}} }
	for field, set := range map[string]func(*Config){
		"Linger -1ns is negative":      func(c *Config) { c.Linger = -1 },
		"BatchMaxBytes -1 is negative": func(c *Config) { c.BatchMaxBytes = -1 },
		"MaxBufferedRecords -1 is":     func(c *Config) { c.MaxBufferedRecords = -1 },
		"Partitions -2 is below -1":    func(c *Config) { c.Partitions = -2 },
		"ReplicationFactor -2 is":      func(c *Config) { c.ReplicationFactor = -2 },
	} {
		c := base()
		set(&c)
		if e, err := New(c, nil); err == nil || !strings.Contains(err.Error(), "kafka: "+field) {
			if e != nil {
				e.Close()
			}
			t.Errorf("%s: New returned %v", field, err)
		}
	}
	c := base()
	c.Partitions, c.ReplicationFactor = -1, -1
	e, err := New(c, nil)
	if err != nil {
		t.Fatalf("-1 partitions and replication factor (the brokers' defaults): %v", err)
	}
	e.Close()

	e, err = New(base(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	d := e.cfg
	if d.ClientID != "millrace-export" || d.Linger != 10*time.Millisecond || d.BatchMaxBytes != 1<<20 || d.MaxBufferedRecords != 50_000 ||
		d.Compression != "lz4" || d.Partitions != 12 || d.ReplicationFactor != -1 || d.Logger == nil {
		t.Errorf("defaults %+v", d)
	}
}
