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
// service CPU when it can least afford it. The first failure of a kind is
// logged at once; later ones within interval are counted, and when the
// interval has passed one line says how many more there were, with the
// attributes of the last. A kind is the message, the endpoint's scope and the
// SQLSTATE (none for a network failure): folded by message alone, one
// endpoint's steady failures hid another endpoint's first one, or another
// error (a deferred constraint refused at COMMIT), behind a summary naming
// only the last failure. Kinds are few: scopes times the SQLSTATEs seen. A
// timer writes the summary, so it comes even if no request follows; it is
// armed only while failures are counted, and no goroutine waits for it
// (time.AfterFunc). A sustained outage logs its first failure and then one
// line per interval.
type failureLog struct {
	logger   *slog.Logger
	interval time.Duration // negative: every failure is logged

	mu    sync.Mutex
	kinds map[failureKind]*foldedFailures
}

// failureKind is what failures must share to be folded together.
type failureKind struct{ msg, scope, code string }

// foldedFailures is the state of one kind of failure.
type foldedFailures struct {
	quietUntil time.Time   // a failure before this is counted, not logged
	n          int         // failures counted since the last line
	level      slog.Level  // of the last counted failure
	last       []any       // its attributes
	timer      *time.Timer // armed while n > 0
}

func newFailureLog(logger *slog.Logger, interval time.Duration) *failureLog {
	return &failureLog{logger: logger, interval: interval, kinds: map[failureKind]*foldedFailures{}}
}

// log logs a failure of endpoint scope, or counts it if one of its kind was
// logged less than the interval ago.
func (l *failureLog) log(ctx context.Context, level slog.Level, msg, scope string, err error) {
	args := []any{"scope", scope, "err", err}
	if l.interval < 0 {
		l.logger.Log(ctx, level, msg, args...)
		return
	}
	l.mu.Lock()
	kind := failureKind{msg: msg, scope: scope, code: pgCode(err)}
	f := l.kinds[kind]
	if f == nil {
		f = &foldedFailures{}
		l.kinds[kind] = f
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
		f.timer = time.AfterFunc(time.Until(f.quietUntil), func() { l.summarize(kind) })
	}
	l.mu.Unlock()
}

// summarize logs how many failures of kind were counted, and starts the
// next interval: failures in it are counted too.
func (l *failureLog) summarize(kind failureKind) {
	l.mu.Lock()
	f := l.kinds[kind]
	n, level, args := f.n, f.level, f.last
	f.n, f.last, f.timer = 0, nil, nil
	f.quietUntil = time.Now().Add(l.interval)
	l.mu.Unlock()
	if n > 0 {
		l.logger.Log(context.Background(), level, fmt.Sprintf("%d more requests failed with %s", n, kind.msg),
			append([]any{"requests", n, "within", l.interval}, args...)...)
	}
}
