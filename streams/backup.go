package streams

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/nats-io/jsm.go"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Backups of the backbone.
//
// A backup is a directory: one JetStream snapshot per stream (the server's
// own format, with the stream's consumers and their positions, made by
// nats-io's jsm.go as `nats stream backup` makes it), and backup.json
// saying what each held. A snapshot keeps sequence numbers, which matters:
// a commit-log version is its message's sequence, and the projections
// record positions as sequences. Snapshots are taken while the services
// run; a stream keeps taking messages meanwhile and its snapshot holds
// what it held when the snapshot began.

// BackupDescription and RestoreDescription are the help of the commands
// that make and restore a backup.
const (
	BackupDescription = "Writes one JetStream snapshot per stream into --out (sequence numbers kept) and backup.json last; the\n" +
		"services may keep running. Back PostgreSQL up before, and the bucket after (ops/runbooks/backup-restore.md)."
	RestoreDescription = "Restores every stream of the backup in --from with its consumers and sequence numbers, then applies this\n" +
		"backbone's stream settings (replicas, limits). A stream that holds messages is refused: restore onto a\n" +
		"fresh backbone, then replay the projections or restore PostgreSQL (ops/runbooks/backup-restore.md)."
)

// BackupManifestFile is the backup's own record, beside the snapshots.
const BackupManifestFile = "backup.json"

// BackupManifest is what a backup holds.
type BackupManifest struct {
	Taken   time.Time      `json:"taken"`
	Server  string         `json:"server_version"`
	Streams []BackupStream `json:"streams"`
}

// BackupStream is one stream's snapshot.
type BackupStream struct {
	Name     string `json:"name"`
	Messages uint64 `json:"messages"`
	Bytes    uint64 `json:"bytes"`
	FirstSeq uint64 `json:"first_seq"`
	LastSeq  uint64 `json:"last_seq"`
	// Archive is the snapshot's size on disk (compressed).
	Archive uint64 `json:"archive_bytes"`
}

// BackupProgress is told how far a stream's snapshot or restore is, in bytes.
type BackupProgress func(stream string, done, total uint64)

// Backup snapshots the streams names, each with its consumers, into
// dir/<name>; dir must not hold a backup already. It writes the manifest
// last, so a backup without one did not finish.
func Backup(ctx context.Context, nc *nats.Conn, dir string, names []string, progress BackupProgress) (BackupManifest, error) {
	m := BackupManifest{Taken: time.Now().UTC(), Server: nc.ConnectedServerVersion()}
	if _, err := os.Stat(filepath.Join(dir, BackupManifestFile)); err == nil {
		return m, fmt.Errorf("backup: %s holds a backup already", dir)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return m, fmt.Errorf("backup: %w", err)
	}
	mgr, err := jsm.New(nc, jsm.WithTimeout(30*time.Second))
	if err != nil {
		return m, fmt.Errorf("backup: %w", err)
	}
	for _, name := range names {
		st, err := mgr.LoadStream(name)
		if err != nil {
			return m, fmt.Errorf("backup %s: %w", name, err)
		}
		state, err := st.State()
		if err != nil {
			return m, fmt.Errorf("backup %s: %w", name, err)
		}
		opts := []jsm.SnapshotOption{jsm.SnapshotConsumers()}
		if progress != nil {
			opts = append(opts, jsm.SnapshotNotify(func(p jsm.SnapshotProgress) {
				progress(name, p.UncompressedBytesReceived(), p.BytesExpected())
			}))
		}
		sdir := filepath.Join(dir, name)
		if _, err := st.SnapshotToDirectory(ctx, sdir, opts...); err != nil {
			return m, fmt.Errorf("backup %s: %w", name, err)
		}
		bs := BackupStream{Name: name, Messages: state.Msgs, Bytes: state.Bytes, FirstSeq: state.FirstSeq, LastSeq: state.LastSeq}
		if data, err := jsm.SnapshotDataPath(sdir); err == nil {
			if fi, err := os.Stat(data); err == nil {
				bs.Archive = uint64(fi.Size())
			}
		}
		m.Streams = append(m.Streams, bs)
	}
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return m, err
	}
	tmp := filepath.Join(dir, BackupManifestFile+".tmp")
	if err := os.WriteFile(tmp, append(b, '\n'), 0o600); err != nil {
		return m, fmt.Errorf("backup: %w", err)
	}
	return m, os.Rename(tmp, filepath.Join(dir, BackupManifestFile))
}

