package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/millrace/millrace/internal/keyfile"
)

// keySource is where a set of keys comes from: a flag's inline value and a
// file (watched: edits apply within a second, with no restart). When both
// are empty and devSecrets is set (millrace dev), the file is
// devSecrets/devFile, made with one random key for devName on first use.
type keySource struct {
	inline, file                 string
	devSecrets, devFile, devName string
	what                         string // for the log: "BES API keys"
}

// keySet is a set of keys a server reads while the file changes under it.
type keySet[K any] interface {
	Len() int
	Replace(K)
}

// loadKeys parses the keys of src into into and, when they come from a
// file, keeps them current until ctx ends. A file that stops parsing keeps
// the previous keys, and so does one emptied of every key while keys were
// in force: emptying the file must not turn authentication off.
func loadKeys[K keySet[K]](ctx context.Context, t *telemetry, src keySource, parse func(string) (K, error), into K, log *slog.Logger) error {
	file := src.file
	if file == "" && strings.TrimSpace(src.inline) == "" && src.devSecrets != "" {
		if _, err := devSecret(src.devSecrets, src.devFile, src.devName); err != nil {
			return err
		}
		file = filepath.Join(src.devSecrets, src.devFile)
		log.Info("development "+src.what+" in "+file, "reloaded", "on change")
	}
	apply := func(text string) error {
		k, err := parse(text)
		if err != nil {
			return err
		}
		if into.Len() > 0 && k.Len() == 0 {
			return errors.New("no key left: an empty key file would let every client in, so the previous keys stay in force")
		}
		into.Replace(k)
		return nil
	}
	if file == "" {
		return apply(src.inline)
	}
	w, err := keyfile.New(file, func(b []byte) error { return apply(keyfile.Lines(src.inline, b)) }, t.kf, log)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("%s file: %w", src.what, err)
		}
		return fmt.Errorf("%s: %w", src.what, err)
	}
	go w.Run(ctx, keyfile.DefaultInterval)
	return nil
}
