package kafka

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math/big"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/millrace/millrace/streams/projection"
)

func TestParseRoutes(t *testing.T) {
	rs, err := ParseRoutes("bes.> -> millrace.bes,\n fleet.place.> -> millrace.placements, commits.*.x -> c_1")
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 3 || rs[1] != (Route{"fleet.place.>", "millrace.placements"}) {
		t.Fatalf("routes: %+v", rs)
	}
	for _, c := range []struct {
		subject, topic string
	}{
		{"bes.p.inv", "millrace.bes"},
		{"bes", ""},
		{"fleet.place.pool", "millrace.placements"},
		{"fleet.node.pool", ""},
		{"commits.w.x", "c_1"},
		{"commits.w.x.y", ""},
		{"commits.w", ""},
	} {
		if got := topicFor(rs, c.subject); got != c.topic {
			t.Errorf("%s: topic %q, want %q", c.subject, got, c.topic)
		}
	}
	for _, bad := range []string{"", "bes.>", "bes.> ->", "-> t", "bes.>.x -> t", "bes..x -> t", "bes.> -> bad topic", "bes.a* -> t", "bes.> -> " + strings.Repeat("t", 250)} {
		if _, err := ParseRoutes(bad); err == nil {
			t.Errorf("ParseRoutes(%q) accepted", bad)
		}
	}
}

