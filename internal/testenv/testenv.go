// Package testenv gives tests the real servers they run against: an
// embedded JetStream server per test and a fresh PostgreSQL database per
// test, cloned from a migrated template made once per test binary.
package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"

	"github.com/millrace/millrace/internal/devdb"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/migrations"
)

// NATS starts an embedded JetStream server on a random loopback port with
// its store under the test's temporary directory.
func NATS(t testing.TB) *server.Server {
	t.Helper()
	return NATSAt(t, t.TempDir(), -1)
}

// NATSAt starts an embedded JetStream server with its store in dir and on
// port (-1 for a random one); a test restarts a server with the same dir and
// port to simulate a crash of the backbone.
func NATSAt(t testing.TB, dir string, port int) *server.Server {
	t.Helper()
	return NATSWith(t, func(o *server.Options) { o.StoreDir, o.Port = dir, port })
}

// NATSWith starts an embedded JetStream server as NATS does, with edit
// applied to its options first: a test sets what it is about (a stock
// max_payload of 1 MiB, say).
func NATSWith(t testing.TB, edit func(*server.Options)) *server.Server {
	t.Helper()
	o := &server.Options{
		Host:       "127.0.0.1",
		Port:       -1,
		JetStream:  true,
		StoreDir:   t.TempDir(),
		NoLog:      true,
		NoSigs:     true,
		MaxPayload: 8 << 20,
	}
	if edit != nil {
		edit(o)
	}
	ns, err := server.NewServer(o)
	if err != nil {
		t.Fatalf("nats server: %v", err)
	}
	ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats server not ready")
	}
	t.Cleanup(ns.Shutdown)
	return ns
}

// NATSCluster starts n embedded JetStream servers (n >= 3 for R3 streams)
// clustered over loopback routes, each with its store under the test's
// temporary directory, and waits until they have elected a meta leader.
// Clients may connect to any of them (ClientURL).
func NATSCluster(t testing.TB, n int) []*server.Server {
	t.Helper()
	ports := make([]int, n)
	routes := make([]string, n)
	for i := range ports {
		// The route ports must be known before any server starts: every
		// server lists all of them, itself included, which is how
		// JetStream learns the cluster's size.
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ports[i] = l.Addr().(*net.TCPAddr).Port
		l.Close()
		routes[i] = fmt.Sprintf("nats://127.0.0.1:%d", ports[i])
	}
	name := randomName("c")
	servers := make([]*server.Server, n)
	for i := range servers {
		ns, err := server.NewServer(&server.Options{
			ServerName: fmt.Sprintf("%s-n%d", name, i+1),
			Host:       "127.0.0.1",
			Port:       -1,
			JetStream:  true,
			StoreDir:   t.TempDir(),
			NoLog:      true,
			NoSigs:     true,
			MaxPayload: 8 << 20,
			Cluster:    server.ClusterOpts{Name: name, Host: "127.0.0.1", Port: ports[i]},
			Routes:     server.RoutesFromStr(strings.Join(routes, ",")),
		})
		if err != nil {
			t.Fatalf("nats server %d: %v", i+1, err)
		}
		ns.Start()
		t.Cleanup(ns.Shutdown)
		servers[i] = ns
	}
	poll.Until(t, fmt.Sprintf("the %d-node JetStream cluster to elect a meta leader", n), func() bool {
		// Only the meta leader lists the peers, and only those it has
		// current stats from.
		for _, ns := range servers {
			if ns.JetStreamIsLeader() && len(ns.JetStreamClusterPeers()) == n {
				return true
			}
		}
		return false
	}, poll.Within(30*time.Second), poll.Every(50*time.Millisecond))
	return servers
}

var (
	serverOnce sync.Once
	srv        *devdb.Server
	serverErr  error

	templateOnce sync.Once
	templateName string
	templateErr  error
)

// Server returns the PostgreSQL server tests use (see package devdb); the
// private cluster, when one is needed, lives under the repository's var/pg.
func Server(t testing.TB) *devdb.Server {
	t.Helper()
	serverOnce.Do(func() {
		srv, serverErr = devdb.Find(context.Background(), filepath.Join(repoRoot(), "var", "pg"))
	})
	if serverErr != nil {
		t.Fatalf("postgres: %v", serverErr)
	}
	return srv
}

func repoRoot() string {
	dir, _ := os.Getwd()
	for d := dir; d != "/"; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "go.work")); err == nil {
			return d
		}
	}
	return dir
}

func randomName(prefix string) string {
	b := make([]byte, 6)
	rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

func exec(ctx context.Context, url, sql string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, sql)
	return err
}

// Database creates a fresh, migrated database for the test, drops it when
// the test ends, and returns its URL. Only databases this package created
// are ever dropped.
func Database(t testing.TB) string {
	t.Helper()
	s := Server(t)
	ctx := context.Background()
	templateOnce.Do(func() {
		templateName = randomName("millrace_tmpl_")
		if templateErr = exec(ctx, s.URL, "create database "+templateName); templateErr != nil {
			return
		}
		u, err := devdb.WithDatabase(s.URL, templateName)
		if err != nil {
			templateErr = err
			return
		}
		_, _, templateErr = migrations.ApplyURL(ctx, u)
	})
	if templateErr != nil {
		t.Fatalf("template database: %v", templateErr)
	}
	return newDatabase(t, s, "millrace_test_", " template "+templateName)
}

// EmptyDatabase creates a database with no schema at all for the test (a
// migration's, or what migrates), drops it when the test ends, and
// returns its URL.
func EmptyDatabase(t testing.TB) string {
	t.Helper()
	return newDatabase(t, Server(t), "millrace_empty_", "")
}

// newDatabase creates a database named from prefix on s, as clause says
// (a template), drops it when the test ends and returns its URL.
func newDatabase(t testing.TB, s *devdb.Server, prefix, clause string) string {
	t.Helper()
	name := randomName(prefix)
	if err := exec(context.Background(), s.URL, "create database "+name+clause); err != nil {
		t.Fatalf("create database: %v", err)
	}
	t.Cleanup(func() {
		exec(context.Background(), s.URL, fmt.Sprintf("drop database if exists %s with (force)", name))
	})
	u, err := devdb.WithDatabase(s.URL, name)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// Pool opens a pool on a fresh database (see Database).
func Pool(t testing.TB) (*pgxpool.Pool, string) {
	t.Helper()
	url := Database(t)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatalf("pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool, url
}

// DropTemplate removes the template database; call it from TestMain after
// m.Run so a test binary leaves nothing behind.
func DropTemplate() {
	if templateName == "" || srv == nil {
		return
	}
	exec(context.Background(), srv.URL, fmt.Sprintf("drop database if exists %s with (force)", templateName))
}
