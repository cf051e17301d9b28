package main

import (
	"context"
	"flag"
	"sync"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/commitlog"
	"github.com/millrace/millrace/console"
	"github.com/millrace/millrace/console/backbone"
	"github.com/millrace/millrace/internal/apikey"
	"github.com/millrace/millrace/internal/database"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/internal/web"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/services/bes"
	"github.com/millrace/millrace/streams"
)

// console registers the console on the process's mux over what the
// process opens (the database, the bucket, the backbone: all open before
// the HTTP server serves, as components start in order); keys' BES API
// keys read their projects, compactor is the compactor's durable.
func (p *process) console(src console.Sources, keys bes.Options, compactor string, o *web.Options) {
	src.DB = p.db.Pool
	src.Archive = sync.OnceValue(func() builds.Archive { return archive.NewObjects(p.bk) })
	bb := func() *streams.Backbone { return p.bb }
	src.Live = backbone.Follower{Backbone: bb}
	src.CommitLog = backbone.CommitLog{Backbone: bb, Bucket: func() *bucket.Bucket { return p.bk }, Compactor: compactor}
	src.Stopping = p.stopping
	src.Layout = p.layout // the flags': the backbone refuses another
	console.Register(p.mux, src)
	o.ProjectKeys = func(ctx context.Context) (*apikey.Table[string], error) {
		k, err := keys.LoadKeys(ctx, p.t.kf, p.log)
		return k.Table, err
	}
}

func serveConsoleCommand() command {
	return command{
		Name:    "serve console",
		Summary: "serve the web console and its JSON API (builds, tests, trends, the fleet, the commit log)",
		Long:    console.Description,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				po        procOptions
				do        database.Options
				bo        bucket.Options
				src       console.Sources
				keys      bes.Options
				compactor string
			)
			po.register(fs, "127.0.0.1:8089", "HTTP address: the console, /api/v1/, /metrics, /healthz, /readyz",
				"how long shutdown waits for pages in progress (live pages end at its start, and their browsers reconnect)")
			do.RegisterFlags(fs)
			bo.RegisterFlags(fs)
			src.RegisterFlags(fs)
			keys.RegisterKeyFlags(fs, "each reads its project's builds in the console (the BES edge's keys)")
			envflag.String(fs, &compactor, "compactor-durable", "MILLRACE_COMPACTOR_DURABLE", commitlog.DefaultDurable,
				"the compactor's discovery consumer on COMMITS, whose lag the commit-log page shows")
			return po.run("serve console", "millrace-console", func(p *process) ([]supervise.Component, []supervise.Component, error) {
				p.console(src, keys, compactor, &po.http)
				return []supervise.Component{p.database(do), p.openBucket(bo)}, nil, nil
			})
		},
	}
}
