package resources_test

import (
	"context"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/resources"
	"github.com/millrace/millrace/internal/testenv"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testenv.DropTemplate()
	os.Exit(code)
}

// options registers the flags of need and parses args.
func options(t *testing.T, need resources.Need, args ...string) (*resources.Options, *flag.FlagSet) {
	t.Helper()
	var o resources.Options
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	o.RegisterFlags(fs, need)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	if err := envflag.Errors(fs); err != nil {
		t.Fatal(err)
	}
	return &o, fs
}

// A command gets the flags of what it needs and no others.
func TestRegisterFlags(t *testing.T) {
	for _, c := range []struct {
		need resources.Need
		has  map[string]bool
	}{
		{resources.Backbone, map[string]bool{"nats-url": true, "retention-raw-days": true}},
		{resources.Database, map[string]bool{"database-url": true, "pg-dir": true}},
		{resources.Migrated, map[string]bool{"database-url": true, "pg-dir": true}},
		{resources.Bucket, map[string]bool{"bucket-url": true}},
		{resources.Database | resources.Bucket, map[string]bool{"database-url": true, "pg-dir": true, "bucket-url": true}},
	} {
		_, fs := options(t, c.need)
		for _, name := range []string{"nats-url", "retention-raw-days", "database-url", "pg-dir", "bucket-url"} {
			if got := fs.Lookup(name) != nil; got != c.has[name] {
				t.Errorf("need %b: flag --%s registered %v", c.need, name, got)
			}
		}
	}
}

// Open opens what the command needs, no more (Only takes some away), and
// Close closes it all; the backbone keeps its reader off the service
// consumers it is given.
func TestOpen(t *testing.T) {
	ctx := context.Background()
	ns := testenv.NATS(t)
	dir := filepath.Join(t.TempDir(), "bucket")
	o, _ := options(t, resources.Backbone|resources.Database|resources.Bucket,
		"-nats-url", ns.ClientURL(), "-retention-raw-days", "3", "-database-url", testenv.Database(t), "-bucket-url", dir)
	r, err := o.Open(ctx, "test", []string{"rows"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if r.Streams.BESMaxAge != 72*time.Hour || len(r.Streams.ServiceConsumers) != 1 || r.Streams.ServiceConsumers[0] != "rows" {
		t.Fatalf("the backbone opened with %+v", r.Streams)
	}
	if err := r.Pool.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	if err := r.Bucket.Put(ctx, "k", []byte("v")); err != nil {
		t.Fatal(err)
	}
	r.Close()
	if !r.BB.Conn.IsClosed() {
		t.Fatal("Close left the backbone open")
	}
	if err := r.Pool.Ping(ctx); err == nil {
		t.Fatal("Close left the pool open")
	}

	only := o.Only(resources.Database)
	if r, err = only.Open(ctx, "test", nil, nil); err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.BB != nil || r.Bucket != nil || r.Pool == nil {
		t.Fatalf("Only(Database) opened backbone %v, bucket %v, pool %v", r.BB, r.Bucket, r.Pool)
	}
	ran := false
	if err := o.Run(ctx, "test", nil, nil, func(r *resources.Opened) error { ran = r.BB != nil && r.Pool != nil && r.Bucket != nil; return nil }); err != nil || !ran {
		t.Fatalf("Run: %v (f saw everything: %v)", err, ran)
	}
}

// When one resource does not open, those opened before it are closed
// and its error is Open's.
func TestOpenFailureClosesWhatOpened(t *testing.T) {
	ns := testenv.NATS(t)
	o, _ := options(t, resources.Backbone|resources.Database|resources.Bucket,
		"-nats-url", ns.ClientURL(), "-database-url", testenv.Database(t), "-bucket-url", "nope://x")
	called := false
	err := o.Run(context.Background(), "test", nil, nil, func(*resources.Opened) error { called = true; return nil })
	if err == nil || called || errors.As(err, new(envflag.UsageError)) {
		t.Fatalf("a bucket that does not open: %v (f called: %v)", err, called)
	}
	poll.Until(t, "the backbone's connection closed", func() bool { return ns.NumClients() == 0 }, poll.Within(5*time.Second))
}

// Migrated brings the schema up to date before the pool opens; Database
// leaves it as it is.
func TestMigrated(t *testing.T) {
	ctx := context.Background()
	url := testenv.EmptyDatabase(t)
	schema := func(need resources.Need) (exists bool) {
		o, _ := options(t, need, "-database-url", url)
		err := o.Run(ctx, "", nil, nil, func(r *resources.Opened) error {
			return r.Pool.QueryRow(ctx, "select to_regclass('consumer_positions') is not null").Scan(&exists)
		})
		if err != nil {
			t.Fatal(err)
		}
		return exists
	}
	if schema(resources.Database) {
		t.Fatal("Database migrated an empty database")
	}
	if !schema(resources.Migrated) {
		t.Fatal("Migrated left the database without its tables")
	}
}
