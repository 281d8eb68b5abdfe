package idem

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/idemgen/idemgen/runtime/internal/guardlane"
)

// Goexit whose deferred call panics and recovers inside fn; then a panic
// recovered by guarded during Goexit.
func TestAttack4GoexitVariants(t *testing.T) {
	lane, stop := guardlane.With(context.Background())
	defer stop()
	for i := range 200 {
		var err error
		switch i % 4 {
		case 0:
			err = guarded(lane, "x", func() error { runtime.Goexit(); return nil })
			if err == nil {
				t.Fatal("goexit: nil")
			}
		case 1:
			err = guarded(lane, "x", func() error {
				defer func() { panic("during goexit") }()
				runtime.Goexit()
				return nil
			})
			if err == nil {
				t.Fatal("panic during goexit: nil")
			}
		case 2:
			err = guarded(lane, "x", func() error {
				defer func() { recover() }()
				defer func() { panic("during goexit") }()
				runtime.Goexit()
				return nil
			})
			if err == nil {
				t.Fatal("recovered panic during goexit: nil")
			}
		case 3:
			want := i
			got := -1
			err = guarded(lane, "x", func() error { got = want; return nil })
			if err != nil || got != want {
				t.Fatal(err, got)
			}
		}
	}
}

// Many goroutines share one lane ctx, some calls Goexit or panic, and stop
// races with them: every call runs once and gets its own result, and no
// worker remains.
func TestAttack4ConcurrentStopRace(t *testing.T) {
	for round := range 50 {
		lane, stop := guardlane.With(context.Background())
		var wg sync.WaitGroup
		for g := range 6 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range 40 {
					want := round*100000 + g*1000 + i
					var runs atomic.Int32
					got := -1
					var err error
					switch i % 5 {
					case 0:
						err = guarded(lane, "x", func() error { runs.Add(1); runtime.Goexit(); return nil })
						if err == nil {
							t.Error("goexit: nil")
						}
					case 1:
						err = guarded(lane, "x", func() error { runs.Add(1); panic(want) })
						if err == nil || !strings.Contains(err.Error(), strconv.Itoa(want)) {
							t.Error("panic:", err)
						}
					default:
						err = guarded(lane, "x", func() error { runs.Add(1); got = want; return fmt.Errorf("%d", want) })
						if got != want || err == nil || err.Error() != strconv.Itoa(want) {
							t.Error(got, want, err)
						}
					}
					if runs.Load() != 1 {
						t.Error("runs", runs.Load())
					}
				}
			}()
			if g == 3 {
				go stop()
			}
		}
		wg.Wait()
	}
	waitLaneWorkers(t, 0)
}
