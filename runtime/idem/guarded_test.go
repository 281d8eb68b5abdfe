package idem

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"strings"
	"sync"
	"testing"
	"time"
)

// guarded reuses its goroutines (guardWorker): a worker that ran a panic, a
// Goexit or an error must answer each call with that call's own result, and
// the calls after it must run normally, on a worker kept or a new one. Many
// calls at once each get their own result.
func TestGuardedReusesWorkersSafely(t *testing.T) {
	errMine := errors.New("mine")
	for round := range 3 {
		if err := guarded(context.Background(), "test", func() error { return nil }); err != nil {
			t.Fatalf("round %d: nil fn: %v", round, err)
		}
		var pe *panicError
		if err := guarded(context.Background(), "test", func() error { runtime.Goexit(); return nil }); !errors.As(err, &pe) || pe.value != errGoexit {
			t.Fatalf("round %d: Goexit: %v", round, err)
		}
		if err := guarded(context.Background(), "test", func() error { panic("boom") }); !errors.As(err, &pe) || pe.value != "boom" {
			t.Fatalf("round %d: panic: %v", round, err)
		}
		if err := guarded(context.Background(), "test", func() error { return errMine }); err != errMine {
			t.Fatalf("round %d: error: %v", round, err)
		}
	}
	var wg sync.WaitGroup
	errs := make([]error, 256)
	for i := range errs {
		wg.Go(func() {
			want := errors.New("call")
			if err := guarded(context.Background(), "test", func() error { return want }); err != want {
				errs[i] = err
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("call %d answered with %v", i, err)
		}
	}
}

// A guarded call runs on a worker left waiting by an earlier call (the
// point of guardWorker: no goroutine started, no stack grown again).
func TestGuardedRunsOnAWaitingWorker(t *testing.T) {
	_ = guarded(context.Background(), "test", func() error { return nil })
	waitIdleGuardWorker(t)
	before := guardWorkerGoroutines(t)
	_ = guarded(context.Background(), "test", func() error {
		if now := guardWorkerGoroutines(t); now != before {
			t.Errorf("%d guard workers while the call runs, %d before it: a new one was started", now, before)
		}
		return nil
	})
}

// Workers end once no call has come for guardIdleTTL: none is left behind
// after the last consumer stopped, for a goroutine-leak check to report.
// They used to wait forever (up to 64 of them).
func TestGuardWorkersEndWhenIdle(t *testing.T) {
	ttl := guardIdleTTL.Swap(int64(50 * time.Millisecond))
	defer guardIdleTTL.Store(ttl)
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			_ = guarded(context.Background(), "test", func() error { time.Sleep(10 * time.Millisecond); return nil })
		})
	}
	wg.Wait()
	if n := guardWorkerGoroutines(t); n == 0 {
		t.Fatal("no guard worker right after 16 calls at once")
	}
	deadline := time.Now().Add(5 * time.Second)
	for guardWorkerGoroutines(t) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d guard workers still there 5s after the last call", guardWorkerGoroutines(t))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// guardWorkerGoroutines counts the goroutines running guardWorker, from
// the goroutine profile.
func guardWorkerGoroutines(t *testing.T) int {
	t.Helper()
	var buf bytes.Buffer
	if err := pprof.Lookup("goroutine").WriteTo(&buf, 2); err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, g := range strings.Split(buf.String(), "\n\n") {
		if strings.Contains(g, "idem.guardWorker(") {
			n++
		}
	}
	return n
}

// A call that asks for panics on faults (debug.SetPanicOnFault, per
// goroutine) does not leave that to the calls after it on the same worker.
func TestGuardWorkerResetsPanicOnFault(t *testing.T) {
	for range 8 {
		_ = guarded(context.Background(), "test", func() error { debug.SetPanicOnFault(true); return nil })
		waitIdleGuardWorker(t)
		_ = guarded(context.Background(), "test", func() error {
			if debug.SetPanicOnFault(false) {
				t.Error("a call found panic-on-fault set by the call before it")
			}
			return nil
		})
		waitIdleGuardWorker(t)
	}
}
