package console

import (
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/projectors/builds"
)

// How much a build page shows of each part; the rest is a link away.
const (
	pageFailures = 20  // failed targets, and tests that did not pass, at the top
	pageRows     = 100 // targets, and tests, in their tables
	runningTail  = builds.OutputPageBytes
)

// buildView is a build's page: its head (metadata, metrics, command
// lines), its Search row (branch, commit, counts), its failures first,
// a page of its targets and of its tests, a page of its output.
type buildView struct {
	frame
	B        *builds.Build
	S        builds.Summary
	Query    url.Values
	Metadata []metadataItem
	Phases   []phase

	FailedTargets     []builds.Target
	MoreFailedTargets bool
	FailedTests       []builds.Test
	MoreFailedTests   bool

	Targets           []builds.Target
	TargetsFailedOnly bool
	TargetsNext       string
	Tests             []builds.Test
	TestStatus        string
	TestStatuses      []string
	TestsNext         string

	Out       outputView
	OutputRaw string
	// Events is the address of the page's live events, After the last
	// stream sequence the page shows (live.go).
	Events string
	After  uint64
}

type metadataItem struct{ Key, Value, URL string }

// phase is a bar of the timing chart.
type phase struct {
	Name, Class string
	Ms          int64
	X, W        int
}

// outputView is a page of one stream of the build's console output.
type outputView struct {
	Streams     []outputStream
	Stream      string
	Page, Pages int32
	HTML        any
	Error       string
}

type outputStream struct {
	Name  string
	Bytes int64
	Pages int32
}

// wantsHTML: a browser asks for HTML; a script (curl, a CI bot) for
// anything, and gets the JSON the address has always served.
func wantsHTML(r *http.Request) bool {
	return strings.Contains(r.Header.Get("Accept"), "text/html")
}

// build serves a build's address: its page to a browser, its JSON
// document (builds show --json) to everything else.
func build(src Sources) handler {
	return func(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
		if !wantsHTML(r) {
			buildJSON(w, r, p)
			return
		}
		buildPage(w, r, p, src)
	}
}

func buildJSON(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
	// Streamed: the document holds every target and test of the build, and
	// builds.WriteJSON writes them as it reads them.
	w.Header().Set("Content-Type", "application/json")
	err := builds.WriteJSON(r.Context(), p, w, r.PathValue("project"), r.PathValue("id"))
	if errors.Is(err, builds.ErrNotFound) { // nothing written yet
		writeJSON(w, http.StatusNotFound, map[string]string{"error": "no such build"})
		return
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
	}
}

// buildPage reads the page in one snapshot, with the projector's
// position: a running build's live events start right after what the
// page shows (live.go).
func buildPage(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool, src Sources) {
	ctx := r.Context()
	project, id := r.PathValue("project"), r.PathValue("id")
	q := r.URL.Query()
	tx, err := p.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		renderError(w, http.StatusInternalServerError, "Build", err)
		return
	}
	defer tx.Rollback(ctx)
	b, err := builds.Head(ctx, tx, project, id)
	if errors.Is(err, builds.ErrNotFound) {
		renderError(w, http.StatusNotFound, "No such build", fmt.Errorf("project %s has no build %s", project, id))
		return
	}
	if err != nil {
		renderError(w, http.StatusInternalServerError, "Build", err)
		return
	}
	v := buildView{B: b, Query: q, TestStatuses: builds.TestStatuses,
		TargetsFailedOnly: q.Get("targets") == "failed", TestStatus: q.Get("tests_status")}
	v.JSON = "/api/v1" + BuildPath(project, id)
	if v.TestStatus != "" && v.TestStatus != "not-passed" && !slices.Contains(builds.TestStatuses, v.TestStatus) {
		renderError(w, http.StatusBadRequest, "Build", fmt.Errorf("tests_status %q is none of not-passed, %s", v.TestStatus, strings.Join(builds.TestStatuses, ", ")))
		return
	}
	if b.Status == "running" && src.Live != nil {
		if v.After, err = builds.Position(ctx, tx, builds.PositionOf(src.Layout, project, id)); err != nil {
			renderError(w, http.StatusInternalServerError, "Build", err)
			return
		}
		v.Live, v.Events = true, BuildPath(project, id)+"/events"
	}
	if err := v.read(r, tx, src.Archive); err != nil {
		renderError(w, http.StatusInternalServerError, "Build", err)
		return
	}
	render(w, http.StatusOK, "build", v)
}

