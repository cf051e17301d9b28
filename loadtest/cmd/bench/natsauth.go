package main

import (
	"path/filepath"
	"sync"

	"github.com/nats-io/nats.go"

	"github.com/millrace/millrace/streams"
)

// An embedded server that millrace starts (in `dev` or `serve bes`)
// admits only its own identities (streams/auth.go); natsd, the bench's
// server apart, is anonymous. The bench remembers the service identity of
// each embedded server it starts, by URL, and connects (or has processes
// connect) with it.
var natsSeeds sync.Map // url -> service seed file

// embeddedNATS records the embedded server whose --nats-dir is dir.
func embeddedNATS(url, dir string) {
	natsSeeds.Store(url, filepath.Join(dir, "auth", streams.ServiceSeedFile))
}

// natsOptions authenticate a connection of the bench to url.
func natsOptions(url string, opts ...nats.Option) []nats.Option {
	if seed, ok := natsSeeds.Load(url); ok {
		if o, err := nats.NkeyOptionFromSeed(seed.(string)); err == nil {
			opts = append(opts, o)
		}
	}
	return opts
}

// natsEnv points a millrace process at url, with its credentials.
func natsEnv(url string) []string {
	env := []string{"MILLRACE_NATS_URL=" + url}
	if seed, ok := natsSeeds.Load(url); ok {
		env = append(env, "MILLRACE_NATS_NKEY="+seed.(string))
	}
	return env
}

// natsSeed is the seed file for url ("" for an anonymous server).
func natsSeed(url string) string {
	if seed, ok := natsSeeds.Load(url); ok {
		return seed.(string)
	}
	return ""
}
