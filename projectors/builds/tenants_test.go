package builds

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/schemas/envelope"
)

// TestSameInvocationIDTwoProjects: Bazel lets any client choose its
// invocation id, so two projects may send the same one. Their events,
// interleaved on the stream, must make two complete builds, each exactly
// what it is when projected alone: nothing merged, no event of one skipped
// as a resend of the other's (their BES sequences overlap), each counted in
// its own project's rollups.
func TestSameInvocationIDTwoProjects(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	const id = "3f1c6a52-5b7e-4c1e-9d7a-2a5f0e8b9c41"
	acme, beta := invKey{"acme", id}, invKey{"beta", id}

	// Different builds under the same id: acme's 40 targets, beta's 25 (a
	// merged row would mix their targets, tests and exit codes).
	sa, sb := newStream(t0), newStream(t0)
	synthBuild(sa, acme.project, id, 40, true)
	synthBuild(sb, beta.project, id, 25, true)
	msgs := interleave(t0, 3, sa.msgs, sb.msgs)
	of := func(project string) []*msg {
		var out []*msg
		for _, m := range msgs {
			if m.hdr[envelope.Project] == project {
				out = append(out, m)
			}
		}
		return out
	}
	tools := func(project string) int64 {
		var n int64
		for _, m := range of(project) {
			if m.hdr[envelope.Kind] == envelope.KindTool {
				n++
			}
		}
		return n
	}

	// What each build is alone, with the same stream times.
	alone := map[invKey][]byte{}
	var rollups [][]byte
	for _, k := range []invKey{acme, beta} {
		truncate(t, pool)
		applyAll(t, pool, p, of(k.project), 1000)
		alone[k] = dumpBuild(t, pool, k)
		rollups = append(rollups, dumpRollups(t, pool))
	}

	for _, n := range []int{1000, 1, 7, 64} {
		t.Run(fmt.Sprintf("batch%d", n), func(t *testing.T) {
			truncate(t, pool)
			applyAll(t, pool, p, msgs, n)
			projects, err := Projects(ctx, pool, id)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(projects, []string{"acme", "beta"}) {
				t.Fatalf("projects holding %s: %v, want [acme beta]", id, projects)
			}
			for _, k := range []invKey{acme, beta} {
				b, err := Show(ctx, pool, k.project, k.id)
				if err != nil {
					t.Fatalf("show %v: %v", k, err)
				}
				if b.Project != k.project || b.Status == "running" {
					t.Errorf("%v: project %q status %q, want %q and finished", k, b.Project, b.Status, k.project)
				}
				// Each build's metadata and root causes are its own.
				if got, want := b.BuildMetadata["COMMIT_SHA"], "sha-of-"+k.project; got != want {
					t.Errorf("%v: COMMIT_SHA %q, want %q", k, got, want)
				}
				for _, tg := range b.Targets {
					if !tg.Success && len(tg.RootCauses) != 1 {
						t.Errorf("%v: failed target %s has root causes %+v, want its own action", k, tg.Label, tg.RootCauses)
					}
				}
				var events int64
				if err := pool.QueryRow(ctx, `select event_count from invocations where id = $1 and project = $2`,
					k.id, k.project).Scan(&events); err != nil {
					t.Fatal(err)
				}
				if want := tools(k.project); events != want {
					t.Errorf("%v: %d tool events applied, want all %d (some skipped as resends?)", k, events, want)
				}
				if got := dumpBuild(t, pool, k); !bytes.Equal(got, alone[k]) {
					t.Errorf("%v interleaved with the other project's build differs from it alone:\n--- alone\n%s\n--- interleaved\n%s",
						k, alone[k], got)
				}
			}
			// The rollups are each project's own, as if the other had not built.
			want := rollupTitle(rollups[0]) + rollupRows(rollups[0]) + rollupRows(rollups[1])
			if got := string(dumpRollups(t, pool)); got != want {
				t.Errorf("rollups:\n got %s\nwant %s", got, want)
			}

			// A redelivery changes nothing.
			d := digest(t, pool)
			applyAll(t, pool, p, msgs, n)
			if again := digest(t, pool); fmt.Sprint(again) != fmt.Sprint(d) {
				t.Errorf("applied twice: digest changed")
			}
		})
	}
}

// rollupTitle and rollupRows split dumpRollups' output into its title line and rows
// (acme sorts before beta, so the rows of the two concatenate in order).
func rollupTitle(b []byte) string {
	i := bytes.IndexByte(b, '\n')
	return string(b[:i+1])
}

func rollupRows(b []byte) string {
	i := bytes.IndexByte(b, '\n')
	return string(b[i+1:])
}
