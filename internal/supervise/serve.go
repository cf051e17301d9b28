package supervise

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

// Server is a started server: Serve runs until Stop.
type Server interface {
	// Serve serves until Stop; ctx is the component's loop context.
	Serve(ctx context.Context) error
	// Stop stops accepting, lets what is in progress finish until ctx's
	// deadline, then cuts it.
	Stop(ctx context.Context) error
}

// Serve is the component of a server that start makes: start is its
// Start, the server's Serve its loop and the server's Stop its Stop.
func Serve[S Server](name string, start func(ctx context.Context) (S, error)) Component {
	var s S
	return Component{
		Name: name,
		Start: func(ctx context.Context) (err error) {
			s, err = start(ctx)
			return err
		},
		Run:  func(ctx context.Context) error { return s.Serve(ctx) },
		Stop: func(ctx context.Context) error { return s.Stop(ctx) },
	}
}

// GRPCConfig says where and how a gRPC server listens.
type GRPCConfig struct {
	// Addr is the listen address (host:port; port 0 picks one).
	Addr string
	// TLS, when not nil, is the server's TLS configuration; nil serves
	// plaintext (or the credentials Options carry).
	TLS *tls.Config
	// Options are the server's options.
	Options []grpc.ServerOption
	// Listener, when not nil, wraps the listener (a connection cap); an
	// error closes the listener and is NewGRPC's.
	Listener func(net.Listener) (net.Listener, error)
}

// GRPCServer is a gRPC server on a listener of its own. Register services
// on Server before Serve.
type GRPCServer struct {
	Server *grpc.Server
	lis    net.Listener
}

// NewGRPC makes the server and listens.
func NewGRPC(c GRPCConfig) (*GRPCServer, error) {
	opts := c.Options
	if c.TLS != nil {
		opts = append(opts[:len(opts):len(opts)], grpc.Creds(credentials.NewTLS(c.TLS)))
	}
	lis, err := net.Listen("tcp", c.Addr)
	if err != nil {
		return nil, err
	}
	if lis, err = wrap(lis, c.Listener); err != nil {
		return nil, err
	}
	return &GRPCServer{Server: grpc.NewServer(opts...), lis: lis}, nil
}

// Addr is the address it listens on.
func (s *GRPCServer) Addr() net.Addr { return s.lis.Addr() }

// Serve serves until Stop (then it returns nil, also when Stop came
// first).
func (s *GRPCServer) Serve(context.Context) error {
	if err := s.Server.Serve(s.lis); !errors.Is(err, grpc.ErrServerStopped) {
		return err
	}
	return nil
}

// Stop stops gracefully (no new calls, those in progress finish) until
// ctx ends, then cuts what is left; it reports a cut as ctx's error.
func (s *GRPCServer) Stop(ctx context.Context) error {
	done := make(chan struct{})
	go func() { s.Server.GracefulStop(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		s.Server.Stop()
		<-done
		return fmt.Errorf("gRPC calls cut at the deadline: %w", ctx.Err())
	}
}

// HTTPServer is an http.Server on a listener of its own.
type HTTPServer struct {
	Server *http.Server
	lis    net.Listener
}

// NewHTTP listens on addr for srv; wrapper, when not nil, wraps the
// listener (a connection cap).
func NewHTTP(addr string, srv *http.Server, wrapper func(net.Listener) (net.Listener, error)) (*HTTPServer, error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	if lis, err = wrap(lis, wrapper); err != nil {
		return nil, err
	}
	return &HTTPServer{Server: srv, lis: lis}, nil
}

// wrap applies wrapper to lis, closing lis when it fails.
func wrap(lis net.Listener, wrapper func(net.Listener) (net.Listener, error)) (net.Listener, error) {
	if wrapper == nil {
		return lis, nil
	}
	w, err := wrapper(lis)
	if err != nil {
		lis.Close()
		return nil, err
	}
	return w, nil
}

// Addr is the address it listens on.
func (s *HTTPServer) Addr() net.Addr { return s.lis.Addr() }

// Serve serves until Stop (then it returns nil).
func (s *HTTPServer) Serve(context.Context) error {
	if err := s.Server.Serve(s.lis); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// Stop stops accepting and lets requests in progress finish until ctx
// ends, then closes their connections; it reports a cut as ctx's error.
func (s *HTTPServer) Stop(ctx context.Context) error {
	if err := s.Server.Shutdown(ctx); err != nil {
		s.Server.Close()
		return fmt.Errorf("HTTP requests cut at the deadline: %w", err)
	}
	return nil
}
