package dbx

import (
	"testing"
	"time"
)

// msArg renders every duration as ms does, whether its value is cached,
// cached already, or past the cache's bound.
func TestMSArgIsMS(t *testing.T) {
	for round := range 2 {
		for i := range 3 * maxMSArgs {
			d := time.Duration(i)*time.Millisecond + time.Duration(i%3)*time.Microsecond
			if i == 1 {
				d = 0
			}
			got, ok := msArg(d).(string)
			if want := ms(d); !ok || got != want {
				t.Fatalf("round %d: msArg(%v) = %q, want %q", round, d, got, want)
			}
		}
	}
	if n := msArgsLen.Load(); n > maxMSArgs {
		t.Errorf("%d values cached, at most %d allowed", n, maxMSArgs)
	}
}
