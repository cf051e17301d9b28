package streams

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/subjects"
)

// publishSome stores n messages on stream T's subject and returns their
// sequences.
func publishSome(t *testing.T, js jetstream.JetStream, n int) []uint64 {
	t.Helper()
	ctx := context.Background()
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: "T", Subjects: []string{"t.>"}}); err != nil {
		t.Fatal(err)
	}
	var seqs []uint64
	for i := range n {
		ack, err := js.Publish(ctx, fmt.Sprint("t.", i), []byte("x"))
		if err != nil {
			t.Fatal(err)
		}
		seqs = append(seqs, ack.Sequence)
	}
	return seqs
}

// checkGone fails unless exactly the first n of seqs are gone from T.
func checkGone(t *testing.T, js jetstream.JetStream, seqs []uint64, n int) {
	t.Helper()
	ctx := context.Background()
	st, err := js.Stream(ctx, "T")
	if err != nil {
		t.Fatal(err)
	}
	for i, seq := range seqs {
		_, err := st.GetMsg(ctx, seq)
		if gone := errors.Is(err, jetstream.ErrMsgNotFound); gone != (i < n) {
			t.Fatalf("message %d: gone %v (%v), want %v", seq, gone, err, i < n)
		}
	}
}

func connect(t *testing.T, url string, opts ...nats.Option) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// DeleteMsgs speaks the deletion API by hand: a deleted message is gone,
// and deleting one already gone, or never there, is not an error; a
// deletion the server refuses is, and so is a stream that does not exist.
// With its context ended it sends nothing.
func TestDeleteMsgs(t *testing.T) {
	js, err := jetstream.New(connect(t, testenv.NATS(t).ClientURL()))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := Apply(ctx, js, StreamSpecs(Config{})); err != nil {
		t.Fatal(err)
	}
	var seqs []uint64
	for i := range 5 {
		ack, err := js.Publish(ctx, subjects.Commits("w", string(rune('a'+i))), []byte("x"))
		if err != nil {
			t.Fatal(err)
		}
		seqs = append(seqs, ack.Sequence)
	}
	if err := DeleteMsgs(ctx, js, subjects.StreamCommits, seqs[:3], 0); err != nil {
		t.Fatal(err)
	}
	if err := DeleteMsgs(ctx, js, subjects.StreamCommits, []uint64{seqs[1], seqs[2], seqs[4] + 100}, 1); err != nil {
		t.Fatalf("deleting messages already gone: %v", err)
	}
	ended, cancel := context.WithCancel(ctx)
	cancel()
	if err := DeleteMsgs(ended, js, subjects.StreamCommits, seqs[3:], 0); !errors.Is(err, context.Canceled) {
		t.Fatalf("deleting with a context that ended: %v, want its error (and nothing deleted)", err)
	}
	st, _ := js.Stream(ctx, subjects.StreamCommits)
	for i, seq := range seqs {
		_, err := st.GetMsg(ctx, seq)
		if gone := errors.Is(err, jetstream.ErrMsgNotFound); gone != (i < 3) {
			t.Fatalf("message %d: gone %v (%v), want %v", seq, gone, err, i < 3)
		}
	}
	if err := deleteAnswer(&nats.Msg{Data: []byte(`{"error":{"code":500,"err_code":10057,"description":"message delete not permitted"}}`)}); err == nil {
		t.Fatal("a refused deletion was taken for done")
	}
	var apiErr *jetstream.APIError
	if err := DeleteMsgs(ctx, js, "NO_SUCH_STREAM", []uint64{1}, 0); !errors.As(err, &apiErr) || apiErr.ErrorCode != jetstream.JSErrCodeStreamNotFound {
		t.Fatalf("deleting from a stream that does not exist: %v, want the API's stream not found", err)
	}
	if err := DeleteMsgs(ctx, js, subjects.StreamCommits, seqs[3:], -1); err == nil {
		t.Fatal("a negative concurrency was accepted")
	}
}

