package bucket

import (
	"os"
	"path/filepath"
	"testing"
)

func TestURLFor(t *testing.T) {
	wd, _ := os.Getwd()
	for in, want := range map[string]string{
		"s3://b?region=r": "s3://b?region=r",
		"file:///x/y":     "file:///x/y",
		"var/bucket":      "file://" + filepath.ToSlash(filepath.Join(wd, "var", "bucket")),
		"/abs/dir":        "file:///abs/dir",
	} {
		if got, err := URLFor(in); err != nil || got != want {
			t.Errorf("URLFor(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	if _, err := URLFor(""); err == nil {
		t.Error("an empty URL was accepted")
	}
}
