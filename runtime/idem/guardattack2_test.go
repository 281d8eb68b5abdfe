package idem

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// attack2 (issue 11, guarded): workers time out while callers hand them
// calls. With an idle TTL of a few microseconds nearly every hand-off races
// a worker's timer; every call must run exactly once and answer its own
// caller (run with -race).
func TestAttack2GuardedHandOffRacesWorkerTimeout(t *testing.T) {
	for _, ttl := range []time.Duration{time.Nanosecond, time.Microsecond, 20 * time.Microsecond, time.Millisecond} {
		old := guardIdleTTL.Swap(int64(ttl))
		var ran [4000]atomic.Int32
		var wg sync.WaitGroup
		var wrong atomic.Int64
		for g := range 40 {
			wg.Go(func() {
				for i := range 100 {
					n := g*100 + i
					want := errors.New("call")
					err := guarded(context.Background(), "test", func() error {
						ran[n].Add(1)
						if n%7 == 0 {
							runtime.Gosched()
						}
						return want
					})
					if err != want {
						wrong.Add(1)
					}
				}
			})
		}
		wg.Wait()
		guardIdleTTL.Store(old)
		if w := wrong.Load(); w != 0 {
			t.Fatalf("ttl %v: %d calls answered with another result", ttl, w)
		}
		for n := range ran {
			if c := ran[n].Load(); c != 1 {
				t.Fatalf("ttl %v: call %d ran %d times", ttl, n, c)
			}
		}
	}
}

// Panics, Goexit and their combinations in a reused worker: every caller
// is answered, and a call after each runs normally.
func TestAttack2GuardedPanicGoexitCombinations(t *testing.T) {
	cases := map[string]func() error{
		"panic(nil)": func() error { panic(nil) },
		"Goexit after recover": func() error {
			defer func() { recover(); runtime.Goexit() }()
			panic("x")
		},
		"Goexit deferred during panic": func() error {
			defer runtime.Goexit()
			panic("y")
		},
		"panic during Goexit": func() error {
			defer func() { panic("z") }()
			runtime.Goexit()
			return nil
		},
		"panic with an error": func() error { panic(errors.New("e")) },
		"nested guarded Goexit": func() error {
			return guarded(context.Background(), "inner", func() error { runtime.Goexit(); return nil })
		},
	}
	for name, fn := range cases {
		done := make(chan error, 1)
		go func() { done <- guarded(context.Background(), "test", fn) }()
		select {
		case err := <-done:
			if err == nil {
				t.Errorf("%s: nil error", name)
			}
			t.Logf("%s: %v", name, firstLine(err))
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: caller not answered", name)
		}
		if err := guarded(context.Background(), "test", func() error { return nil }); err != nil {
			t.Fatalf("after %s: %v", name, err)
		}
	}
}

func firstLine(err error) string {
	s := err.Error()
	for i, c := range s {
		if c == '\n' {
			return s[:i]
		}
	}
	return s
}

// Frozen handlers hold their workers; calls arriving meanwhile run on
// other workers, at once.
func TestAttack2GuardedFrozenHandlers(t *testing.T) {
	release := make(chan struct{})
	var frozen sync.WaitGroup
	for range 50 {
		frozen.Go(func() {
			_ = guarded(context.Background(), "test", func() error { <-release; return nil })
		})
	}
	time.Sleep(20 * time.Millisecond)
	start := time.Now()
	var wg sync.WaitGroup
	for range 200 {
		wg.Go(func() {
			_ = guarded(context.Background(), "test", func() error { return nil })
		})
	}
	wg.Wait()
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("200 calls took %v while 50 handlers were frozen", d)
	}
	close(release)
	frozen.Wait()
}

// A burst of 1000 calls at once, then nothing: all workers end within the
// idle TTL (plus scheduling), and the idle count is back to 0.
func TestAttack2GuardedBurstThenIdle(t *testing.T) {
	ttl := guardIdleTTL.Swap(int64(100 * time.Millisecond))
	defer guardIdleTTL.Store(ttl)
	gate := make(chan struct{})
	var open sync.Once
	release := func() { open.Do(func() { close(gate) }) }
	defer release() // a failure below leaves no call blocked for the tests after it
	var wg sync.WaitGroup
	for range 1000 {
		wg.Go(func() {
			_ = guarded(context.Background(), "test", func() error { <-gate; return nil })
		})
	}
	// Each blocked call has a worker of its own: wait (bounded) for the
	// 1000 to start, not a fixed time, which under -race and a loaded
	// machine was too short (960 of 1000).
	waitUntil := time.Now().Add(10 * time.Second)
	for n := guardWorkerGoroutines(t); n < 1000; n = guardWorkerGoroutines(t) {
		if time.Now().After(waitUntil) {
			t.Fatalf("%d workers for 1000 blocked calls", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	release()
	wg.Wait()
	deadline := time.Now().Add(3 * time.Second)
	for guardWorkerGoroutines(t) > 0 || guardWorkersIdle.Load() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d workers, %d idle, 3s after the burst", guardWorkerGoroutines(t), guardWorkersIdle.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
}
