package streams

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/millrace/millrace/subjects"
)

// Authentication to the backbone.
//
// An embedded server admits only two identities, both NATS nkeys whose
// seeds it keeps under Config.AuthDir (made on first start, mode 0600):
//   - service (service.nk): millrace's own processes, every permission;
//   - reader (reader.nk): people and tools that look (the `nats` CLI):
//     stream and consumer information, message gets, subscriptions to the
//     streams' subjects, and consumers of their own; no publish to any data
//     subject and no change to a stream.
//
// Before, the embedded server took anonymous connections, and any local
// process could publish forged build events or node reports to the
// backbone. An nkey rather than a password: the seed never crosses the
// wire (the server sends a nonce that the client signs).
//
// External clusters bring their own accounts: ClientAuth carries a
// credentials file (a user JWT and its seed, `nsc` makes them), an nkey
// seed, and TLS.

// Identity files in Config.AuthDir.
const (
	ServiceSeedFile = "service.nk"
	ReaderSeedFile  = "reader.nk"
)

// ClientAuth is how a client proves itself to an external NATS cluster.
// The zero value connects anonymously, without TLS unless the URL says
// tls://.
type ClientAuth struct {
	// CredsFile is a NATS credentials file (user JWT and nkey seed).
	CredsFile string
	// NKeySeedFile is a file holding a user nkey seed ("SU...").
	NKeySeedFile string
	// TLSCA is a PEM bundle the servers' certificates must chain to
	// (default: the system's). Setting it, or TLSCert, turns TLS on.
	TLSCA string
	// TLSCert and TLSKey are a PEM client certificate and key (mutual TLS).
	TLSCert, TLSKey string
}

// Validate reports options that cannot work.
func (a ClientAuth) Validate() error {
	var errs []error
	if a.CredsFile != "" && a.NKeySeedFile != "" {
		errs = append(errs, errors.New("nats: a credentials file and an nkey seed exclude each other (the credentials file holds its own seed)"))
	}
	if (a.TLSCert == "") != (a.TLSKey == "") {
		errs = append(errs, errors.New("nats: the TLS client certificate and key go together"))
	}
	for what, f := range map[string]string{"credentials file": a.CredsFile, "nkey seed file": a.NKeySeedFile,
		"TLS CA": a.TLSCA, "TLS certificate": a.TLSCert, "TLS key": a.TLSKey} {
		if f == "" {
			continue
		}
		if _, err := os.Stat(f); err != nil {
			errs = append(errs, fmt.Errorf("nats %s: %w", what, err))
		}
	}
	return errors.Join(errs...)
}

// Options are the nats.go options of a.
func (a ClientAuth) Options() ([]nats.Option, error) {
	var opts []nats.Option
	if a.CredsFile != "" {
		opts = append(opts, nats.UserCredentials(a.CredsFile))
	}
	if a.NKeySeedFile != "" {
		o, err := nats.NkeyOptionFromSeed(a.NKeySeedFile)
		if err != nil {
			return nil, fmt.Errorf("nats nkey seed %s: %w", a.NKeySeedFile, err)
		}
		opts = append(opts, o)
	}
	if a.TLSCA != "" {
		opts = append(opts, nats.RootCAs(a.TLSCA))
	}
	if a.TLSCert != "" {
		opts = append(opts, nats.ClientCert(a.TLSCert, a.TLSKey))
	}
	return opts, nil
}

// identity is one of the embedded server's nkeys.
type identity struct {
	seedFile string
	public   string
}

// loadOrCreateIdentity reads dir/file, or makes a user nkey seed there.
func loadOrCreateIdentity(dir, file string) (identity, error) {
	path := filepath.Join(dir, file)
	seed, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		kp, err := nkeys.CreateUser()
		if err != nil {
			return identity{}, err
		}
		if seed, err = kp.Seed(); err != nil {
			return identity{}, err
		}
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return identity{}, err
		}
		// Written beside and renamed: a reader (a test, a script) never
		// finds it half written.
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, append(seed, '\n'), 0o600); err != nil {
			return identity{}, err
		}
		if err := os.Rename(tmp, path); err != nil {
			return identity{}, err
		}
	} else if err != nil {
		return identity{}, err
	}
	kp, err := nkeys.FromSeed([]byte(strings.TrimSpace(string(seed))))
	if err != nil {
		return identity{}, fmt.Errorf("nats identity %s: %w", path, err)
	}
	pub, err := kp.PublicKey()
	if err != nil {
		return identity{}, err
	}
	return identity{seedFile: path, public: pub}, nil
}

// ReaderPermissions let the reader look without changing anything:
// publish only to the JetStream API requests that read (information,
// message gets) or make the reader's own consumers and fetch from them,
// subscribe to the streams' subjects and to its inboxes.
func ReaderPermissions(c Config) *server.Permissions {
	subs := []string{"_INBOX.>"}
	for _, s := range StreamSpecs(c) {
		subs = append(subs, s.Subjects...)
	}
	return &server.Permissions{
		Publish: &server.SubjectPermission{
			Allow: []string{
				"$JS.API.INFO",
				"$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST", "$JS.API.STREAM.INFO.*",
				"$JS.API.STREAM.MSG.GET.*", "$JS.API.DIRECT.GET.>",
				"$JS.API.CONSUMER.NAMES.*", "$JS.API.CONSUMER.LIST.*", "$JS.API.CONSUMER.INFO.*.*",
				// Consumers: `nats stream view`, `nats sub --stream` and
				// ordered consumers make one of their own and read it.
				"$JS.API.CONSUMER.CREATE.>", "$JS.API.CONSUMER.DURABLE.CREATE.*.*",
				"$JS.API.CONSUMER.MSG.NEXT.*.*", "$JS.API.CONSUMER.DELETE.*.*",
				"$JS.ACK.>", "$JS.FC.>",
			},
			Deny: readerDenies(partitionDurables(c.BESLayout(), c.ServiceConsumers)),
		},
		Subscribe: &server.SubjectPermission{Allow: subs},
	}
}

// partitionDurables adds to consumers each one's durable of every
// partition (subjects.BESLayout.Durable), when build events are
// partitioned: the callers name consumers as in one stream, and a name
// with no partitioned durable is kept off for nothing.
func partitionDurables(l subjects.BESLayout, consumers []string) []string {
	if !l.Partitioned() {
		return consumers
	}
	out := slices.Clone(consumers)
	for _, d := range consumers {
		for p := range l.N() {
			out = append(out, l.Durable(d, p))
		}
	}
	return out
}

// readerDenies keep the reader off the services' own consumers: with the
// consumer requests above it could otherwise fetch from one (stealing
// deliveries) or acknowledge on it (a projector would never see those
// messages), or re-create it with another configuration.
func readerDenies(consumers []string) []string {
	var deny []string
	for _, d := range consumers {
		deny = append(deny,
			"$JS.API.CONSUMER.CREATE.*."+d, "$JS.API.CONSUMER.CREATE.*."+d+".>",
			"$JS.API.CONSUMER.DURABLE.CREATE.*."+d, "$JS.API.CONSUMER.MSG.NEXT.*."+d,
			"$JS.API.CONSUMER.DELETE.*."+d, "$JS.ACK.*."+d+".>")
	}
	return deny
}
