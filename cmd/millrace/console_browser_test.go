package main

import (
	"context"
	"encoding/base64"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"

	"github.com/millrace/millrace/internal/testenv"
)

// needChromium is Debian's headless Chromium (scripts/deps.sh installs it
// for make test).
func needChromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Skip("SKIPPED: NO CHROMIUM ON PATH -- the console's browser tests did not run. " +
		"Install it with `apt-get install chromium` (make test does so as root).")
	return ""
}

// browser is a headless Chromium driven by chromedp, with the flags a
// closed network needs (no background dialling). Each page it shows is
// kept as a screenshot, written out when the test fails.
type browser struct {
	t     *testing.T
	ctx   context.Context
	base  string
	shots map[string][]byte
}

func newBrowser(t *testing.T, exe, base string) *browser {
	t.Helper()
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(exe), chromedp.Headless, chromedp.NoSandbox, chromedp.DisableGPU, chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck, chromedp.UserDataDir(t.TempDir()), chromedp.WindowSize(1280, 1600),
		chromedp.Flag("disable-quic", true), chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true), chromedp.Flag("disable-sync", true),
	}
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(actx)
	b := &browser{t: t, ctx: ctx, base: base, shots: map[string][]byte{}}
	t.Cleanup(func() {
		if t.Failed() {
			dir, err := os.MkdirTemp("", "millrace-console-shots-")
			if err == nil {
				for name, png := range b.shots {
					os.WriteFile(filepath.Join(dir, name+".png"), png, 0o644)
				}
				t.Logf("screenshots of the console's pages: %s", dir)
			}
		}
		cancel()
		cancelAlloc()
	})
	if err := chromedp.Do(ctx); err != nil { // starts the browser
		t.Fatalf("chromium: %v", err)
	}
	return b
}

// as makes every request of the browser carry key (HTTP basic auth, as a
// browser asked for a password would).
func (b *browser) as(key string) {
	b.t.Helper()
	auth := "Basic " + base64.StdEncoding.EncodeToString([]byte("me:"+key))
	if _, err := chromedp.Call(b.ctx, network.Enable, network.EnableParams{}); err != nil {
		b.t.Fatal(err)
	}
	if _, err := chromedp.Call(b.ctx, network.SetExtraHTTPHeaders, network.SetExtraHTTPHeadersParams{Headers: network.Headers{"Authorization": auth}}); err != nil {
		b.t.Fatal(err)
	}
}

// open shows path, waits for its main element, and keeps a screenshot.
func (b *browser) open(name, path string) {
	b.t.Helper()
	if err := chromedp.Do(b.ctx, chromedp.Navigate(b.base+path), chromedp.WaitReady(chromedp.CSS("main"))); err != nil {
		b.t.Fatalf("open %s: %v", path, err)
	}
	b.shot(name)
}

func (b *browser) shot(name string) {
	if png, err := chromedp.Run(b.ctx, chromedp.FullScreenshot(100)); err == nil { // 100: PNG
		b.shots[name] = png
	}
}

// eval is the value of a JavaScript expression in the page.
func eval[T any](b *browser, expr string) (T, error) {
	return chromedp.Run(b.ctx, chromedp.Evaluate[T](expr))
}

// value is eval's value, its zero on an error.
func value[T any](b *browser, expr string) T {
	v, _ := eval[T](b, expr)
	return v
}

// text is the page's text.
func (b *browser) text() string {
	return value[string](b, `document.body ? document.body.innerText : ""`)
}