// The requests go where the client's own would: under the domain's
// prefix, or under an API prefix an account imports JetStream's API with
// (where the default prefix reaches no JetStream at all). A server with a
// domain answers the default prefix too, so the domain's case shows only
// that its prefix is served; TestAPIPrefix pins which prefix is used.
func TestDeleteMsgsPrefixes(t *testing.T) {
	ctx := context.Background()
	t.Run("domain", func(t *testing.T) {
		ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true,
			JetStreamDomain: "hub", StoreDir: t.TempDir(), NoLog: true, NoSigs: true})
		if err != nil {
			t.Fatal(err)
		}
		ns.Start()
		t.Cleanup(ns.Shutdown)
		if !ns.ReadyForConnections(10 * time.Second) {
			t.Fatal("nats server not ready")
		}
		js, err := jetstream.NewWithDomain(connect(t, ns.ClientURL()), "hub")
		if err != nil {
			t.Fatal(err)
		}
		seqs := publishSome(t, js, 4)
		if err := DeleteMsgs(ctx, js, "T", seqs[:2], 0); err != nil {
			t.Fatal(err)
		}
		checkGone(t, js, seqs, 2)
	})
	t.Run("api prefix", func(t *testing.T) {
		conf := filepath.Join(t.TempDir(), "server.conf")
		err := os.WriteFile(conf, []byte(fmt.Sprintf(`
host: 127.0.0.1
port: -1
jetstream: {store_dir: %q}
accounts: {
  A: {jetstream: enabled, users: [{user: a, password: a}], exports: [{service: "$JS.API.>"}]}
  B: {users: [{user: b, password: b}], imports: [{service: {account: A, subject: "$JS.API.>"}, to: "JS.A.API.>"}]}
}
`, t.TempDir())), 0o600)
		if err != nil {
			t.Fatal(err)
		}
		opts, err := server.ProcessConfigFile(conf)
		if err != nil {
			t.Fatal(err)
		}
		opts.NoLog, opts.NoSigs = true, true
		ns, err := server.NewServer(opts)
		if err != nil {
			t.Fatal(err)
		}
		ns.Start()
		t.Cleanup(ns.Shutdown)
		if !ns.ReadyForConnections(10 * time.Second) {
			t.Fatal("nats server not ready")
		}
		owner, err := jetstream.New(connect(t, ns.ClientURL(), nats.UserInfo("a", "a")))
		if err != nil {
			t.Fatal(err)
		}
		seqs := publishSome(t, owner, 4)
		nb := connect(t, ns.ClientURL(), nats.UserInfo("b", "b"))
		js, err := jetstream.NewWithAPIPrefix(nb, "JS.A.API")
		if err != nil {
			t.Fatal(err)
		}
		if err := DeleteMsgs(ctx, js, "T", seqs[:3], 0); err != nil {
			t.Fatal(err)
		}
		checkGone(t, owner, seqs, 3)
		plain, err := jetstream.New(nb)
		if err != nil {
			t.Fatal(err)
		}
		if err := DeleteMsgs(ctx, plain, "T", seqs[3:], 0); err == nil {
			t.Fatal("a deletion under the default prefix, where this account has no JetStream, was taken for done")
		}
		checkGone(t, owner, seqs, 3)
	})
}

// apiPrefix follows the client's options: a domain, an API prefix with or
// without its final dot, or neither.
func TestAPIPrefix(t *testing.T) {
	nc := &nats.Conn{}
	for _, c := range []struct {
		js   func() (jetstream.JetStream, error)
		want string
	}{
		{func() (jetstream.JetStream, error) { return jetstream.New(nc) }, "$JS.API."},
		{func() (jetstream.JetStream, error) { return jetstream.NewWithDomain(nc, "hub") }, "$JS.hub.API."},
		{func() (jetstream.JetStream, error) { return jetstream.NewWithAPIPrefix(nc, "JS.A.API") }, "JS.A.API."},
		{func() (jetstream.JetStream, error) { return jetstream.NewWithAPIPrefix(nc, "JS.A.API.") }, "JS.A.API."},
	} {
		js, err := c.js()
		if err != nil {
			t.Fatal(err)
		}
		if got := apiPrefix(js); got != c.want || !strings.HasSuffix(got, ".") {
			t.Errorf("apiPrefix = %q, want %q", got, c.want)
		}
	}
}
