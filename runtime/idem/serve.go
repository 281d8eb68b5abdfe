package idem

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync/atomic"
	"time"
)

// Defaults for ServeConfig fields left zero.
const (
	DefaultDrain         = 10 * time.Second
	DefaultNotReadyDelay = 5 * time.Second
)

// Readiness is a readiness probe handler: 200 while the process should get
// traffic, 503 once shutdown has begun. Mount it where your orchestrator
// probes (mux.Handle("GET /readyz", ready)) and pass it to ServeHTTP.
type Readiness struct{ draining atomic.Bool }

// ServeHTTP answers the probe.
func (r *Readiness) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	if r.draining.Load() {
		http.Error(w, "shutting down", http.StatusServiceUnavailable)
		return
	}
	_, _ = w.Write([]byte("ok\n"))
}

// Draining reports whether shutdown has begun.
func (r *Readiness) Draining() bool { return r.draining.Load() }

// ServeConfig configures ServeHTTP's shutdown. Zero fields mean the
// documented defaults.
type ServeConfig struct {
	// Ready, if not nil, turns 503 when shutdown begins.
	Ready *Readiness
	// NotReadyDelay is how long ServeHTTP keeps serving, with Ready
	// answering 503, before it closes the listener (0:
	// DefaultNotReadyDelay, 5s). A load balancer needs a few probe periods
	// to see the 503 and stop sending traffic; closing at once would make it
	// send requests to a closed port meanwhile. Used only with Ready.
	NotReadyDelay time.Duration
	// NoNotReadyDelay closes the listener as soon as Ready turns 503.
	NoNotReadyDelay bool
	// Drain is how long requests in progress may finish once the listener is
	// closed (0: DefaultDrain, 10s); then their contexts are cancelled.
	Drain time.Duration
}

// ServeHTTP runs srv on ln until ctx is cancelled (typically by SIGTERM via
// signal.NotifyContext), then shuts down gracefully: it turns cfg.Ready (if
// not nil) to 503 and keeps serving for cfg.NotReadyDelay, so probes see it
// failing while the port still answers; then it stops accepting, lets
// requests in progress finish for up to cfg.Drain, and then cancels the
// contexts of the requests still running. Their transactions roll back and
// store nothing, so the clients' retries (to this or another replica) are
// safe.
//
// ServeHTTP sets srv.BaseContext; it returns nil after a clean shutdown.
func ServeHTTP(ctx context.Context, srv *http.Server, ln net.Listener, cfg ServeConfig) error {
	drain, delay, err := cfg.durations()
	if err != nil {
		return err
	}
	base, cancelRequests := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelRequests()
	srv.BaseContext = func(net.Listener) context.Context { return base }

	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()

	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	if cfg.Ready != nil {
		cfg.Ready.draining.Store(true)
		// New connections from here on should go elsewhere: answer with
		// Connection: close rather than keep clients on this replica.
		srv.SetKeepAlivesEnabled(false)
		t := time.NewTimer(delay)
		select {
		case <-t.C:
		case err := <-served:
			t.Stop()
			return err
		}
	}
	drainCtx, cancelDrain := context.WithTimeout(context.Background(), drain)
	defer cancelDrain()
	err = srv.Shutdown(drainCtx)
	if errors.Is(err, context.DeadlineExceeded) {
		// Past the drain deadline: cancel what is left, so it rolls back
		// instead of being cut off at an arbitrary instruction by the exit.
		cancelRequests()
		err = srv.Close()
	}
	if serveErr := <-served; !errors.Is(serveErr, http.ErrServerClosed) {
		return serveErr
	}
	return err
}

// durations validates cfg and returns its drain and not-ready delay.
func (cfg ServeConfig) durations() (drain, delay time.Duration, err error) {
	switch {
	case cfg.Drain < 0:
		return 0, 0, fmt.Errorf("idem.ServeHTTP: negative Drain %v", cfg.Drain)
	case cfg.Drain == 0:
		drain = DefaultDrain
	default:
		drain = cfg.Drain
	}
	switch {
	case cfg.NotReadyDelay < 0:
		return 0, 0, fmt.Errorf("idem.ServeHTTP: negative NotReadyDelay %v (set NoNotReadyDelay for none)", cfg.NotReadyDelay)
	case cfg.NoNotReadyDelay && cfg.NotReadyDelay > 0:
		return 0, 0, errors.New("idem.ServeHTTP: both NoNotReadyDelay and NotReadyDelay are set")
	case cfg.NoNotReadyDelay:
	case cfg.NotReadyDelay == 0:
		delay = DefaultNotReadyDelay
	default:
		delay = cfg.NotReadyDelay
	}
	return drain, delay, nil
}