// until polls cond in the page (a JavaScript expression) until it is
// true; name's screenshot is taken either way.
func (b *browser) until(name, what, cond string, within time.Duration) {
	b.t.Helper()
	deadline := time.Now().Add(within)
	for {
		if ok, err := eval[bool](b, cond); err == nil && ok {
			b.shot(name)
			return
		}
		if time.Now().After(deadline) {
			b.shot(name)
			b.t.Fatalf("timed out after %s waiting until %s (%s); the page says:\n%s", within, what, cond, b.text())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

const gateBuild = `sh_test(name = "gate", srcs = ["gate.sh"], timeout = "long")
`

// gate.sh holds the build until the test lets it go: the live page is
// watched while Bazel runs, however fast the machine.
const gateScript = `#!/bin/sh
i=0
while [ ! -e "$MILLRACE_GATE" ] && [ $i -lt 1800 ]; do sleep 0.1; i=$((i+1)); done
echo "the gate opened"
`

// TestConsoleInBrowser: real Bazel builds through `millrace dev`, read in
// headless Chromium with scoped console keys. While Bazel runs, the
// build's page follows it (targets, tests and output arrive, the
// connection is dropped every second and resumes where it was), then
// reloads as the build is stored: failed, its failures first, its flaky
// test FLAKY. The list's filters find it; the test's history after a
// second build shows both runs; the flaky tests page ranks it; another
// project's key sees none of it.
func TestConsoleInBrowser(t *testing.T) {
	needBazel(t)
	exe := needChromium(t)
	db := testenv.Database(t)
	dev := newDev(t, db)
	dir := t.TempDir()
	const (
		operator = "console-operator-key-0123"
		e2eKey   = "console-e2e-read-key-0123"
		otherKey = "console-other-read-key-0123"
	)
	keys := filepath.Join(dir, "console-keys")
	if err := os.WriteFile(keys, []byte(operator+"\ne2e="+e2eKey+"\nother="+otherKey+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	dev.env = append(dev.env, "MILLRACE_HTTP_CONSOLE_KEYS_FILE="+keys, "MILLRACE_CONSOLE_LIVE_FOR=1s")
	dev.start()
	var addr string
	waitUntil(t, "the HTTP server's address in the log", func() bool {
		m := regexp.MustCompile(`msg="HTTP serving".*addr=(\S+)`).FindStringSubmatch(dev.output())
		if m != nil {
			addr = m[1]
		}
		return m != nil
	})
	base := "http://" + addr

	run := newBazelRun(t, 20, dev.besAddr)
	gate := filepath.Join(dir, "gate-open")
	if err := os.MkdirAll(filepath.Join(run.exp.Workspace, "gate"), 0o755); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(run.exp.Workspace, "gate", "BUILD"), []byte(gateBuild), 0o644)
	os.WriteFile(filepath.Join(run.exp.Workspace, "gate", "gate.sh"), []byte(gateScript), 0o755)
	run.opt.Extra = append(run.opt.Extra, "--test_env=MILLRACE_GATE="+gate, "--strategy=TestRunner=standalone")
	var flaky string
	for label, status := range run.exp.Tests {
		if status == "FLAKY" {
			flaky = label
		}
	}
	if flaky == "" {
		t.Fatalf("the workspace has no flaky test: %v", run.exp.Tests)
	}

	b := newBrowser(t, exe, base)
	b.as(e2eKey)
	wait := run.start(t)
	finished := false
	defer func() {
		if !finished { // let Bazel go whatever happened
			os.WriteFile(gate, nil, 0o644)
			wait()
		}
	}()
	page := "/builds/e2e/" + run.invocationID
	waitUntil(t, "the build's first events projected", func() bool {
		req, _ := http.NewRequest("GET", base+"/api/v1"+page, nil)
		req.SetBasicAuth("me", operator)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})

	// The running build's page follows it.
	b.open("running", page)
	b.until("live", "the page is live", `document.getElementById("live") !== null && document.getElementById("live").className === "on"`, 30*time.Second)
	first := value[string](b, `document.getElementById("live").dataset.last`)
	b.until("live-rows", "completed targets and test results arrive while Bazel runs, over several connections",
		`(function(){ var l = document.getElementById("live");
		   return parseInt(l.dataset.opens, 10) >= 3 && parseInt(l.dataset.applied, 10) > 0 &&
		          document.querySelectorAll("#targets-table tr[data-label]").length > 0 &&
		          document.querySelectorAll("#tests-table tr[data-label]").length > 0 &&
		          document.getElementById("log").textContent.length > 0; })()`, 3*time.Minute)
	last := value[string](b, `document.getElementById("live").dataset.last`)
	opens := value[int](b, `parseInt(document.getElementById("live").dataset.opens, 10)`)
	if !seqAfter(last, first) {
		t.Errorf("after %d connections the page is at stream sequence %s, from %s: it did not go on from where it was", opens, last, first)
	}
	if !strings.Contains(b.text(), "running") {
		t.Errorf("the running page does not say it is running:\n%s", b.text())
	}

	// Bazel goes on and ends; the page reloads as the build is stored.
	if err := os.WriteFile(gate, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	code, out := wait()
	finished = true
	if code == 0 {
		t.Fatalf("bazel succeeded on a workspace with failures:\n%s", out)
	}
	b.until("finished", "the page reloads as the stored build", `document.getElementById("live") === null &&
		document.getElementById("status").textContent === "failed"`, 2*time.Minute)
	text := b.text()
	for _, want := range []string{"Failures", "FLAKY", flaky, "Finished", "e2e"} {
		if !strings.Contains(text, want) {
			t.Errorf("no %q on the finished build's page:\n%s", want, text)
		}
	}
	flakyRow := value[string](b, fmt.Sprintf(`(function(){ var r = [...document.querySelectorAll("#tests-table tr")].find(r => r.dataset.label === %q);
		return r ? r.innerText : ""; })()`, flaky))
	if !strings.Contains(flakyRow, "FLAKY") || !strings.Contains(flakyRow, "2") {
		t.Errorf("the flaky test's row: %q", flakyRow)
	}
	// Bazel's critical path: its length and its steps, a test's among them.
	if steps := value[string](b, `(function(){ var t = document.getElementById("critical-steps"); return t ? t.innerText : ""; })()`); !strings.Contains(steps, "Testing //") ||
		!strings.Contains(text, "critical path") {
		t.Errorf("the critical path's steps: %q", steps)
	}

	// The list's filters, through its form.
	b.open("list", "/")
	if err := chromedp.Do(b.ctx, chromedp.SetValue(chromedp.CSS(`input[name="project"]`), "e2e"),
		chromedp.SetValue(chromedp.CSS(`select[name="status"]`), "failed"), chromedp.Submit(chromedp.CSS(`form.filters`))); err != nil {
		t.Fatal(err)
	}
	b.until("list-failed", "the filtered list", `window.location.search.indexOf("status=failed") >= 0 && document.getElementById("builds") !== null`, 30*time.Second)
	url := value[string](b, `window.location.search`)
	if !strings.Contains(url, "status=failed") || !strings.Contains(url, "project=e2e") || !strings.Contains(b.text(), run.invocationID[:8]) {
		t.Errorf("the failed builds of e2e (%s) lack the build:\n%s", url, b.text())
	}
	b.open("list-succeeded", "/?project=e2e&status=succeeded")
	if strings.Contains(b.text(), run.invocationID[:8]) {
		t.Errorf("the build is listed among those that succeeded")
	}

	// A second build of the same workspace: the test's history has both.
	second := *run
	second.invocationID = strings.Replace(run.invocationID, run.invocationID[:8], "5ec0d000", 1)
	second.opt.InvocationID = second.invocationID
	second.opt.JSONFile = filepath.Join(dir, "second.json")
	second.opt.Extra = append(second.opt.Extra, "--nocache_test_results")
	if code, out := second.start(t)(); code == 0 {
		t.Fatalf("the second build succeeded:\n%s", out)
	}
	b.open("second", "/builds/e2e/"+second.invocationID)
	b.until("second-finished", "the second build stored", `document.getElementById("status") !== null &&
		document.getElementById("status").textContent === "failed" && document.getElementById("live") === null`, 2*time.Minute)
	b.open("history", "/test?project=e2e&label="+queryEscape(flaky))
	text = b.text()
	counted := value[string](b, `document.querySelector("#stats div").firstChild.textContent`)
	if counted != "2" {
		t.Errorf("the flaky test's history counts %q runs, want 2:\n%s", counted, text)
	}
	runs := value[int](b, `document.querySelectorAll("#runs tbody tr").length`)
	if runs != 2 || strings.Count(text, "FLAKY") < 2 {
		t.Errorf("the history has %d runs, want both builds' FLAKY runs:\n%s", runs, text)
	}
	b.open("flaky", "/flaky?project=e2e")
	if !strings.Contains(b.text(), flaky) {
		t.Errorf("the flaky tests page does not rank %s:\n%s", flaky, b.text())
	}

	// Another project's key sees none of it.
	b.as(otherKey)
	b.open("other-build", page)
	if text := b.text(); !strings.Contains(text, "No such build") || strings.Contains(text, "FLAKY") {
		t.Errorf("another project's key on the build's page:\n%s", text)
	}
	b.open("other-list", "/")
	if strings.Contains(b.text(), run.invocationID[:8]) {
		t.Errorf("another project's key lists the build:\n%s", b.text())
	}
	b.open("other-history", "/test?project=e2e&label="+queryEscape(flaky))
	if strings.Contains(b.text(), "FLAKY") {
		t.Errorf("another project's key reads the test's history:\n%s", b.text())
	}
}

// seqAfter: stream sequence a is after b (both decimal).
func seqAfter(a, b string) bool {
	var x, y uint64
	fmt.Sscan(a, &x)
	fmt.Sscan(b, &y)
	return x > y
}

func queryEscape(s string) string {
	return strings.NewReplacer("/", "%2F", ":", "%3A").Replace(s)
}
