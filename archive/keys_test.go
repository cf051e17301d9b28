package archive_test

import (
	"testing"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/bucket"
)

func TestBuildKey(t *testing.T) {
	for _, c := range [][2]string{{"default", "ea8ce61d-03a8-4221-bbab-4581a0acff79"}, {"a/b", ".."}, {"", "."}, {"p q", "x%2F"}} {
		k := archive.BuildKey(c[0], c[1])
		if err := bucket.CheckKey(k); err != nil {
			t.Errorf("%q: %v", c, err)
		}
		p, i, err := archive.ParseBuildKey(k)
		if err != nil || p != c[0] || i != c[1] {
			t.Errorf("%q -> %s -> %q %q %v", c, k, p, i, err)
		}
	}
	if _, _, err := archive.ParseBuildKey("archive/builds/x.mrar"); err == nil {
		t.Error("a key without a project parsed")
	}
}
