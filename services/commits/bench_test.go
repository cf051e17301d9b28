package commits

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/millrace/millrace/projectors/compactor"
	"github.com/millrace/millrace/streams/projection"
)

// BenchmarkOpenWorld measures the cold start of List on a world of
// 1,000,000 documents of 100 bytes whose checkpoint holds them all (made by
// the compactor directly, not through the stream):
//
//	go test -run '^$' -bench BenchmarkOpenWorld -benchtime 3x ./services/commits/
func BenchmarkOpenWorld(b *testing.B) {
	const docs = 1_000_000
	ctx := context.Background()
	bk := memBucket(b)
	versions := make([]projection.Version, docs)
	body := make([]byte, 100)
	at := time.Now()
	for i := range versions {
		versions[i] = projection.Version{Doc: fmt.Sprintf("doc-%07d", i), Seq: uint64(i + 1), Time: at, Body: body}
	}
	if _, err := compactor.MustNew(compactor.Config{}, bk).Fold(ctx, "big", versions); err != nil {
		b.Fatal(err)
	}
	e := startEdge(b, Config{Store: bk})
	b.ResetTimer()
	for range b.N {
		srv, err := New(ctx, Config{Keys: testKeys(b), Store: bk}, e.js, nil, nil)
		if err != nil {
			b.Fatal(err)
		}
		start := time.Now()
		ids, _, _, err := srv.list(ctx, "big", "", "", 10)
		if err != nil || len(ids) != 10 {
			b.Fatal(ids, err)
		}
		b.ReportMetric(time.Since(start).Seconds(), "s/open")
		srv.Close()
	}
}
