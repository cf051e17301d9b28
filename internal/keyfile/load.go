package keyfile

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/millrace/millrace/internal/apikey"
)

// Source is where a server's set of keys comes from: a flag's inline value
// and a file (watched: edits apply within a second, with no restart). When
// both are empty and DevDir is set (`millrace dev`), the file is
// DevDir/DevFile, made with one random key for DevName on first use
// (DevSecret).
type Source struct {
	Inline, File             string
	DevDir, DevFile, DevName string
	// What names the keys in the log and in errors: "BES API keys".
	What string
}

// Load parses the keys of src, written in syntax, into a table and, when
// they come from a file, keeps it current until ctx ends: each reload
// replaces the table's keys at once (apikey.Table.Replace). A file that
// stops parsing keeps the previous keys, and so does one emptied of every
// key while keys were in force: emptying the file must not turn
// authentication off. m and log may be nil.
func Load[P any](ctx context.Context, src Source, syntax apikey.Syntax[P], m *Metrics, log *slog.Logger) (*apikey.Table[P], error) {
	if log == nil {
		log = slog.Default()
	}
	file := src.File
	if file == "" && strings.TrimSpace(src.Inline) == "" && src.DevDir != "" {
		if _, err := DevSecret(src.DevDir, src.DevFile, src.DevName); err != nil {
			return nil, err
		}
		file = filepath.Join(src.DevDir, src.DevFile)
		log.Info("development "+src.What+" (reloaded when it changes)", "file", file)
	}
	keys := &apikey.Table[P]{}
	apply := func(text string) error {
		t, err := apikey.Parse(text, syntax)
		if err != nil {
			return err
		}
		if keys.Len() > 0 && t.Len() == 0 {
			return errors.New("no key left: an empty key file would let every client in, so the previous keys stay in force")
		}
		keys.Replace(t)
		return nil
	}
	if file == "" {
		if err := apply(src.Inline); err != nil {
			return nil, err
		}
		return keys, nil
	}
	w, err := New(file, func(b []byte) error { return apply(Lines(src.Inline, b)) }, m, log)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("%s file: %w", src.What, err)
		}
		return nil, fmt.Errorf("%s: %w", src.What, err)
	}
	go w.Run(ctx, DefaultInterval)
	return keys, nil
}

// DevSecret returns the "name=secret" line kept in dir/file, making one
// with a random secret on first use (mode 0600), so that `millrace dev`
// authenticates its edges without any setup.
func DevSecret(dir, file, name string) (string, error) {
	path := filepath.Join(dir, file)
	if b, err := os.ReadFile(path); err == nil {
		return string(b), nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return "", err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	secret := make([]byte, 16)
	rand.Read(secret)
	line := name + "=" + hex.EncodeToString(secret) + "\n"
	// Written beside and renamed into place: a reader (a script, a test)
	// never sees the file empty or half written.
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(line), 0o600); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, path); err != nil {
		return "", err
	}
	return line, nil
}
