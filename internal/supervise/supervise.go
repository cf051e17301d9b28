package supervise

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"
)

// DefaultShutdownTimeout bounds a stop when Config.ShutdownTimeout is zero.
const DefaultShutdownTimeout = 20 * time.Second

// Config configures Run.
type Config struct {
	// ShutdownTimeout bounds the whole stop: every Stop, and the wait for
	// every loop to return, share this one deadline. Zero:
	// DefaultShutdownTimeout.
	ShutdownTimeout time.Duration
	// Logger logs starts, stops and failures; nil: slog.Default().
	Logger *slog.Logger
}

// Validate says what is wrong with c.
func (c Config) Validate() error {
	if c.ShutdownTimeout < 0 {
		return fmt.Errorf("supervise: shutdown timeout %v is negative", c.ShutdownTimeout)
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = DefaultShutdownTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Component is one part of a process. Every function is optional.
type Component struct {
	// Name names it in the log.
	Name string
	// Start brings it up and returns once it serves; ctx ends at the
	// signal (anything Start leaves running on ctx, such as a key file
	// watcher, ends then).
	Start func(ctx context.Context) error
	// Run is its loop, started on a goroutine once Start returned. Its
	// ctx ends when the component is stopped (after Stop returned). A loop
	// that returns before that stops the process, with its error.
	Run func(ctx context.Context) error
	// Stop stops it, gracefully until ctx's deadline (shared by the whole
	// stop), then at once. A Stop error is logged.
	Stop func(ctx context.Context) error
}

// running is a started component.
type running struct {
	c      Component
	cancel context.CancelFunc
	done   chan struct{} // closed when Run returned (nil: no Run)
	err    error         // Run's, once done is closed
	// reported: wait logged the loop's end and made its error Run's.
	reported bool
}

// Run starts components in order, waits until ctx ends or a loop ends by
// itself, and stops the started components in reverse order. It returns
// the first failure: a Start's error, or the error of a loop that ended by
// itself.
func Run(ctx context.Context, cfg Config, components ...Component) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	cfg = cfg.withDefaults()
	log := cfg.Logger
	ended := make(chan *running, len(components))
	var started []*running
	failure := start(ctx, log, components, ended, &started)
	if failure == nil && len(started) == len(components) {
		failure = wait(ctx, log, ended)
	}
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.ShutdownTimeout)
	defer cancel()
	for i := len(started) - 1; i >= 0; i-- {
		stop(sctx, log, started[i])
	}
	return failure
}

// start starts components in order until one fails or ctx ends.
func start(ctx context.Context, log *slog.Logger, components []Component, ended chan<- *running, started *[]*running) error {
	for _, c := range components {
		if ctx.Err() != nil {
			return nil
		}
		if c.Start != nil {
			if err := c.Start(ctx); err != nil {
				if ctx.Err() != nil {
					log.Debug("start cut short by the stop", "component", c.Name, "err", err)
					return nil
				}
				log.Error("start failed", "component", c.Name, "err", err)
				return err
			}
		}
		r := &running{c: c}
		*started = append(*started, r)
		if c.Run != nil {
			rctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
			r.cancel, r.done = cancel, make(chan struct{})
			go func() {
				r.err = c.Run(rctx)
				close(r.done)
				ended <- r
			}()
		}
		log.Debug("started", "component", c.Name)
	}
	return nil
}

// wait returns when ctx ends (nil) or a loop ends by itself (its error).
func wait(ctx context.Context, log *slog.Logger, ended <-chan *running) error {
	select {
	case <-ctx.Done():
		return nil
	case r := <-ended:
		r.reported = true
		if r.err != nil {
			log.Error("stopped by itself", "component", r.c.Name, "err", r.err)
		} else {
			log.Info("stopped by itself", "component", r.c.Name)
		}
		return r.err
	}
}

// stop stops r: its Stop, then the end of its loop's context, then the
// wait for the loop, all before ctx's deadline.
func stop(ctx context.Context, log *slog.Logger, r *running) {
	ended := false // the loop ended before the stop
	if r.done != nil {
		select {
		case <-r.done:
			ended = true
		default:
		}
	}
	if r.c.Stop != nil {
		if err := r.c.Stop(ctx); err != nil {
			log.Warn("stop", "component", r.c.Name, "err", err)
		}
	}
	if r.done != nil && !ended {
		r.cancel()
		select {
		case <-r.done:
		case <-ctx.Done():
			log.Error("did not stop within the shutdown timeout; going on without it", "component", r.c.Name)
			return
		}
	}
	if r.done != nil && !r.reported && r.err != nil && !errors.Is(r.err, context.Canceled) {
		log.Warn("stopped", "component", r.c.Name, "err", r.err)
		return
	}
	log.Debug("stopped", "component", r.c.Name)
}
