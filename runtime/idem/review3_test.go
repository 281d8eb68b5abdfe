package idem

import (
	"context"
	"os"
	"testing"
	"testing/synctest"
	"time"
)

// guarded's workers are shared by every caller in the process. Under
// testing/synctest (Go 1.25+), a goroutine and the channels it makes belong
// to the bubble it started in, and a channel of a bubble operated on from
// outside is a fatal error (not a panic: the whole test binary dies).
// REVIEW3_SYNCTEST=1 runs these: they crash or hang on the current code,
// so they are skipped by default (see /work/notes/review3.md).
func skipUnlessSynctest(t *testing.T) {
	if os.Getenv("REVIEW3_SYNCTEST") == "" {
		t.Skip("crashes the test binary on the current code (fatal error); set REVIEW3_SYNCTEST=1")
	}
}

// A worker started outside any bubble takes a bubble's call and closes its
// done channel: "fatal error: close of synctest channel from outside bubble".
func TestReview3GuardedInBubbleAfterOutsideCall(t *testing.T) {
	skipUnlessSynctest(t)
	if err := guarded(context.Background(), "x", func() error { return nil }); err != nil {
		t.Fatal(err)
	}
	synctest.Test(t, func(t *testing.T) {
		if err := guarded(t.Context(), "y", func() error { return nil }); err != nil {
			t.Fatal(err)
		}
	})
}

// A call made only inside a bubble: the worker it starts belongs to the
// bubble and must end before synctest.Test returns.
func TestReview3GuardedOnlyInBubble(t *testing.T) {
	skipUnlessSynctest(t)
	guardIdleTTL.Store(int64(500 * time.Millisecond))
	synctest.Test(t, func(t *testing.T) {
		if err := guarded(t.Context(), "y", func() error { return nil }); err != nil {
			t.Fatal(err)
		}
	})
}
