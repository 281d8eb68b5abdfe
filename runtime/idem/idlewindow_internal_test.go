package idem

import (
	"testing"
	"time"
)

// The idle window's verdict: a window as long as the runtime's timeout
// (it may have fired) or mostly the runtime's own time (a freeze) is an
// outage; shorter, with the handler idle for most of it, the handler's;
// otherwise unclear. A timeout off (0) never fires.
func TestIdleWindowVerdict(t *testing.T) {
	ms := time.Millisecond
	cases := []struct {
		w       idleWindow
		timeout time.Duration
		want    windowVerdict
	}{
		{idleWindow{span: 300 * ms, handler: 290 * ms}, 2 * time.Minute, windowHandler},
		{idleWindow{span: 300 * ms, handler: 290 * ms}, 0, windowHandler},
		{idleWindow{span: 300 * ms, handler: 290 * ms}, 300 * ms, windowOutage},
		{idleWindow{span: 3 * time.Minute, handler: 290 * ms}, 2 * time.Minute, windowOutage},
		{idleWindow{span: 1000 * ms, handler: 10 * ms, runtime: 900 * ms}, 2 * time.Minute, windowOutage},
		{idleWindow{span: 600 * ms, handler: 1 * ms}, 2 * time.Minute, windowUnclear},
		{idleWindow{span: 600 * ms, handler: 300 * ms}, 2 * time.Minute, windowUnclear},
	}
	for _, c := range cases {
		if got := c.w.verdict(c.timeout); got != c.want {
			t.Errorf("%+v against %v: %v, want %v", c.w, c.timeout, got, c.want)
		}
	}
}