// ReadBackup reads a backup's manifest.
func ReadBackup(dir string) (BackupManifest, error) {
	var m BackupManifest
	b, err := os.ReadFile(filepath.Join(dir, BackupManifestFile))
	if errors.Is(err, os.ErrNotExist) {
		return m, fmt.Errorf("restore: %s holds no finished backup (no %s)", dir, BackupManifestFile)
	}
	if err != nil {
		return m, fmt.Errorf("restore: %w", err)
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, fmt.Errorf("restore: %s: %w", BackupManifestFile, err)
	}
	return m, nil
}

// ErrStreamNotEmpty is returned by Restore for a stream that holds
// messages: a restore never replaces data.
var ErrStreamNotEmpty = errors.New("holds messages; a restore goes onto a fresh backbone")

// Restore restores every stream of the backup in dir. A stream that exists
// and is empty (a backbone opened once applies its streams) is deleted
// first; one that holds messages is refused before anything is restored.
// Each restored stream is checked against the manifest: the same messages
// and sequences.
func Restore(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, dir string, progress BackupProgress) (BackupManifest, error) {
	m, err := ReadBackup(dir)
	if err != nil {
		return m, err
	}
	var empty []string
	for _, bs := range m.Streams {
		st, err := js.Stream(ctx, bs.Name)
		switch {
		case errors.Is(err, jetstream.ErrStreamNotFound):
			continue
		case err != nil:
			return m, fmt.Errorf("restore %s: %w", bs.Name, err)
		}
		if n := st.CachedInfo().State.Msgs; n > 0 {
			return m, fmt.Errorf("restore %s: the stream %w (%d)", bs.Name, ErrStreamNotEmpty, n)
		}
		empty = append(empty, bs.Name)
	}
	for _, name := range empty {
		if err := js.DeleteStream(ctx, name); err != nil {
			return m, fmt.Errorf("restore %s: delete the empty stream: %w", name, err)
		}
	}
	mgr, err := jsm.New(nc, jsm.WithTimeout(30*time.Second))
	if err != nil {
		return m, fmt.Errorf("restore: %w", err)
	}
	for _, bs := range m.Streams {
		var opts []jsm.SnapshotOption
		if progress != nil {
			opts = append(opts, jsm.RestoreNotify(func(p jsm.RestoreProgress) {
				progress(bs.Name, p.BytesSent(), uint64(p.ChunksToSend())*uint64(p.ChunkSize()))
			}))
		}
		_, state, err := mgr.RestoreSnapshotFromDirectory(ctx, bs.Name, filepath.Join(dir, bs.Name), opts...)
		if err != nil {
			return m, fmt.Errorf("restore %s: %w", bs.Name, err)
		}
		// An empty stream's first sequence is 0 or 1 depending on how it
		// came to be empty; its last one says where the next goes.
		if state.Msgs != bs.Messages || state.LastSeq != bs.LastSeq || bs.Messages > 0 && state.FirstSeq != bs.FirstSeq {
			return m, fmt.Errorf("restore %s: the restored stream holds %d messages %d..%d, the backup %d messages %d..%d",
				bs.Name, state.Msgs, state.FirstSeq, state.LastSeq, bs.Messages, bs.FirstSeq, bs.LastSeq)
		}
	}
	return m, nil
}

// Write prints what the backup holds, a line a stream.
func (m BackupManifest) Write(w io.Writer, verb string) {
	for _, s := range m.Streams {
		fmt.Fprintf(w, "%s %s: %d messages (%d..%d), %d bytes, %d in the snapshot\n", verb, s.Name, s.Messages, s.FirstSeq, s.LastSeq, s.Bytes, s.Archive)
	}
}

// PrintProgress is a BackupProgress that prints to w at most once a second.
func PrintProgress(w io.Writer, verb string) BackupProgress {
	var last time.Time
	return func(stream string, done, total uint64) {
		if time.Since(last) < time.Second || total == 0 {
			return
		}
		last = time.Now()
		fmt.Fprintf(w, "%s %s: %d of %d bytes (%d%%)\n", verb, stream, done, total, min(100, done*100/total))
	}
}
