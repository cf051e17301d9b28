package main

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/services/bes"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

const (
	natsConf     = "../../ops/nats/nats-server.conf"
	accountsConf = "../../ops/nats/accounts.conf"
)

// TestAccountsConfCurrent: the accounts file ops/ ships is what `streams
// accounts` prints, so a durable consumer added to the code reaches the
// reader's denials of a production cluster.
func TestAccountsConfCurrent(t *testing.T) {
	t.Setenv("MILLRACE_COMPACTOR_DURABLE", "")
	var want bytes.Buffer
	if err := streams.WriteAccounts(&want, streams.Config{ServiceConsumers: serviceConsumers()}); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(accountsConf)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want.Bytes()) {
		t.Fatalf("%s is not what `millrace streams accounts` prints; run\n  go run ./cmd/millrace streams accounts > ops/nats/accounts.conf", accountsConf)
	}
}

// TestProductionNATSConfig runs three servers from ops/nats/nats-server.conf
// (the listening ports moved to free loopback ones, nothing else changed),
// as a node of each reads its environment, and opens the backbone on them
// as a millrace process would: the service nkey over TLS, R3 streams. The
// configuration carries the edge's default event limit, and its reader
// looks but cannot publish a build event.
func TestProductionNATSConfig(t *testing.T) {
	dir := t.TempDir()
	ca, cert, key := testCA(t, dir)
	seed := func(name string) (seedFile, public string) {
		kp, err := nkeys.CreateUser()
		if err != nil {
			t.Fatal(err)
		}
		s, _ := kp.Seed()
		public, _ = kp.PublicKey()
		seedFile = filepath.Join(dir, name+".nk")
		if err := os.WriteFile(seedFile, s, 0o600); err != nil {
			t.Fatal(err)
		}
		return seedFile, public
	}
	serviceSeed, servicePub := seed("service")
	readerSeed, readerPub := seed("reader")
	_, systemPub := seed("system")

	const n = 3
	routePorts := make([]int, n)
	for i := range routePorts {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		routePorts[i] = l.Addr().(*net.TCPAddr).Port
		l.Close()
	}
	var urls []string
	var servers []*server.Server
	for i := range n {
		for k, v := range map[string]string{
			"NATS_SERVER_NAME": fmt.Sprintf("nats-%c", 'a'+i), "NATS_STORE_DIR": filepath.Join(dir, fmt.Sprint(i)),
			"NATS_ROUTE_A":  fmt.Sprintf("nats-route://127.0.0.1:%d", routePorts[0]),
			"NATS_ROUTE_B":  fmt.Sprintf("nats-route://127.0.0.1:%d", routePorts[1]),
			"NATS_ROUTE_C":  fmt.Sprintf("nats-route://127.0.0.1:%d", routePorts[2]),
			"NATS_TLS_CERT": cert, "NATS_TLS_KEY": key, "NATS_TLS_CA": ca,
			streams.ServiceNKeyEnv: servicePub, streams.ReaderNKeyEnv: readerPub, streams.SystemNKeyEnv: systemPub,
		} {
			t.Setenv(k, v)
		}
		o, err := server.ProcessConfigFile(natsConf)
		if err != nil {
			t.Fatalf("%s: %v", natsConf, err)
		}
		if i == 0 {
			if need := int32(bes.DefaultMaxEventBytes + streams.HeaderRoom); o.MaxPayload < need {
				t.Errorf("max_payload %d: the edge's default event limit needs %d", o.MaxPayload, need)
			}
			if !o.JetStream || len(o.Routes) != n || o.TLSConfig == nil || o.Cluster.TLSConfig == nil || o.SystemAccount != "SYS" {
				t.Errorf("the configuration lost a part: jetstream %v, %d routes, client TLS %v, route TLS %v, system account %q",
					o.JetStream, len(o.Routes), o.TLSConfig != nil, o.Cluster.TLSConfig != nil, o.SystemAccount)
			}
		}
		o.Host, o.Port, o.HTTPPort = "127.0.0.1", -1, -1
		o.Cluster.Host, o.Cluster.Port = "127.0.0.1", routePorts[i]
		o.NoLog, o.NoSigs = true, true
		ns, err := server.NewServer(o)
		if err != nil {
			t.Fatalf("server %d: %v", i, err)
		}
		ns.Start()
		t.Cleanup(ns.Shutdown)
		if !ns.ReadyForConnections(10 * time.Second) {
			t.Fatalf("server %d not ready", i)
		}
		servers = append(servers, ns)
		urls = append(urls, strings.Replace(ns.ClientURL(), "nats://", "tls://", 1))
	}
	poll.Until(t, "the cluster to elect a meta leader", func() bool {
		for _, ns := range servers {
			if ns.JetStreamIsLeader() && len(ns.JetStreamClusterPeers()) == n {
				return true
			}
		}
		return false
	}, poll.Within(30*time.Second), poll.Every(50*time.Millisecond))

	ctx := t.Context()
	c := streams.Config{URL: strings.Join(urls, ","), Replicas: 3,
		Auth: streams.ClientAuth{NKeySeedFile: serviceSeed, TLSCA: ca}, ServiceConsumers: serviceConsumers()}
	bb, err := streams.Open(ctx, c, t.Name(), nil)
	if err != nil {
		t.Fatalf("the backbone as millrace's service user: %v", err)
	}
	defer bb.Close()
	info, err := bb.JS.Stream(ctx, subjects.StreamBES)
	if err != nil {
		t.Fatal(err)
	}
	if r := info.CachedInfo().Config.Replicas; r != 3 {
		t.Errorf("BES stream has %d replicas, want 3", r)
	}
	if _, err := bb.JS.Publish(ctx, subjects.BES("p", "inv"), []byte("event")); err != nil {
		t.Fatalf("the service user's publish: %v", err)
	}

	violations := make(chan error, 4)
	opt, err := nats.NkeyOptionFromSeed(readerSeed)
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(c.URL, opt, nats.RootCAs(ca),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { violations <- err }))
	if err != nil {
		t.Fatalf("the reader: %v", err)
	}
	defer nc.Close()
	if err := nc.Publish(subjects.BES("p", "forged"), []byte("x")); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-violations:
		if !strings.Contains(strings.ToLower(err.Error()), "permissions violation") {
			t.Fatalf("the reader's publish of a build event: %v, want a permissions violation", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the reader published a build event without a permissions violation")
	}
	if _, err := nc.Request("$JS.API.STREAM.INFO."+subjects.StreamBES, nil, 5*time.Second); err != nil {
		t.Fatalf("the reader's stream info: %v", err)
	}
}