// read fills the page: each part is one paged read of the builds
// package, so that a build of a million events costs what a small one
// does.
func (v *buildView) read(r *http.Request, p builds.Querier, archive func() builds.Archive) error {
	ctx := r.Context()
	b := v.B
	var err error
	if v.S, err = builds.SummaryOf(ctx, p, b.Project, b.ID); err != nil {
		return err
	}
	for _, k := range slices.Sorted(maps.Keys(b.BuildMetadata)) {
		it := metadataItem{Key: k, Value: b.BuildMetadata[k]}
		if u, err := url.Parse(it.Value); err == nil && (u.Scheme == "https" || u.Scheme == "http") && u.Host != "" {
			it.URL = u.String()
		}
		v.Metadata = append(v.Metadata, it)
	}
	if m := b.Metrics; m != nil {
		v.Phases = phases(m)
	}

	if v.FailedTargets, err = builds.Targets(ctx, p, b.Project, b.ID, builds.PageQuery{Failed: true, Limit: pageFailures + 1}); err != nil {
		return err
	}
	if len(v.FailedTargets) > pageFailures {
		v.FailedTargets, v.MoreFailedTargets = v.FailedTargets[:pageFailures], true
	}
	if v.FailedTests, err = builds.Tests(ctx, p, b.Project, b.ID, builds.PageQuery{NotPassed: true, Limit: pageFailures + 1}); err != nil {
		return err
	}
	if len(v.FailedTests) > pageFailures {
		v.FailedTests, v.MoreFailedTests = v.FailedTests[:pageFailures], true
	}

	tq := builds.PageQuery{After: v.Query.Get("targets_after"), Limit: pageRows + 1, Failed: v.TargetsFailedOnly}
	if v.Targets, err = builds.Targets(ctx, p, b.Project, b.ID, tq); err != nil {
		return err
	}
	if len(v.Targets) > pageRows {
		v.Targets = v.Targets[:pageRows]
		v.TargetsNext = v.Targets[pageRows-1].Label
	}
	sq := builds.PageQuery{After: v.Query.Get("tests_after"), Limit: pageRows + 1}
	if v.TestStatus == "not-passed" {
		sq.NotPassed = true
	} else {
		sq.Status = v.TestStatus
	}
	if v.Tests, err = builds.Tests(ctx, p, b.Project, b.ID, sq); err != nil {
		return err
	}
	if len(v.Tests) > pageRows {
		v.Tests = v.Tests[:pageRows]
		v.TestsNext = v.Tests[pageRows-1].Label
	}
	return v.readOutput(r, p, archive)
}

// readOutput reads the page of output the query asks for (out: stdout
// or stderr, page: from 0), by default the last page of stderr (where
// Bazel prints its progress and the errors), or of stdout when stderr is
// empty. A running build has no pages yet: its page shows the end of
// what it printed so far, and the live events add the rest.
func (v *buildView) readOutput(r *http.Request, p builds.Querier, archive func() builds.Archive) error {
	ctx := r.Context()
	b := v.B
	if b.Status == "running" {
		stdout, stderr, err := builds.Output(ctx, p, b.Project, b.ID)
		if err != nil {
			return err
		}
		out := append(stderr, stdout...)
		if len(out) > runningTail {
			out = out[len(out)-runningTail:]
		}
		v.Out.HTML = ANSI(out)
		return nil
	}
	reader := builds.OutputReader{DB: p}
	if archive != nil {
		reader.Archive = archive()
	}
	sizes, err := reader.Sizes(ctx, b.Project, b.ID)
	if err != nil {
		return err
	}
	for _, s := range []outputStream{{"stderr", sizes.StderrBytes, sizes.StderrPages}, {"stdout", sizes.StdoutBytes, sizes.StdoutPages}} {
		if s.Pages > 0 {
			v.Out.Streams = append(v.Out.Streams, s)
		}
	}
	if len(v.Out.Streams) == 0 {
		return nil
	}
	cur := v.Out.Streams[0]
	if want := v.Query.Get("out"); want != "" {
		i := slices.IndexFunc(v.Out.Streams, func(s outputStream) bool { return s.Name == want })
		if i < 0 {
			v.Out.Error = fmt.Sprintf("out %q: the build printed nothing there; want stderr or stdout", want)
			return nil
		}
		cur = v.Out.Streams[i]
	}
	v.Out.Stream, v.Out.Pages, v.Out.Page = cur.Name, cur.Pages, cur.Pages-1
	if s := v.Query.Get("page"); s != "" {
		n, err := strconv.ParseInt(s, 10, 32)
		if err != nil || n < 0 || int32(n) >= cur.Pages {
			v.Out.Error = fmt.Sprintf("page %q: the %s output has pages 0 to %d", s, cur.Name, cur.Pages-1)
			return nil
		}
		v.Out.Page = int32(n)
	}
	stream := map[string]int16{"stdout": builds.StreamStdout, "stderr": builds.StreamStderr}[cur.Name]
	v.OutputRaw = BuildPath(b.Project, b.ID) + "/output/" + cur.Name + "/" + strconv.Itoa(int(v.Out.Page))
	page, err := reader.Page(ctx, b.Project, b.ID, stream, v.Out.Page)
	if errors.Is(err, builds.ErrNoArchive) {
		v.Out.Error = err.Error()
		return nil
	}
	if err != nil && !errors.Is(err, builds.ErrNotFound) {
		return err
	}
	v.Out.HTML = ANSI(page)
	return nil
}

// phases are the bars of the timing chart, 600 units wide: analysis,
// execution, and the rest of the wall time (loading, and what Bazel does
// around the phases).
func phases(m *builds.Metrics) []phase {
	if m.WallTimeMs <= 0 {
		return nil
	}
	rest := m.WallTimeMs - m.AnalysisPhaseMs - m.ExecutionPhaseMs
	var out []phase
	x := 0
	for _, ph := range []phase{{Name: "loading and other", Class: "ph-o", Ms: rest},
		{Name: "analysis", Class: "ph-a", Ms: m.AnalysisPhaseMs}, {Name: "execution", Class: "ph-e", Ms: m.ExecutionPhaseMs}} {
		if ph.Ms <= 0 {
			continue
		}
		ph.X = x
		ph.W = int(600 * ph.Ms / m.WallTimeMs)
		x += ph.W
		out = append(out, ph)
	}
	return out
}
