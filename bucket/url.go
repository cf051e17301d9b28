package bucket

import (
	"errors"
	"path/filepath"
	"strings"
)

// URLFor is the URL Open takes for s: a URL as it is, a plain path as a
// file:// bucket at its absolute path (gocloud's file URLs are absolute),
// so that a directory can be named as operators name directories.
func URLFor(s string) (string, error) {
	if strings.Contains(s, "://") {
		return s, nil
	}
	if s == "" {
		return "", errors.New("bucket: no URL or directory")
	}
	abs, err := filepath.Abs(s)
	if err != nil {
		return "", err
	}
	return "file://" + filepath.ToSlash(abs), nil
}
