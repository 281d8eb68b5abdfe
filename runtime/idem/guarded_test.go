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
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/idemgen/idemgen/runtime/internal/guardlane"
)

// goroutineID is the id of the goroutine it runs on ("goroutine N [running]:").
func goroutineID() string {
	b := make([]byte, 64)
	return strings.Fields(string(b[:runtime.Stack(b, false)]))[1]
}

// laneWorkers counts the goroutines running a lane's worker, from the
// goroutine profile.
func laneWorkers(t *testing.T) int {
	t.Helper()
	var buf bytes.Buffer
	if err := pprof.Lookup("goroutine").WriteTo(&buf, 2); err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, g := range strings.Split(buf.String(), "\n\n") {
		if strings.Contains(g, "guardlane.(*Lane).work(") {
			n++
		}
	}
	return n
}

// waitLaneWorkers waits (bounded) until n lane workers are running.
func waitLaneWorkers(t *testing.T, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for got := laneWorkers(t); got != n; got = laneWorkers(t) {
		if time.Now().After(deadline) {
			t.Fatalf("%d lane workers, want %d", got, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// The calls of one lane run on one goroutine (the point of the lane: no
// goroutine started, no stack grown again per record); without a lane each
// call has a goroutine of its own.
func TestGuardedLaneReusesItsWorker(t *testing.T) {
	lane, stop := guardlane.With(context.Background())
	defer stop()
	var ids [4]string
	for i := range ids {
		_ = guarded(lane, "test", func() error { ids[i] = goroutineID(); return nil })
	}
	for i := range ids {
		if ids[i] != ids[0] {
			t.Fatalf("lane calls ran on goroutines %v, want one", ids)
		}
	}
	var a, b string
	_ = guarded(context.Background(), "test", func() error { a = goroutineID(); return nil })
	_ = guarded(context.Background(), "test", func() error { b = goroutineID(); return nil })
	if a == b || a == ids[0] {
		t.Fatalf("calls without a lane ran on goroutines %s, %s (the lane's: %s)", a, b, ids[0])
	}
}

// laneWorkerRunning reports whether goroutine id is running a lane's worker,
// from the goroutine profile.
func laneWorkerRunning(t *testing.T, id string) bool {
	t.Helper()
	var buf bytes.Buffer
	if err := pprof.Lookup("goroutine").WriteTo(&buf, 2); err != nil {
		t.Fatal(err)
	}
	for _, g := range strings.Split(buf.String(), "\n\n") {
		if strings.HasPrefix(g, "goroutine "+id+" [") && strings.Contains(g, "guardlane.(*Lane).work(") {
			return true
		}
	}
	return false
}

// A lane's worker ends at stop: none outlives the loop that made it (a
// process-wide pool kept up to 64 forever, for a goroutine-leak check to
// report). The worker is followed by its goroutine id: a count of the
// process's lane workers taken before and after also counts the workers of
// earlier tests' lanes, which end on their own schedule after their stop
// (the count before included one that ended meanwhile, and the test waited
// 5s for a count it could not reach).
func TestGuardLaneWorkerEndsAtStop(t *testing.T) {
	lane, stop := guardlane.With(context.Background())
	var worker string
	_ = guarded(lane, "test", func() error { worker = goroutineID(); return nil })
	if !laneWorkerRunning(t, worker) {
		t.Fatalf("goroutine %s, which ran the lane's call, is not a running lane worker", worker)
	}
	stop()
	for deadline := time.Now().Add(5 * time.Second); laneWorkerRunning(t, worker); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the lane's worker (goroutine %s) still runs 5s after stop", worker)
		}
	}
	// A call with the lane's ctx after stop still runs, on its own goroutine.
	ran := false
	if err := guarded(lane, "test", func() error { ran = true; return nil }); err != nil || !ran {
		t.Fatalf("call after stop: ran %v, err %v", ran, err)
	}
}

// Panics, Goexit and errors on a lane: each call is answered with its own
// result, and the calls after it run normally (after a Goexit, on a new
// worker). Calls made at once with the same lane each get their own result,
// exactly once.
func TestGuardedLaneSafeAfterPanicGoexitAndConcurrentUse(t *testing.T) {
	lane, stop := guardlane.With(context.Background())
	defer stop()
	errMine := errors.New("mine")
	cases := map[string]func() error{
		"nil":        func() error { return nil },
		"error":      func() error { return errMine },
		"panic":      func() error { panic("boom") },
		"panic(nil)": func() error { panic(nil) },
		"Goexit":     func() error { runtime.Goexit(); return nil },
		"Goexit after recover": func() error {
			defer func() { recover(); runtime.Goexit() }()
			panic("x")
		},
		"panic during Goexit": func() error {
			defer func() { panic("z") }()
			runtime.Goexit()
			return nil
		},
		"nested guarded Goexit": func() error {
			return guarded(lane, "inner", func() error { runtime.Goexit(); return nil })
		},
	}
	for round := range 3 {
		for name, fn := range cases {
			done := make(chan error, 1)
			go func() { done <- guarded(lane, "test", fn) }()
			select {
			case err := <-done:
				var pe *panicError
				switch name {
				case "nil":
					if err != nil {
						t.Fatalf("round %d, %s: %v", round, name, err)
					}
				case "error":
					if err != errMine {
						t.Fatalf("round %d, %s: %v", round, name, err)
					}
				default:
					if !errors.As(err, &pe) {
						t.Fatalf("round %d, %s: %v, want a panicError", round, name, err)
					}
				}
			case <-time.After(5 * time.Second):
				t.Fatalf("round %d, %s: caller not answered", round, name)
			}
			if err := guarded(lane, "test", func() error { return nil }); err != nil {
				t.Fatalf("round %d, after %s: %v", round, name, err)
			}
		}
	}
	var ran [2000]atomic.Int32
	var wrong atomic.Int64
	var wg sync.WaitGroup
	for g := range 20 {
		wg.Go(func() {
			for i := range 100 {
				n := g*100 + i
				want := errors.New("call")
				if err := guarded(lane, "test", func() error { ran[n].Add(1); return want }); err != want {
					wrong.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if w := wrong.Load(); w != 0 {
		t.Fatalf("%d calls answered with another call's result", w)
	}
	for n := range ran {
		if c := ran[n].Load(); c != 1 {
			t.Fatalf("call %d ran %d times", n, c)
		}
	}
}

// A handler frozen on a lane holds its worker; a call with the same lane
// meanwhile runs at once on a goroutine of its own.
func TestGuardedLaneFrozenHandler(t *testing.T) {
	lane, stop := guardlane.With(context.Background())
	defer stop()
	release := make(chan struct{})
	frozen := make(chan error, 1)
	entered := make(chan struct{})
	go func() { frozen <- guarded(lane, "test", func() error { close(entered); <-release; return nil }) }()
	<-entered // the frozen handler holds the lane (a 20ms sleep here did not make sure of it)
	done := make(chan error, 1)
	go func() { done <- guarded(lane, "test", func() error { return nil }) }()
	select {
	case <-done:
	case <-time.After(2 * time.Second):
		t.Fatal("a call waited for the lane's frozen handler")
	}
	close(release)
	if err := <-frozen; err != nil {
		t.Fatal(err)
	}
}

// A call that asks for panics on faults (debug.SetPanicOnFault, per
// goroutine) does not leave that to the calls after it on the lane's worker.
func TestGuardWorkerResetsPanicOnFault(t *testing.T) {
	lane, stop := guardlane.With(context.Background())
	defer stop()
	for range 8 {
		_ = guarded(lane, "test", func() error { debug.SetPanicOnFault(true); return nil })
		_ = guarded(lane, "test", func() error {
			if debug.SetPanicOnFault(false) {
				t.Error("a call found panic-on-fault set by the call before it")
			}
			return nil
		})
	}
}

// review3 (issue 11): with a process-wide pool of workers, a worker started
// outside a testing/synctest bubble took a call made inside one and closed
// its channel ("fatal error: close of synctest channel from outside
// bubble": the whole test binary died), and a worker started inside a
// bubble waited on the pool's channel, made outside it, so the bubble never
// settled and synctest.Test never returned. Calls without a lane and calls
// on a lane made inside the bubble both work.
func TestGuardedInsideSynctestBubble(t *testing.T) {
	outside, stop := guardlane.With(context.Background())
	defer stop()
	if err := guarded(outside, "x", func() error { return nil }); err != nil {
		t.Fatal(err)
	}
	if err := guarded(context.Background(), "x", func() error { return nil }); err != nil {
		t.Fatal(err)
	}
	synctest.Test(t, func(t *testing.T) {
		if err := guarded(t.Context(), "y", func() error { return nil }); err != nil {
			t.Fatal(err)
		}
		lane, stop := guardlane.With(t.Context())
		for range 3 {
			if err := guarded(lane, "y", func() error { time.Sleep(time.Second); return nil }); err != nil {
				t.Fatal(err)
			}
		}
		stop()
		synctest.Wait()
	})
}
