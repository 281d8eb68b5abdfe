package idem_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/idemgen/idemgen/runtime/idem"
)

// ServeHTTP on shutdown: readiness turns 503 at once, a request that
// finishes within the drain deadline completes, and one that does not has
// its context cancelled (so its transaction rolls back) before ServeHTTP
// returns.
func TestServeHTTPDrainsThenCancels(t *testing.T) {
	t.Parallel()
	// The quick request (100ms) must finish within the drain: 1s leaves a
	// loaded machine 900ms of scheduling (300ms left it 200ms).
	const drain = time.Second
	ready := &idem.Readiness{}
	started := make(chan struct{}, 2)
	cancelled := make(chan error, 1)
	mux := http.NewServeMux()
	mux.HandleFunc("/quick", func(w http.ResponseWriter, r *http.Request) {
		started <- struct{}{}
		time.Sleep(100 * time.Millisecond)
		_, _ = w.Write([]byte("done"))
	})
	mux.HandleFunc("/stuck", func(w http.ResponseWriter, r *http.Request) {
		started <- struct{}{}
		<-r.Context().Done()
		cancelled <- r.Context().Err()
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() {
		served <- idem.ServeHTTP(ctx, &http.Server{Handler: mux}, ln, idem.ServeConfig{Ready: ready, NoNotReadyDelay: true, Drain: drain})
	}()

	if w := httptest.NewRecorder(); func() int { ready.ServeHTTP(w, nil); return w.Code }() != http.StatusOK {
		t.Fatal("not ready while serving")
	}
	base := "http://" + ln.Addr().String()
	quick := make(chan error, 1)
	go func() {
		resp, err := http.Get(base + "/quick")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				err = errors.New(resp.Status)
			}
		}
		quick <- err
	}()
	go func() { _, _ = http.Get(base + "/stuck") }()
	<-started
	<-started

	start := time.Now()
	stop()
	// Readiness turns off as shutdown begins, well before the drain
	// deadline (the stuck request keeps the drain going until then). Polled:
	// a fixed 20ms sleep here bet that ServeHTTP's goroutine is scheduled
	// within 20ms of the cancellation.
	for !ready.Draining() {
		if time.Since(start) >= drain {
			t.Fatal("readiness still on at the drain deadline")
		}
		time.Sleep(time.Millisecond)
	}
	if err := <-quick; err != nil {
		t.Fatalf("request within the drain deadline failed: %v", err)
	}
	select {
	case err := <-cancelled:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("stuck request ended with %v, want context.Canceled", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("stuck request's context was never cancelled")
	}
	if took := time.Since(start); took < drain {
		t.Fatalf("cancelled after %v, before the drain deadline", took)
	}
	if err := <-served; err != nil {
		t.Fatalf("ServeHTTP: %v", err)
	}
}
