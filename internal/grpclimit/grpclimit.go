// Package grpclimit holds the options every millrace gRPC server is built
// with, so that each edge bounds what one client connection can hold in
// the same way: streams per connection, a deadline for the TLS handshake,
// and keepalive both ways (the server finds peers that vanished; a client
// that pings too often is cut off instead of costing a write per ping).
package grpclimit

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"

	"github.com/millrace/millrace/internal/knob"
)

// Config of the options. A zero field takes its default; a negative
// duration is an error of ServerOptions.
type Config struct {
	// MaxStreamsPerConn is advertised to clients as HTTP/2's
	// SETTINGS_MAX_CONCURRENT_STREAMS: a client waits for a stream to end
	// before it opens one more; one that does not is refused at the
	// transport. Default DefaultMaxStreamsPerConn.
	MaxStreamsPerConn uint32
	// HandshakeTimeout bounds a new connection's handshake (TLS and
	// HTTP/2 preface): a client that connects and stays silent is closed.
	// Default DefaultHandshakeTimeout.
	HandshakeTimeout time.Duration
	// KeepaliveTime is how long a connection may be idle before the server
	// pings it; a peer that does not answer within 20 s is closed.
	// Default DefaultKeepaliveTime.
	KeepaliveTime time.Duration
}

// Defaults.
const (
	DefaultMaxStreamsPerConn = 100
	DefaultHandshakeTimeout  = 10 * time.Second
	DefaultKeepaliveTime     = time.Minute
	// A client may ping at most this often, streams open or not; more often
	// is abuse (each ping costs the server a write) and ends the connection.
	minPingInterval = 10 * time.Second
)

// Validate reports a negative duration.
func (c Config) Validate() error {
	return errors.Join(
		knob.NotNegative("grpclimit", "HandshakeTimeout", c.HandshakeTimeout, DefaultHandshakeTimeout),
		knob.NotNegative("grpclimit", "KeepaliveTime", c.KeepaliveTime, DefaultKeepaliveTime),
	)
}

func (c Config) withDefaults() Config {
	if c.MaxStreamsPerConn == 0 {
		c.MaxStreamsPerConn = DefaultMaxStreamsPerConn
	}
	if c.HandshakeTimeout == 0 {
		c.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if c.KeepaliveTime == 0 {
		c.KeepaliveTime = DefaultKeepaliveTime
	}
	return c
}

// ServerOptions returns the options for c, or what is wrong with c.
func ServerOptions(c Config) ([]grpc.ServerOption, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	c = c.withDefaults()
	return []grpc.ServerOption{
		grpc.MaxConcurrentStreams(c.MaxStreamsPerConn),
		grpc.ConnectionTimeout(c.HandshakeTimeout),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: c.KeepaliveTime, Timeout: 20 * time.Second}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: minPingInterval, PermitWithoutStream: true}),
	}, nil
}

// ReadMaxStreams dials addr (plaintext) and returns the
// SETTINGS_MAX_CONCURRENT_STREAMS its HTTP/2 server advertises, speaking
// just enough HTTP/2 to read the first SETTINGS frame. It is for tests and
// diagnostics: what a client is told is what bounds it.
func ReadMaxStreams(addr string) (uint32, error) {
	c, err := net.DialTimeout("tcp", addr, 10*time.Second)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	// The client preface and an empty SETTINGS frame.
	if _, err := c.Write(append([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), 0, 0, 0, 4, 0, 0, 0, 0, 0)); err != nil {
		return 0, err
	}
	for {
		var h [9]byte
		if _, err := io.ReadFull(c, h[:]); err != nil {
			return 0, err
		}
		payload := make([]byte, int(h[0])<<16|int(h[1])<<8|int(h[2]))
		if _, err := io.ReadFull(c, payload); err != nil {
			return 0, err
		}
		if h[3] != 4 || h[4]&1 != 0 { // not SETTINGS, or a SETTINGS ack
			continue
		}
		for i := 0; i+6 <= len(payload); i += 6 {
			if binary.BigEndian.Uint16(payload[i:]) == 3 { // SETTINGS_MAX_CONCURRENT_STREAMS
				return binary.BigEndian.Uint32(payload[i+2:]), nil
			}
		}
		return 0, errors.New("the server's SETTINGS name no MAX_CONCURRENT_STREAMS (unlimited)")
	}
}
