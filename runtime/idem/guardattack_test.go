package idem

import (
	"bytes"
	"context"
	"runtime/pprof"
	"strings"
	"testing"

	"github.com/idemgen/idemgen/runtime/internal/guardlane"
)

// attack1LabelProbe blocks the guarded call that runs it until release is
// closed, so that the goroutine profile shows it, with its labels.
//
//go:noinline
func attack1LabelProbe(running chan<- struct{}, release <-chan struct{}) {
	close(running)
	<-release
}

// labelsOfProbe runs a guarded call from a goroutine labelled
// consumer=name and returns the pprof labels of the goroutine that ran it,
// as the goroutine profile reports them.
func labelsOfProbe(t *testing.T, lane context.Context, name string) string {
	t.Helper()
	running, release, done := make(chan struct{}), make(chan struct{}), make(chan struct{})
	go pprof.Do(lane, pprof.Labels("consumer", name), func(ctx context.Context) {
		defer close(done)
		_ = guarded(ctx, "test", func() error { attack1LabelProbe(running, release); return nil })
	})
	<-running
	var buf bytes.Buffer
	if err := pprof.Lookup("goroutine").WriteTo(&buf, 1); err != nil {
		t.Fatal(err)
	}
	close(release)
	<-done
	for _, rec := range strings.Split(buf.String(), "\n\n") {
		if !strings.Contains(rec, "attack1LabelProbe") {
			continue
		}
		for _, line := range strings.Split(rec, "\n") {
			if l, ok := strings.CutPrefix(line, "# labels: "); ok {
				return l
			}
		}
		return "(none)"
	}
	t.Fatal("the probe's goroutine is not in the goroutine profile")
	return ""
}

// attack1 (issue 11, guardWorker): a guarded call runs user code under the
// caller's pprof labels (a consumer's CPU profile attributes a handler's
// samples to the consumer, as pprof.Do around Run labels it). A goroutine
// started per call inherited the caller's labels; a reused worker kept
// those of the goroutine that happened to start it, so consumer B's
// handler was profiled as consumer A's.
func TestGuardedRunsUnderTheCallersProfilerLabels(t *testing.T) {
	lane, stop := guardlane.With(context.Background())
	defer stop()
	if got := labelsOfProbe(t, lane, "A"); got != `{"consumer":"A"}` {
		t.Fatalf("first call: labels %s, want consumer A's", got)
	}
	if got := labelsOfProbe(t, lane, "B"); got != `{"consumer":"B"}` {
		t.Fatalf("second call, from consumer B: labels %s, want consumer B's", got)
	}
	// A handler that sets its goroutine's labels and returns does not
	// leave them to the next call.
	_ = guarded(lane, "test", func() error {
		pprof.SetGoroutineLabels(pprof.WithLabels(context.Background(), pprof.Labels("leaked", "yes")))
		return nil
	})
	if got := labelsOfProbe(t, lane, "C"); got != `{"consumer":"C"}` {
		t.Fatalf("call after a handler set labels: %s, want consumer C's", got)
	}
}
