package idem

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"
)

// failureLog folds the log lines of failures that come in floods. During a
// database outage every request fails the same way and is answered 503; a
// line per request (10k requests a second) drowns the log, and costs the
// service CPU when it can least afford it. The first failure of a kind (its
// message) is logged at once; later ones within interval are counted, and
// when the interval has passed one line says how many more there were, with
// the attributes of the last. A timer writes that line, so it comes even if
// no request follows; it is armed only while failures are counted, and no
// goroutine waits for it (time.AfterFunc). A sustained outage logs its first
// failure and then one line per interval.
type failureLog struct {
	logger   *slog.Logger
	interval time.Duration // negative: every failure is logged

	mu    sync.Mutex
	kinds map[string]*foldedFailures // by message
}

// foldedFailures is the state of one kind of failure.
type foldedFailures struct {
	quietUntil time.Time   // a failure before this is counted, not logged
	n          int         // failures counted since the last line
	level      slog.Level  // of the last counted failure
	last       []any       // its attributes
	timer      *time.Timer // armed while n > 0
}

func newFailureLog(logger *slog.Logger, interval time.Duration) *failureLog {
	return &failureLog{logger: logger, interval: interval, kinds: map[string]*foldedFailures{}}
}

// log logs a failure, or counts it if one of its kind was logged less than
// the interval ago.
func (l *failureLog) log(ctx context.Context, level slog.Level, msg string, args ...any) {
	if l.interval < 0 {
		l.logger.Log(ctx, level, msg, args...)
		return
	}
	l.mu.Lock()
	f := l.kinds[msg]
	if f == nil {
		f = &foldedFailures{}
		l.kinds[msg] = f
	}
	if now := time.Now(); f.n == 0 && !now.Before(f.quietUntil) {
		f.quietUntil = now.Add(l.interval)
		l.mu.Unlock()
		l.logger.Log(ctx, level, msg, args...)
		return
	}
	f.n++
	f.level, f.last = level, args
	if f.timer == nil {
		f.timer = time.AfterFunc(time.Until(f.quietUntil), func() { l.summarize(msg) })
	}
	l.mu.Unlock()
}

// summarize logs how many failures of kind msg were counted, and starts the
// next interval: failures in it are counted too.
func (l *failureLog) summarize(msg string) {
	l.mu.Lock()
	f := l.kinds[msg]
	n, level, args := f.n, f.level, f.last
	f.n, f.last, f.timer = 0, nil, nil
	f.quietUntil = time.Now().Add(l.interval)
	l.mu.Unlock()
	if n > 0 {
		l.logger.Log(context.Background(), level, fmt.Sprintf("%d more requests failed with %s", n, msg),
			append([]any{"requests", n, "within", l.interval}, args...)...)
	}
}
