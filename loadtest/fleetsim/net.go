package fleetsim

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"syscall"

	"github.com/millrace/millrace/internal/envflag"
)

// nodesPerLocalAddr is how many nodes "auto" puts on one source address.
// Loopback connections to one gateway address can use every ephemeral
// port (28,000 here), but a reconnect storm briefly needs two per node
// (the closing connection sits in TIME_WAIT), so spreading keeps well
// clear of the range.
const nodesPerLocalAddr = 5000

// localIPs returns the source addresses to spread the nodes over; nil
// means the kernel's choice.
func (c Config) localIPs() ([]net.IP, error) {
	s := strings.TrimSpace(c.LocalAddrs)
	switch {
	case s == "" || s == "auto":
		if !allLoopback(c.Gateways) {
			return nil, nil
		}
		n := (c.Nodes + nodesPerLocalAddr - 1) / nodesPerLocalAddr
		if n <= 1 {
			return nil, nil
		}
		return loopbackIPs(min(n, 254)), nil
	}
	if n, err := strconv.Atoi(s); err == nil {
		if n < 1 || n > 254 {
			return nil, fmt.Errorf("local-addrs %d: want 1..254", n)
		}
		if n == 1 {
			return nil, nil
		}
		return loopbackIPs(n), nil
	}
	var ips []net.IP
	for _, p := range envflag.SplitList(s) {
		ip := net.ParseIP(p)
		if ip == nil {
			return nil, fmt.Errorf("local-addrs: %q is not an IP address", p)
		}
		ips = append(ips, ip)
	}
	return ips, nil
}

func loopbackIPs(n int) []net.IP {
	ips := make([]net.IP, n)
	for i := range ips {
		ips[i] = net.IPv4(127, 0, 0, byte(i+1))
	}
	return ips
}

func allLoopback(addrs []string) bool {
	for _, a := range addrs {
		h, _, err := net.SplitHostPort(a)
		if err != nil {
			return false
		}
		if h == "localhost" {
			continue
		}
		ip := net.ParseIP(h)
		if ip == nil || !ip.IsLoopback() || ip.To4() == nil {
			return false
		}
	}
	return true
}

// ipBindAddressNoPort is IP_BIND_ADDRESS_NO_PORT (linux/in.h): bind the
// source address now, pick the port at connect time, so that the port need
// only be unique per destination, not per source address.
const ipBindAddressNoPort = 24

// dialer returns a dial function that connects from ip.
func dialer(ip net.IP) func(ctx context.Context, addr string) (net.Conn, error) {
	d := &net.Dialer{
		LocalAddr: &net.TCPAddr{IP: ip},
		Control: func(_, _ string, c syscall.RawConn) error {
			var serr error
			err := c.Control(func(fd uintptr) {
				serr = syscall.SetsockoptInt(int(fd), syscall.IPPROTO_IP, ipBindAddressNoPort, 1)
			})
			if err != nil {
				return err
			}
			_ = serr // an old kernel without it still works, with fewer ports
			return nil
		},
	}
	return func(ctx context.Context, addr string) (net.Conn, error) {
		return d.DialContext(ctx, "tcp", addr)
	}
}

// fdReserve is the descriptors a run needs besides one per node: stdio,
// NATS, the database pool, the Reservations connection, concurrent Joins,
// the Go runtime's own, and slack.
func fdReserve(c Config) int {
	r := 64 + c.Nodes/100
	if c.JoinToken != "" || c.JoinTokensFile != "" {
		r += c.JoinConcurrency
	}
	return r
}

// checkFiles raises the soft open-files limit to the hard one (Go does this
// at start already) and refuses a run that cannot fit in it.
func checkFiles(c Config) (limit uint64, err error) {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return 0, nil // cannot tell: let the run find out
	}
	if lim.Cur < lim.Max {
		lim.Cur = lim.Max
		_ = syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim)
		_ = syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim)
	}
	need := uint64(c.Nodes + fdReserve(c))
	if need > lim.Cur {
		fit := int(lim.Cur) - 64
		if c.JoinToken != "" || c.JoinTokensFile != "" {
			fit -= c.JoinConcurrency
		}
		fit = fit * 100 / 101
		return lim.Cur, fmt.Errorf("%d nodes need about %d open files (one connection each, plus %d for the rest), but this process may open %d (RLIMIT_NOFILE, hard limit %d): "+
			"run at most %d nodes per process and split the fleet across processes with --first-node, or raise the hard limit (ulimit -Hn, systemd LimitNOFILE)",
			c.Nodes, need, fdReserve(c), lim.Cur, lim.Max, max(0, fit))
	}
	return lim.Cur, nil
}
