package idem

import (
	"context"
	"errors"
	"net"
	"net/http"
	"sync/atomic"
	"time"
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

// ServeHTTP runs srv on ln until ctx is cancelled (typically by SIGTERM via
// signal.NotifyContext), then shuts down gracefully: it turns ready (if not
// nil) to 503, stops accepting, lets requests in progress finish for up to
// drain, and then cancels the contexts of the requests still running. Their
// transactions roll back and store nothing, so the clients' retries (to this
// or another replica) are safe.
//
// ServeHTTP sets srv.BaseContext; it returns nil after a clean shutdown.
func ServeHTTP(ctx context.Context, srv *http.Server, ln net.Listener, drain time.Duration, ready *Readiness) error {
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
	if ready != nil {
		ready.draining.Store(true)
	}
	drainCtx, cancelDrain := context.WithTimeout(context.Background(), drain)
	defer cancelDrain()
	err := srv.Shutdown(drainCtx)
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