// cluster is a kfake cluster in the test process.
func cluster(t testing.TB, opts ...kfake.Opt) *kfake.Cluster {
	t.Helper()
	c, err := kfake.NewCluster(append([]kfake.Opt{kfake.NumBrokers(1)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// readAll consumes every record of topic until n have come or the wait
// ends.
func readAll(t testing.TB, brokers []string, topic string, n int, wait time.Duration) []*kgo.Record {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	var out []*kgo.Record
	for len(out) < n {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			break
		}
		fs.EachRecord(func(r *kgo.Record) { out = append(out, r) })
	}
	return out
}

func header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

func TestSendKeysHeadersAndOrder(t *testing.T) {
	c := cluster(t)
	brokers := c.ListenAddrs()
	e, err := New(Config{Brokers: brokers, Routes: []Route{{"bes.>", "millrace.bes"}}, CreateTopics: true, Partitions: 4}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	ctx := context.Background()
	if err := e.EnsureTopics(ctx); err != nil {
		t.Fatal(err)
	}
	const n = 2000
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := 1; i <= n; i++ {
		r := &projection.Record{Stream: "BES", Subject: fmt.Sprintf("bes.p.inv%02d", i%37), Seq: uint64(i),
			Time: time.Unix(1700000000, 0), MsgID: fmt.Sprint("m", i),
			Headers: map[string][]string{"Nats-Msg-Id": {fmt.Sprint("m", i)}, "Millrace-Schema": {"bes.v1"}},
			Data:    []byte(fmt.Sprint("event ", i))}
		wg.Add(1)
		if err := e.Send(ctx, r, func(err error) {
			defer wg.Done()
			if err != nil {
				errs <- err
			}
		}); err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if err := e.Send(ctx, &projection.Record{Subject: "fleet.x"}, func(error) {}); err == nil {
		t.Fatal("a subject without a route was accepted")
	}

	recs := readAll(t, brokers, "millrace.bes", n, 20*time.Second)
	if len(recs) != n {
		t.Fatalf("%d records in Kafka, want %d", len(recs), n)
	}
	last := map[string]uint64{}
	partition := map[string]int32{}
	for _, r := range recs {
		seq, err := strconv.ParseUint(header(r, HeaderSeq), 10, 64)
		if err != nil {
			t.Fatalf("record without %s: %v", HeaderSeq, r.Headers)
		}
		key := string(r.Key)
		if key != header(r, HeaderSubject) || header(r, HeaderStream) != "BES" || header(r, "Nats-Msg-Id") != fmt.Sprint("m", seq) ||
			header(r, "Millrace-Schema") != "bes.v1" || string(r.Value) != fmt.Sprint("event ", seq) {
			t.Fatalf("record %d: key %q headers %v value %q", seq, key, r.Headers, r.Value)
		}
		if p, ok := partition[key]; ok && p != r.Partition {
			t.Fatalf("key %s in partitions %d and %d", key, p, r.Partition)
		}
		partition[key] = r.Partition
		if seq <= last[key] {
			t.Fatalf("key %s: %d after %d", key, seq, last[key])
		}
		last[key] = seq
	}
	used := map[int32]bool{}
	for _, p := range partition {
		used[p] = true
	}
	if len(used) < 2 {
		t.Fatalf("37 keys all in %d partition(s): keys do not spread", len(used))
	}
}

func TestEnsureTopics(t *testing.T) {
	c := cluster(t, kfake.SeedTopics(2, "have"))
	e, err := New(Config{Brokers: c.ListenAddrs(), Routes: []Route{{"a.>", "have"}, {"b.>", "missing"}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	err = e.EnsureTopics(context.Background())
	if err == nil || !strings.Contains(err.Error(), "missing") || strings.Contains(err.Error(), "have") {
		t.Fatalf("EnsureTopics without creation: %v", err)
	}
	for _, bad := range []Config{
		{Routes: []Route{{"a.>", "t"}}},
		{Brokers: []string{"x:1"}},
		{Brokers: []string{"x:1"}, Routes: []Route{{"a.>", "t"}}, Compression: "brotli"},
		{Brokers: []string{"x:1"}, Routes: []Route{{"a.>", "t"}}, SASLMechanism: "gssapi", SASLUser: "u"},
		{Brokers: []string{"x:1"}, Routes: []Route{{"a.>", "t"}}, SASLMechanism: "plain"},
	} {
		if e, err := New(bad, nil); err == nil {
			e.Close()
			t.Errorf("New(%+v) accepted", bad)
		}
	}
}

// SASL: the exporter authenticates with each mechanism it offers, and a
// wrong password is refused (the record fails rather than going anywhere).
func TestSASL(t *testing.T) {
	for _, mech := range []string{"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"} {
		t.Run(mech, func(t *testing.T) {
			c := cluster(t, kfake.EnableSASL(), kfake.Superuser(mech, "millrace", "s3cret"), kfake.SeedTopics(1, "t"))
			send := func(pass string) error {
				e, err := New(Config{Brokers: c.ListenAddrs(), Routes: []Route{{"a.>", "t"}},
					SASLMechanism: strings.ToLower(mech), SASLUser: "millrace", SASLPassword: pass}, nil)
				if err != nil {
					t.Fatal(err)
				}
				defer e.Close()
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
				defer cancel()
				errc := make(chan error, 1)
				if err := e.Send(ctx, &projection.Record{Stream: "S", Subject: "a.b", Seq: 1, Data: []byte("x")}, func(err error) { errc <- err }); err != nil {
					t.Fatal(err)
				}
				return <-errc
			}
			if err := send("s3cret"); err != nil {
				t.Fatalf("with the right password: %v", err)
			}
			if err := send("wrong"); err == nil {
				t.Fatal("a wrong password was accepted")
			}
		})
	}
}

// TLS: the exporter verifies the brokers' certificate against its CA.
func TestTLS(t *testing.T) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kafka"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	c := cluster(t, kfake.TLS(&tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}}), kfake.SeedTopics(1, "t"))
	send := func(roots *x509.CertPool) error {
		e, err := New(Config{Brokers: c.ListenAddrs(), Routes: []Route{{"a.>", "t"}}, TLS: &tls.Config{RootCAs: roots}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		errc := make(chan error, 1)
		if err := e.Send(ctx, &projection.Record{Stream: "S", Subject: "a.b", Seq: 1, Data: []byte("x")}, func(err error) { errc <- err }); err != nil {
			t.Fatal(err)
		}
		return <-errc
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	if err := send(pool); err != nil {
		t.Fatalf("with the brokers' CA: %v", err)
	}
	if err := send(x509.NewCertPool()); err == nil {
		t.Fatal("a broker certificate from an unknown CA was accepted")
	}
}
