package layout_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/commitlog/layout"
)

// Worlds names the worlds with objects in the bucket, whatever their
// names hold, and LatestAt reads a world's last manifest with its time.
func TestWorldsAndLatestAt(t *testing.T) {
	ctx := context.Background()
	b, err := bucket.Open(ctx, "file://"+t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	before := time.Now().Add(-time.Minute)
	for _, w := range []string{"alpha", "b/c d", ".."} {
		for _, seq := range []uint64{4, 9} {
			m, _ := json.Marshal(layout.Manifest{Format: layout.ManifestFormat, World: w, Seq: seq, Docs: 3})
			if err := b.Put(ctx, layout.CheckpointKey(w, seq), m); err != nil {
				t.Fatal(err)
			}
		}
	}
	b.Put(ctx, "worlds/stray/x", []byte("not a world's"))
	worlds, err := layout.Worlds(ctx, b)
	if err != nil || strings.Join(worlds, "|") != "..|alpha|b/c d" {
		t.Fatalf("worlds %q, %v", worlds, err)
	}
	m, at, err := layout.LatestAt(ctx, b, "b/c d")
	if err != nil || m == nil || m.Seq != 9 || m.Docs != 3 || at.Before(before) {
		t.Fatalf("latest of b/c d: %+v at %v, %v", m, at, err)
	}
	if m, _, err := layout.LatestAt(ctx, b, "none"); m != nil || err != nil {
		t.Fatalf("a world without checkpoints: %+v, %v", m, err)
	}
}
