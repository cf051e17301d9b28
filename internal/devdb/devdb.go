// Package devdb finds a PostgreSQL server for development and tests when
// DATABASE_URL is not set: a server on 127.0.0.1:5432 with trust auth if one
// answers, else a private cluster started from the system's PostgreSQL
// binaries under a data directory. It is used by `millrace dev` and by the
// test harness; production always names its database with DATABASE_URL.
package devdb

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// SystemURL is the server that the development defaults try first.
const SystemURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// Server is a PostgreSQL server found or started by Find.
type Server struct {
	// URL of the maintenance database ("postgres") of the server.
	URL string
	// Private is true when Find started a cluster of its own.
	Private bool
	dataDir string
	runAs   string
	pgCtl   string
}

// Find returns a usable server: DATABASE_URL's if set, the system server on
// 127.0.0.1:5432 if it answers, else a private cluster under dataDir, created
// and started if needed (it keeps running after the process exits, like any
// database server; Stop stops it).
func Find(ctx context.Context, dataDir string) (*Server, error) {
	if u := os.Getenv("DATABASE_URL"); u != "" {
		return &Server{URL: u}, nil
	}
	if ping(ctx, SystemURL) == nil {
		return &Server{URL: SystemURL}, nil
	}
	return startPrivate(ctx, dataDir)
}

func ping(ctx context.Context, url string) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return conn.Ping(ctx)
}

// binDir finds the newest PostgreSQL installation's binaries.
func binDir() (string, error) {
	if p, err := exec.LookPath("pg_ctl"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			return filepath.Dir(real), nil
		}
		return filepath.Dir(p), nil
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	slices.SortFunc(dirs, func(a, b string) int { return cmp.Compare(version(b), version(a)) }) // newest first
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "pg_ctl")); err == nil {
			return d, nil
		}
	}
	return "", errors.New("no PostgreSQL binaries found (pg_ctl); install them with `apt-get install postgresql` or set DATABASE_URL")
}

func version(dir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(dir)))
	return n
}

// StartPrivate starts (creating it if needed) a private cluster under
// dataDir, whatever else runs on this machine; tests use it for a server
// they may stop and start.
func StartPrivate(ctx context.Context, dataDir string) (*Server, error) {
	return startPrivate(ctx, dataDir)
}

// Start starts a private cluster again after Stop.
func (s *Server) Start(ctx context.Context) error {
	if !s.Private {
		return errors.New("devdb: not a private cluster")
	}
	_, err := startPrivate(ctx, s.dataDir)
	return err
}

func startPrivate(ctx context.Context, dataDir string) (*Server, error) {
	bin, err := binDir()
	if err != nil {
		return nil, err
	}
	dataDir, err = filepath.Abs(dataDir)
	if err != nil {
		return nil, err
	}
	s := &Server{Private: true, dataDir: dataDir, pgCtl: filepath.Join(bin, "pg_ctl")}
	// PostgreSQL refuses to run as root; run it as the postgres user when we are root.
	if os.Geteuid() == 0 {
		s.runAs = "postgres"
		if _, err := user.Lookup(s.runAs); err != nil {
			return nil, fmt.Errorf("running as root and there is no %q user to run PostgreSQL as: %w", s.runAs, err)
		}
	}
	port, err := s.port()
	if err != nil {
		return nil, err
	}
	s.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
	if ping(ctx, s.URL) == nil {
		return s, nil
	}
	if _, err := os.Stat(filepath.Join(dataDir, "PG_VERSION")); err != nil {
		if err := os.MkdirAll(dataDir, 0o700); err != nil {
			return nil, err
		}
		if err := s.chown(dataDir); err != nil {
			return nil, err
		}
		if err := s.run(ctx, filepath.Join(bin, "initdb"), "-D", dataDir, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"); err != nil {
			return nil, fmt.Errorf("initdb %s: %w", dataDir, err)
		}
	}
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=on", port, dataDir)
	if err := s.run(ctx, s.pgCtl, "-D", dataDir, "-l", filepath.Join(dataDir, "server.log"), "-o", opts, "-w", "-t", "60", "start"); err != nil {
		return nil, fmt.Errorf("start PostgreSQL in %s (see %s): %w", dataDir, filepath.Join(dataDir, "server.log"), err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for ping(ctx, s.URL) != nil {
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("PostgreSQL in %s did not answer on port %d", dataDir, port)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return s, nil
}

// port is fixed per data directory (kept in a file beside it) so that a
// restarted process finds the cluster it started before.
func (s *Server) port() (int, error) {
	portFile := s.dataDir + ".port"
	if b, err := os.ReadFile(portFile); err == nil {
		if p, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			return p, nil
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	p := l.Addr().(*net.TCPAddr).Port
	l.Close()
	if err := os.MkdirAll(filepath.Dir(portFile), 0o755); err != nil {
		return 0, err
	}
	return p, os.WriteFile(portFile, []byte(strconv.Itoa(p)), 0o644)
}

// chown gives dir to the user PostgreSQL runs as, and lets that user
// traverse the directories above it (a test's temporary directory is 0700).
func (s *Server) chown(dir string) error {
	if s.runAs == "" {
		return nil
	}
	for d := filepath.Dir(dir); d != "/" && d != "."; d = filepath.Dir(d) {
		if fi, err := os.Stat(d); err == nil && fi.Mode().Perm()&0o001 == 0 {
			os.Chmod(d, fi.Mode().Perm()|0o011)
		}
	}
	u, err := user.Lookup(s.runAs)
	if err != nil {
		return err
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return filepath.Walk(dir, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		return os.Chown(p, uid, gid)
	})
}

func (s *Server) run(ctx context.Context, name string, args ...string) error {
	var cmd *exec.Cmd
	if s.runAs != "" {
		cmd = exec.CommandContext(ctx, "runuser", append([]string{"-u", s.runAs, "--", name}, args...)...)
	} else {
		cmd = exec.CommandContext(ctx, name, args...)
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%w: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Stop stops a private cluster (fast shutdown); it does nothing otherwise.
func (s *Server) Stop(ctx context.Context) error {
	if !s.Private {
		return nil
	}
	return s.run(ctx, s.pgCtl, "-D", s.dataDir, "-m", "fast", "-w", "stop")
}

// DataDir is the private cluster's data directory ("" for other servers).
func (s *Server) DataDir() string { return s.dataDir }

// WithDatabase returns the connection URL u with its database name replaced.
func WithDatabase(u, db string) (string, error) {
	parsed, err := url.Parse(u)
	if err != nil {
		return "", fmt.Errorf("database URL: %w", err)
	}
	parsed.Path = "/" + db
	return parsed.String(), nil
}

// EnsureDatabase returns the URL of database name on the server, creating
// the database when it is missing; another process creating it at the
// same moment is no error.
func (s *Server) EnsureDatabase(ctx context.Context, name string) (string, error) {
	conn, err := pgx.Connect(ctx, s.URL)
	if err != nil {
		return "", err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	exists := func() (bool, error) {
		var ok bool
		err := conn.QueryRow(ctx, "select exists (select 1 from pg_database where datname = $1)", name).Scan(&ok)
		return ok, err
	}
	ok, err := exists()
	if err != nil {
		return "", err
	}
	if !ok {
		if _, err := conn.Exec(ctx, "create database "+pgx.Identifier{name}.Sanitize()); err != nil {
			if again, _ := exists(); !again {
				return "", fmt.Errorf("create database %s: %w", name, err)
			}
		}
	}
	return WithDatabase(s.URL, name)
}
