package commitsload

import (
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// selfCPU is this process's user + system CPU time so far: the load
// generator, and during the fold the compactor it runs.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(syscall.TimevalToNsec(ru.Utime) + syscall.TimevalToNsec(ru.Stime))
}

func selfMaxRSSKiB() int64 {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return ru.Maxrss // KiB on Linux
}

// procCPU returns a process's user + system CPU time (/proc/<pid>/stat,
// fields 14 and 15, counted after the ')' that ends the command name).
func procCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0, fmt.Errorf("pid %d: malformed stat", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("pid %d: short stat", pid)
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	s, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+s) * time.Second / 100, nil // USER_HZ
}

// procMeter measures the CPU time of named processes over phases.
type procMeter struct {
	procs []*Process
	start []time.Duration
	last  []time.Duration
}

func newProcMeter(pids map[string]int) (*procMeter, error) {
	m := &procMeter{}
	names := make([]string, 0, len(pids))
	for n := range pids {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		t, err := procCPU(pids[n])
		if err != nil {
			return nil, fmt.Errorf("process %s (pid %d): %w", n, pids[n], err)
		}
		m.procs = append(m.procs, &Process{Name: n, PID: pids[n]})
		m.start = append(m.start, t)
		m.last = append(m.last, t)
	}
	return m, nil
}

// begin starts a phase.
func (m *procMeter) begin() {
	for i, p := range m.procs {
		if t, err := procCPU(p.PID); err == nil {
			m.start[i] = t
		} else {
			p.Gone = true
			m.start[i] = m.last[i]
		}
	}
}

// end closes the phase and stores its CPU time with set.
func (m *procMeter) end(set func(p *Process, cpu float64)) {
	for i, p := range m.procs {
		t, err := procCPU(p.PID)
		if err != nil {
			p.Gone = true
			t = m.start[i]
		}
		m.last[i] = t
		set(p, round((t-m.start[i]).Seconds(), 2))
	}
}

func (m *procMeter) report() []Process {
	out := make([]Process, len(m.procs))
	for i, p := range m.procs {
		out[i] = *p
	}
	return out
}
