package archive_test

import (
	"flag"
	"testing"
	"time"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/internal/envflag/envflagtest"
)

func TestConfigFlags(t *testing.T) {
	var c archive.Config
	envflagtest.Parse(t, c.RegisterFlags)
	if c.After != archive.DefaultAfter || c.Interval != archive.DefaultInterval || c.Batch != archive.DefaultBatch || c.Off() {
		t.Fatalf("defaults: %+v", c)
	}
	envflagtest.Parse(t, c.RegisterFlags, "--archive-after", "-1s")
	if !c.Off() {
		t.Fatal("a negative --archive-after does not turn archiving off")
	}
	if _, err := envflagtest.ParseErr(t, c.RegisterFlags, "--archive-interval", "-1s"); err == nil {
		t.Fatal("a negative --archive-interval was accepted")
	}
	if _, err := envflagtest.ParseErr(t, func(fs *flag.FlagSet) {
		t.Setenv("MILLRACE_ARCHIVE_BATCH", "ten") // after Clean, before the flag reads it
		c.RegisterFlags(fs)
	}); err == nil {
		t.Fatal("an unparsable MILLRACE_ARCHIVE_BATCH was accepted")
	}
	if err := (archive.Config{Batch: -1}).Validate(); err == nil {
		t.Fatal("Validate accepts a negative Batch")
	}
	if err := (archive.Config{After: -time.Second}).Validate(); err != nil {
		t.Fatalf("Validate refuses a negative After (never): %v", err)
	}
}
