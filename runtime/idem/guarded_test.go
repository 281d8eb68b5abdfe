package idem

import (
	"context"
	"errors"
	"runtime"
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
	errs := make([]error, 4*maxIdleGuardWorkers)
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

// A guarded call runs on the goroutine of the call before it (the point of
// guardWorker: no goroutine started, no stack grown again), once that one
// is back among the idle workers.
func TestGuardedRunsOnTheSameGoroutineAgain(t *testing.T) {
	goroutine := func() string {
		var id string
		_ = guarded(context.Background(), "test", func() error {
			b := make([]byte, 64)
			id = strings.Fields(string(b[:runtime.Stack(b, false)]))[1] // "goroutine N [running]:"
			return nil
		})
		return id
	}
	// Workers left idle by earlier calls are set aside, so that the one
	// waiting after the first call is the only one.
	var aside []chan *guardJob
	for len(idleGuardWorkers) > 0 {
		aside = append(aside, <-idleGuardWorkers)
	}
	defer func() {
		for _, w := range aside {
			select {
			case idleGuardWorkers <- w:
			default:
			}
		}
	}()
	first := goroutine()
	deadline := time.Now().Add(5 * time.Second)
	for len(idleGuardWorkers) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no idle guard worker 5s after a call")
		}
		time.Sleep(time.Millisecond)
	}
	if again := goroutine(); again != first {
		t.Fatalf("second call on goroutine %s, the first on %s", again, first)
	}
}
