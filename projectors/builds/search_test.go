package builds

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/testenv"
)

// searchIDs is the page's builds as project/id.
func searchIDs(p SearchPage) []string {
	var out []string
	for _, b := range p.Builds {
		out = append(out, b.Project+"/"+b.ID)
	}
	return out
}

// TestSearchFiltersAndPages: the list of builds, newest first, narrowed by
// each filter, paged by cursor, and never past the projects the reader may
// see; each row with its branch, commit and counts.
func TestSearchFiltersAndPages(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	synthBuild(s, "acme", "inv-a1", 40, true)
	s.advance(time.Hour)
	second := s.now
	synthBuild(s, "beta", "inv-b1", 40, true)
	s.advance(time.Hour)
	synthBuild(s, "acme", "inv-a2", 40, false)
	applyAll(t, pool, p, s.msgs, 100)

	search := func(q SearchQuery) SearchPage {
		t.Helper()
		page, err := Search(ctx, pool, q)
		if err != nil {
			t.Fatalf("%+v: %v", q, err)
		}
		return page
	}
	for _, c := range []struct {
		name string
		q    SearchQuery
		want []string
	}{
		{"all", SearchQuery{}, []string{"acme/inv-a2", "beta/inv-b1", "acme/inv-a1"}},
		{"project", SearchQuery{Project: "acme"}, []string{"acme/inv-a2", "acme/inv-a1"}},
		{"running", SearchQuery{Status: "running"}, []string{"acme/inv-a2"}},
		{"command and user", SearchQuery{Command: "test", User: "ci"}, []string{"acme/inv-a2", "beta/inv-b1", "acme/inv-a1"}},
		{"another command", SearchQuery{Command: "build"}, nil},
		{"host", SearchQuery{Host: "ci-7.example", Status: "failed"}, []string{"beta/inv-b1", "acme/inv-a1"}},
		{"commit", SearchQuery{Commit: "sha-of-beta"}, []string{"beta/inv-b1"}},
		{"branch", SearchQuery{Branch: "main"}, nil},
		{"id prefix", SearchQuery{Text: "inv-a"}, []string{"acme/inv-a2", "acme/inv-a1"}},
		{"pattern", SearchQuery{Text: "//..."}, []string{"acme/inv-a2", "beta/inv-b1", "acme/inv-a1"}},
		{"no such text", SearchQuery{Text: "inv-%"}, nil},
		{"from", SearchQuery{From: second}, []string{"acme/inv-a2", "beta/inv-b1"}},
		{"to", SearchQuery{To: second}, []string{"acme/inv-a1"}},
		{"readable projects", SearchQuery{Projects: []string{"beta"}}, []string{"beta/inv-b1"}},
		{"another project's builds", SearchQuery{Projects: []string{"beta"}, Project: "acme"}, nil},
		{"no project readable", SearchQuery{Projects: []string{}}, nil},
	} {
		if got := searchIDs(search(c.q)); !slices.Equal(got, c.want) {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}

	var paged []string
	q := SearchQuery{Limit: 1}
	for range 4 {
		page := search(q)
		paged = append(paged, searchIDs(page)...)
		if page.Next == "" {
			break
		}
		q.Before = page.Next
	}
	if want := []string{"acme/inv-a2", "beta/inv-b1", "acme/inv-a1"}; !slices.Equal(paged, want) {
		t.Errorf("pages of one: %v, want %v", paged, want)
	}

	// Counts: 40 targets, two of them failing genrules; tests at 9, 19
	// (flaky), 29 (failed), 39: counted in the rollups once finished,
	// counted from the running table while running.
	for _, b := range search(SearchQuery{Project: "acme"}).Builds {
		if b.TargetsFailed != 2 || b.TestsPassed != 2 || b.TestsFailed != 1 || b.TestsFlaky != 1 ||
			b.Commit != "sha-of-acme" || b.User != "ci" || b.Host != "ci-7.example" || !slices.Equal(b.Patterns, []string{"//..."}) {
			t.Errorf("%s: %+v", b.ID, b)
		}
	}

	for _, bad := range []SearchQuery{{Status: "won"}, {Limit: -1}, {Before: "x"}, {Before: "-3"}, {From: second, To: second}} {
		if _, err := Search(ctx, pool, bad); err == nil {
			t.Errorf("%+v: no error", bad)
		}
	}
}

// BenchmarkSearch: a page of builds out of 100,000 in five projects, per
// filter (server time, warm):
//
//	go test ./projectors/builds -run '^$' -bench Search -benchtime 20x
func BenchmarkSearch(b *testing.B) {
	pool, _ := testenv.Pool(b)
	ctx := context.Background()
	for _, sql := range []string{
		`insert into invocations (id, project, status, command, user_name, host, patterns, first_event_at, last_event_at, build_key,
		                          counted_status, counted_tests_passed, counted_tests_failed, counted_tests_flaky)
		 select 'inv-' || n, 'p' || n % 5, case when n % 50 = 0 then 'failed' else 'succeeded' end, 'test', 'u' || n % 40, 'h' || n % 7,
		        array['//pkg' || n % 100 || '/...'], at, at, (floor(extract(epoch from at) / 86400)::bigint << 47) | n,
		        'succeeded', 10, 0, 0
		 from generate_series(1, 100000) n, lateral (select timestamptz '2026-06-01' + n * interval '2 minutes' as at) t`,
		`insert into build_metadata (build_key, project, source, key, value)
		 select build_key, project, 'build_metadata', 'COMMIT_SHA', 'sha-' || (build_key & 65535) / 3 from invocations`,
		`vacuum analyze invocations, build_metadata`,
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			b.Fatal(err)
		}
	}
	for _, c := range []struct {
		name string
		q    SearchQuery
	}{
		{"newest", SearchQuery{}},
		{"project", SearchQuery{Project: "p3"}},
		{"project, failed", SearchQuery{Project: "p3", Status: "failed"}},
		{"project, user", SearchQuery{Project: "p3", User: "u7"}},
		{"commit", SearchQuery{Commit: "sha-100"}},
		{"id prefix", SearchQuery{Text: "inv-9999"}},
		{"pattern", SearchQuery{Text: "//pkg42/"}},
		{"a day", SearchQuery{Project: "p1", From: time.Date(2026, 7, 1, 0, 0, 0, 0, time.UTC), To: time.Date(2026, 7, 2, 0, 0, 0, 0, time.UTC)}},
		{"nothing matches", SearchQuery{Project: "p3", User: "nobody"}},
	} {
		b.Run(c.name, func(b *testing.B) {
			for range b.N {
				if _, err := Search(ctx, pool, c.q); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
