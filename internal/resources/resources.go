// Package resources opens what a command that runs once works on (the
// replays, builds show and delete, archive verify, zstd train, the streams
// tools): the backbone, the database and the bucket, as far as the command
// needs them. It registers the flags of those it needs and no others, opens
// them in one order and closes them together, so that each command names
// what it needs rather than opening each and deferring its close. A
// long-running command opens the same as components of its process
// (cmd/millrace, process.go).
package resources

import (
	"context"
	"flag"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/internal/database"
	"github.com/millrace/millrace/streams"
)

// Need names the resources a command works on; or them together.
type Need uint8

const (
	// Backbone is the backbone (streams.Options' flags).
	Backbone Need = 1 << iota
	// Database is the database with its schema as it is
	// (database.Options' flags): a tool that reads or edits rows leaves
	// migrating to migrate and the services.
	Database
	// Migrated is the database with its migrations applied first, for a
	// replay, which writes every table of the projection it rebuilds.
	Migrated
	// Bucket is the bucket (bucket.Options' flag).
	Bucket
)

// Options are the flags of the resources a command needs.
type Options struct {
	NATS   streams.Options
	DB     database.Options
	Bucket bucket.Options
	need   Need
}

// RegisterFlags registers on fs the flags of what need names, and
// remembers need for Open.
func (o *Options) RegisterFlags(fs *flag.FlagSet, need Need) {
	o.need = need
	if need&Backbone != 0 {
		o.NATS.RegisterFlags(fs)
	}
	if need&(Database|Migrated) != 0 {
		o.DB.RegisterFlags(fs)
	}
	if need&Bucket != 0 {
		o.Bucket.RegisterFlags(fs)
	}
}

// Only is o opening no more than need of what it registers: for a command
// that needs one of them only with one of its flags.
func (o Options) Only(need Need) Options {
	o.need &= need
	return o
}

// Opened is what Open opened; what the command does not need is nil.
type Opened struct {
	BB *streams.Backbone
	// Streams is the backbone's configuration as it opened
	// (Streams.BESMaxAge: how long the BES stream keeps raw events).
	Streams streams.Config
	Pool    *pgxpool.Pool
	Bucket  *bucket.Bucket
}

// Open opens what RegisterFlags was told the command needs, in one order:
// the backbone as client (its reader kept off serviceConsumers, the
// durables of millrace's processes), then the database (log: the
// development server it uses and the migrations), then the bucket. When
// one fails it closes those it opened and returns the error.
func (o *Options) Open(ctx context.Context, client string, serviceConsumers []string, log *slog.Logger) (_ *Opened, err error) {
	r := &Opened{}
	defer func() {
		if err != nil {
			r.Close()
		}
	}()
	if o.need&Backbone != 0 {
		if r.BB, r.Streams, err = o.NATS.Open(ctx, client, serviceConsumers, nil); err != nil {
			return nil, err
		}
	}
	if o.need&(Database|Migrated) != 0 {
		if r.Pool, err = database.Open(ctx, o.DB.Config(o.need&Migrated != 0, log)); err != nil {
			return nil, err
		}
	}
	if o.need&Bucket != 0 {
		if r.Bucket, err = o.Bucket.Open(ctx); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// Run opens what the command needs (Open), calls f with it and closes it.
func (o *Options) Run(ctx context.Context, client string, serviceConsumers []string, log *slog.Logger, f func(*Opened) error) error {
	r, err := o.Open(ctx, client, serviceConsumers, log)
	if err != nil {
		return err
	}
	defer r.Close()
	return f(r)
}

// Close closes what is open, in the reverse order of Open.
func (r *Opened) Close() {
	if r.Bucket != nil {
		r.Bucket.Close()
	}
	if r.Pool != nil {
		r.Pool.Close()
	}
	if r.BB != nil {
		r.BB.Close()
	}
}
