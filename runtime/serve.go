package runtime

import (
	"context"
	"errors"
	"net"
	"net/http"
	"time"
)

// ServeHTTP runs srv on ln until ctx is cancelled (typically by SIGTERM via
// signal.NotifyContext), then shuts down gracefully: it stops accepting, lets
// requests in progress finish for up to drain, and then cancels the contexts
// of the requests still running. Their transactions roll back and store
// nothing, so the clients' retries (to this or another replica) are safe.
//
// ServeHTTP sets srv.BaseContext; it returns nil after a clean shutdown.
func ServeHTTP(ctx context.Context, srv *http.Server, ln net.Listener, drain time.Duration) error {
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
