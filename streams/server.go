package streams

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/subjects"
)

// StartEmbedded runs a JetStream server in this process with its file store
// under c.DataDir, admitting only the identities in c.AuthDir (auth.go;
// made on first start). It returns once the server accepts connections,
// and the seed file the service identity connects with.
func StartEmbedded(c Config) (*server.Server, string, error) {
	ns, ids, err := startEmbedded(c)
	if err != nil {
		return nil, "", err
	}
	return ns, ids.service.seedFile, nil
}

type embeddedIDs struct{ service, reader identity }

func startEmbedded(c Config) (*server.Server, embeddedIDs, error) {
	c = c.WithDefaults()
	var ids embeddedIDs
	var err error
	if !c.Anonymous {
		if ids.service, err = loadOrCreateIdentity(c.AuthDir, ServiceSeedFile); err != nil {
			return nil, ids, fmt.Errorf("embedded nats identities: %w", err)
		}
		if ids.reader, err = loadOrCreateIdentity(c.AuthDir, ReaderSeedFile); err != nil {
			return nil, ids, fmt.Errorf("embedded nats identities: %w", err)
		}
	}
	host, portStr, err := net.SplitHostPort(c.Listen)
	if err != nil {
		return nil, ids, fmt.Errorf("nats listen address %q: %w", c.Listen, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return nil, ids, fmt.Errorf("nats listen port %q: %w", portStr, err)
	}
	if port == 0 {
		port = server.RANDOM_PORT
	}
	dir, err := filepath.Abs(c.DataDir)
	if err != nil {
		return nil, ids, err
	}
	opts := &server.Options{
		ServerName:   "millrace-embedded",
		Host:         host,
		Port:         port,
		JetStream:    true,
		StoreDir:     dir,
		SyncInterval: c.SyncInterval,
		SyncAlways:   c.SyncAlways,
		MaxPayload:   c.MaxPayload,
		NoSigs:       true,
		NoLog:        true,
		// No anonymous connections: the service identity publishes, the
		// reader only looks (auth.go).
	}
	if !c.Anonymous {
		opts.Nkeys = []*server.NkeyUser{
			{Nkey: ids.service.public},
			{Nkey: ids.reader.public, Permissions: ReaderPermissions(c)},
		}
	}
	ns, err := server.NewServer(opts)
	if err != nil {
		return nil, ids, fmt.Errorf("embedded nats: %w", err)
	}
	ns.Start()
	if !ns.ReadyForConnections(30 * time.Second) {
		ns.Shutdown()
		return nil, ids, fmt.Errorf("embedded nats did not start listening on %s (is the port taken?)", c.Listen)
	}
	return ns, ids, nil
}

// Connect dials url with reconnects that never give up: a projector or an
// edge outlives a restart of the backbone. extra carries authentication
// (ClientAuth.Options).
func Connect(url, name string, extra ...nats.Option) (*nats.Conn, error) {
	nc, err := nats.Connect(url, append([]nats.Option{
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.RetryOnFailedConnect(false),
		// No reconnect buffer: a publish while disconnected fails at once
		// instead of being stored later, after events published behind it,
		// which would break the order of an invocation's events.
		nats.ReconnectBufSize(-1),
	}, extra...)...)
	if err != nil {
		return nil, fmt.Errorf("connect to nats at %s: %w", url, err)
	}
	return nc, nil
}

// Backbone is a connection to JetStream with the streams applied.
type Backbone struct {
	Conn *nats.Conn
	JS   jetstream.JetStream
	URL  string
	// ReaderSeedFile is the embedded server's read-only identity (the
	// `nats` CLI's --nkey); empty for an external cluster.
	ReaderSeedFile string
	// ServiceSeedFile is the embedded server's service identity, for
	// other millrace processes on this host (--nats-nkey).
	ServiceSeedFile string
	// Layout is how build events lie on this backbone: where an edge
	// publishes a build's events and where its readers find them.
	Layout    subjects.BESLayout
	server    *server.Server
	publisher *Publisher
	closeOnce sync.Once
}

// Open starts the embedded server when c.URL is empty (or connects to
// c.URL), and applies the stream specs and the lease bucket.
func Open(ctx context.Context, c Config, name string, m *Metrics) (*Backbone, error) {
	c = c.WithDefaults()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	b := &Backbone{URL: c.URL, Layout: c.BESLayout()}
	auth := c.Auth
	if c.URL == "" {
		ns, ids, err := startEmbedded(c)
		if err != nil {
			return nil, err
		}
		b.server = ns
		b.URL = ns.ClientURL()
		b.ServiceSeedFile, b.ReaderSeedFile = ids.service.seedFile, ids.reader.seedFile
		if !c.Anonymous {
			auth = ClientAuth{NKeySeedFile: ids.service.seedFile}
		}
	}
	opts, err := auth.Options()
	if err != nil {
		b.Close()
		return nil, err
	}
	if b.server != nil {
		// In-process: this process's messages to its own server go through
		// memory, not a loopback socket. Each paced event is a publish and
		// an ack, and over TCP each was a write and a read on both sides,
		// with a wakeup of the network poller for each read.
		opts = append(opts, nats.InProcessServer(b.server))
	}
	nc, err := Connect(b.URL, name, opts...)
	if err != nil {
		b.Close()
		return nil, err
	}
	b.Conn = nc
	b.JS, err = jetstream.New(nc,
		jetstream.WithPublishAsyncMaxPending(DefaultMaxPending),
		jetstream.WithPublishAsyncTimeout(c.PublishTimeout),
	)
	if err != nil {
		b.Close()
		return nil, err
	}
	if err := CheckLayout(ctx, b.JS, b.Layout); err != nil {
		b.Close()
		return nil, err
	}
	if err := Apply(ctx, b.JS, StreamSpecs(c)); err != nil {
		b.Close()
		return nil, err
	}
	if _, err := b.JS.CreateOrUpdateKeyValue(ctx, LeaseBucketSpec(c)); err != nil {
		b.Close()
		return nil, fmt.Errorf("apply the lease bucket %s: %w", LeaseBucket, err)
	}
	b.publisher = NewPublisher(b.JS, m)
	return b, nil
}

// Publisher is the backbone's shared asynchronous publisher.
func (b *Backbone) Publisher() *Publisher { return b.publisher }

// Embedded is the in-process server, or nil for an external one.
func (b *Backbone) Embedded() *server.Server { return b.server }

// Stream is the backbone's stream name, its error naming the stream (the
// commands' tools each read one).
func (b *Backbone) Stream(ctx context.Context, name string) (jetstream.Stream, error) {
	s, err := b.JS.Stream(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", name, err)
	}
	return s, nil
}

// Close flushes what is in flight, closes the connection and stops the
// embedded server.
func (b *Backbone) Close() { b.closeOnce.Do(b.close) }

func (b *Backbone) close() {
	if b.JS != nil {
		select {
		case <-b.JS.PublishAsyncComplete():
		case <-time.After(10 * time.Second):
		}
	}
	if b.Conn != nil {
		b.Conn.Drain()
		for b.Conn.IsDraining() {
			time.Sleep(10 * time.Millisecond)
		}
		b.Conn.Close()
	}
	if b.server != nil {
		b.server.Shutdown()
		b.server.WaitForShutdown()
	}
}
