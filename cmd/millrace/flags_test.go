package main

import "testing"

func TestParseMemoryLimit(t *testing.T) {
	for in, want := range map[string]int64{
		"off": 0, "0": 0, "960MiB": 960 << 20, "1GiB": 1 << 30, "512KiB": 512 << 10, "4096B": 4096, "123": 123, " 2TiB ": 2 << 40,
	} {
		if got, err := parseMemoryLimit(in); err != nil || got != want {
			t.Errorf("parseMemoryLimit(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "1GB", "-1MiB", "lots", "9999999TiB", "1.5GiB"} {
		if got, err := parseMemoryLimit(in); err == nil {
			t.Errorf("parseMemoryLimit(%q) = %d, want an error", in, got)
		}
	}
}
