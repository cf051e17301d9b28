package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// clockTicks is USER_HZ, the unit of /proc/<pid>/stat times: 100 on every
// Linux the bench runs on (it is fixed by the kernel's ABI, not by HZ).
const clockTicks = 100

// proc is a child process the bench started and will stop.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
	err  error // valid after done is closed
}

// startProc runs bin with args and env (added to a clean copy of the
// bench's environment), its output going to logPath.
func startProc(name, bin string, args, env []string, logPath string) (*proc, error) {
	f, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = append(cleanEnv(), env...)
	cmd.Stdout, cmd.Stderr = f, f
	// If the bench dies, its children die with it instead of holding ports.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		f.Close()
		close(p.done)
	}()
	return p, nil
}

// cleanEnv is the bench's environment without millrace's settings, so that
// a variable exported in the caller's shell cannot change a scenario.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "MILLRACE_") || strings.HasPrefix(kv, "DATABASE_URL=") || strings.HasPrefix(kv, "RETENTION_RAW_DAYS=") {
			continue
		}
		env = append(env, kv)
	}
	return env
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// cpu is the process's user + system CPU time so far.
func (p *proc) cpu() (time.Duration, error) {
	t, err := readCPU(p.pid())
	if err != nil {
		return 0, fmt.Errorf("%s: %w", p.name, err)
	}
	return t.self(), nil
}

// stop sends SIGTERM, waits up to grace, then kills.
func (p *proc) stop(grace time.Duration) error {
	if p.exited() {
		return p.exitErr()
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return p.exitErr()
	case <-time.After(grace):
		p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("%s did not stop within %s after SIGTERM; killed", p.name, grace)
	}
}

func (p *proc) exitErr() error {
	if p.err != nil {
		return fmt.Errorf("%s: %w (log: %s)\n%s", p.name, p.err, p.log, p.tail(15))
	}
	return nil
}

// tail returns the last n lines of the process's log.
func (p *proc) tail(n int) string {
	b, err := os.ReadFile(p.log)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return "    " + strings.Join(lines, "\n    ")
}

// waitReady polls url until it answers 200, the process exits, or timeout.
func waitReady(ctx context.Context, p *proc, url string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	client := &http.Client{Timeout: time.Second}
	for {
		resp, err := client.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if p.exited() {
			return fmt.Errorf("%s exited before it was ready: %v (log: %s)\n%s", p.name, p.err, p.log, p.tail(15))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready at %s after %s (log: %s)\n%s", p.name, url, timeout, p.log, p.tail(15))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// freeAddr returns 127.0.0.1:<a port that was free a moment ago>.
func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// cpuTimes are one process's times from /proc/<pid>/stat.
type cpuTimes struct {
	comm                         string
	ppid                         int
	utime, stime, cutime, cstime int64 // clock ticks
}

func (t cpuTimes) self() time.Duration {
	return time.Duration(t.utime+t.stime) * time.Second / clockTicks
}

func (t cpuTimes) children() time.Duration {
	return time.Duration(t.cutime+t.cstime) * time.Second / clockTicks
}

func readCPU(pid int) (cpuTimes, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return cpuTimes{}, err
	}
	return parseStat(b)
}

// parseStat reads the fields of /proc/<pid>/stat that the bench needs
// (proc(5)): comm is in parentheses and may hold spaces, so fields are
// counted from the last ')'.
func parseStat(b []byte) (cpuTimes, error) {
	open, end := bytes.IndexByte(b, '('), bytes.LastIndexByte(b, ')')
	if open < 0 || end < open {
		return cpuTimes{}, errors.New("malformed /proc stat")
	}
	f := strings.Fields(string(b[end+1:]))
	// f[0] is field 3 (state): field k is f[k-3].
	if len(f) < 15 {
		return cpuTimes{}, errors.New("short /proc stat")
	}
	n := func(k int) int64 { v, _ := strconv.ParseInt(f[k-3], 10, 64); return v }
	return cpuTimes{
		comm:   string(b[open+1 : end]),
		ppid:   int(n(4)),
		utime:  n(14),
		stime:  n(15),
		cutime: n(16),
		cstime: n(17),
	}, nil
}

// ctxSwitches is the number of context switches (voluntary and not) of all
// of a process's live threads: how often it slept and woke, which is what
// per-event work costs when events arrive one at a time.
func ctxSwitches(pid int) int64 {
	dir := "/proc/" + strconv.Itoa(pid) + "/task"
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0
	}
	var n int64
	for _, e := range ents {
		b, err := os.ReadFile(dir + "/" + e.Name() + "/status")
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.HasSuffix(k, "ctxt_switches") {
				c, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
				n += c
			}
		}
	}
	return n
}

// machineCPU is the whole machine's CPU time from /proc/stat, to tell how
// busy the machine was besides the processes measured.
type machineCPU struct{ busy, steal, total time.Duration }

func readMachineCPU() machineCPU {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return machineCPU{}
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal ...
	var v [8]int64
	for i := 0; i < 8 && i+1 < len(f); i++ {
		v[i], _ = strconv.ParseInt(f[i+1], 10, 64)
	}
	tick := func(n int64) time.Duration { return time.Duration(n) * time.Second / clockTicks }
	busy := v[0] + v[1] + v[2] + v[5] + v[6]
	return machineCPU{busy: tick(busy), steal: tick(v[7]), total: tick(busy + v[3] + v[4] + v[7])}
}

func (m machineCPU) sub(o machineCPU) machineCPU {
	return machineCPU{busy: m.busy - o.busy, steal: m.steal - o.steal, total: m.total - o.total}
}

// mkdir makes a directory for one scenario's state and logs.
func mkdir(parent, name string) (string, error) {
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return "", err
	}
	return os.MkdirTemp(parent, name+"-")
}

func pathIn(dir, name string) string { return filepath.Join(dir, name) }
