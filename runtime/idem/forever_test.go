package idem_test

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// A handler that lowers idle_in_transaction_session_timeout in its own
// transaction (SET LOCAL, below the runtime's IdleInTransactionTimeout)
// and then idles past it has its session ended by the server (FATAL
// 25P03): at its next statement, or at the COMMIT. Its longest idle
// stretch is shorter than the runtime's timeout, so the rule that charges
// a handler idling past that timeout did not apply, and the closed
// connection was waited out as an outage: every attempt, forever
// ("storage unavailable; waiting, no attempt used"), the partition stuck
// behind it with the database answering at once. Likewise a handler that
// gets the 25P03 from its statement and returns nil: the COMMIT failed on
// the closed connection, an outage, forever. The server's timeout could
// only have been lowered inside the transaction (the whole stretch in
// which it fired was shorter than the runtime's), the handler held the
// transaction idle for most of it and the database answers: the record's
// failure, its budget, then a dead letter saying so.
func TestHandlerLoweredIdleTimeoutIsDeadLettered(t *testing.T) {
	t.Parallel()
	lower := func(ctx context.Context, tx pgx.Tx, e event) error {
		if _, err := tx.Exec(ctx, `SET LOCAL idle_in_transaction_session_timeout = '50ms'`); err != nil {
			return err
		}
		if err := insertEffect(ctx, tx, e); err != nil {
			return err
		}
		time.Sleep(300 * time.Millisecond) // idle in its transaction, past its own 50ms
		return nil
	}
	cases := map[string]struct {
		configured time.Duration // IdleInTransactionTimeout: 0 the default (2m)
		fn         func(ctx context.Context, tx pgx.Tx, e event) error
	}{
		// Not lowered: the handler closes its own connection and returns
		// nil. No failed call says why; the database answers: unclear,
		// waited out twice in a row, then charged (3 tries an attempt).
		"connection closed by the handler": {fn: func(ctx context.Context, tx pgx.Tx, e event) error {
			if err := insertEffect(ctx, tx, e); err != nil {
				return err
			}
			return tx.Conn().Close(ctx)
		}},
		"lowered, COMMIT ends": {fn: lower},
		"lowered, statement ends": {fn: func(ctx context.Context, tx pgx.Tx, e event) error {
			if err := lower(ctx, tx, e); err != nil {
				return err
			}
			return insertEffect(ctx, tx, e)
		}},
		"lowered, 25P03 swallowed": {fn: func(ctx context.Context, tx pgx.Tx, e event) error {
			if err := lower(ctx, tx, e); err != nil {
				return err
			}
			_ = insertEffect(ctx, tx, e) //idemvet:ignore swallowcancel the mistake this test makes on purpose
			return nil
		}},
		"lowered with set_config, COMMIT ends": {fn: func(ctx context.Context, tx pgx.Tx, e event) error {
			if _, err := tx.Exec(ctx, `SELECT set_config('idle_in_transaction_session_timeout', '50', true)`); err != nil {
				return err
			}
			time.Sleep(300 * time.Millisecond)
			return insertEffect(ctx, tx, e)
		}},
		// (b) with the runtime's own timeout: the handler idles past it,
		// its next statement gets the 25P03, and it returns nil.
		"runtime's timeout, 25P03 swallowed": {configured: 100 * time.Millisecond, fn: func(ctx context.Context, tx pgx.Tx, e event) error {
			if err := insertEffect(ctx, tx, e); err != nil {
				return err
			}
			time.Sleep(400 * time.Millisecond)
			_, _ = tx.Exec(ctx, `SELECT 1`) //idemvet:ignore swallowcancel the mistake this test makes on purpose
			return nil
		}},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			pool, store := consumeDB(t)
			logs := &lockedBuffer{}
			p := processorWith(t, store, idem.ProcessorConfig{
				Retry:                    idem.RetryPolicy{MaxAttempts: 3, Initial: time.Millisecond, Max: 2 * time.Millisecond},
				Outage:                   idem.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
				IdleInTransactionTimeout: c.configured,
				StorageTimeout:           2 * time.Second,
				Logger:                   slog.New(slog.NewTextHandler(logs, nil)),
			})
			var calls atomic.Int64
			h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
				calls.Add(1)
				return c.fn(ctx, tx, e)
			})
			// Three attempts of ~0.3s each and their probes: well within 15s;
			// waited out as an outage it runs until the bound.
			o, err := processWithin(p, &h, idleRecord("lowered"), 15*time.Second)
			if err != nil || o != idem.DeadLettered {
				tries := strings.Count(logs.String(), "storage unavailable")
				t.Fatalf("Process: %v, %v after %d calls and %d outage tries; want dead-lettered after the budget of 3 (last log lines:\n%s)",
					o, err, calls.Load(), tries, tail(logs.String(), 3))
			}
			want, why := int64(3), "the budget"
			if strings.HasPrefix(name, "connection closed") {
				want, why = 9, "two unclear tries waited out before each charged one"
			}
			wantRuns(t, &calls, want, why)
			if strings.HasPrefix(name, "lowered") && strings.Contains(logs.String(), "storage unavailable") {
				// The handler idled most of the window: charged at once.
				t.Fatalf("waited out as an outage:\n%s", logs)
			}
			wantText := "lowered it"
			switch {
			case strings.HasPrefix(name, "runtime's"):
				wantText = "idle_in_transaction_session_timeout (100ms)"
			case strings.HasPrefix(name, "connection closed"):
				wantText = "connection is closed (on 3 tries in a row"
			}
			wantDeadLetter(t, pool, 3, wantText)
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 0 {
				t.Fatalf("%d effects, want 0", n)
			}
		})
	}
}

// tail is the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// The rules that charge a lowered idle timeout are no excuse to charge an
// outage. A handler that lowered its timeout (200ms) and is then ended by
// it because the network stalled under its statement (its time went into
// the round trip, not into idling) is not charged: with a budget of one
// attempt the record is applied once the network is back, never
// dead-lettered. So is one lowered to 100ms whose COMMIT the runtime held
// (a process frozen in its own code) past it.
func TestLoweredIdleTimeoutOutageIsNoAttempt(t *testing.T) {
	t.Parallel()
	t.Run("network stall under the handler's statement", func(t *testing.T) {
		t.Parallel()
		direct, proxied, px := proxiedConsumeDB(t, nil)
		p, logs := budgetOfOne(t, proxied, 5*time.Second)
		var calls atomic.Int64
		h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
			if _, err := tx.Exec(ctx, `SET LOCAL idle_in_transaction_session_timeout = '200ms'`); err != nil {
				return err
			}
			if err := insertEffect(ctx, tx, e); err != nil {
				return err
			}
			if calls.Add(1) == 1 {
				px.Latency(300 * time.Millisecond) // one way: the next statement arrives 300ms late
				defer px.Latency(0)
			}
			_, err := tx.Exec(ctx, `SELECT 1`)
			return err
		})
		o, err := processWithin(p, &h, idleRecord("stall"), 30*time.Second)
		if err != nil || o != idem.Applied {
			t.Fatalf("Process: %v, %v after %d calls; want applied (logs:\n%s)", o, err, calls.Load(), logs)
		}
		if !strings.Contains(logs.String(), "25P03") {
			t.Fatalf("the stall did not end the first attempt with 25P03, the test tests nothing; logs:\n%s", logs)
		}
		wantAppliedOnce(t, direct)
	})
	t.Run("runtime frozen before the COMMIT", func(t *testing.T) {
		t.Parallel()
		freeze := &commitFreezer{hold: time.Second}
		pool, store := tracedConsumeDB(t, freeze)
		logs := &lockedBuffer{}
		p := processorWith(t, store, idem.ProcessorConfig{
			Retry:  idem.RetryPolicy{MaxAttempts: 1},
			Outage: idem.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
			Logger: slog.New(slog.NewTextHandler(logs, nil)),
		})
		var calls atomic.Int64
		h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
			if _, err := tx.Exec(ctx, `SET LOCAL idle_in_transaction_session_timeout = '100ms'`); err != nil {
				return err
			}
			if calls.Add(1) == 1 {
				freeze.armed.Store(true) // the process freezes once this handler returns
			}
			return insertEffect(ctx, tx, e)
		})
		o, err := processWithin(p, &h, idleRecord("frozen"), 30*time.Second)
		if err != nil || o != idem.Applied {
			t.Fatalf("Process: %v, %v after %d calls; want applied (logs:\n%s)", o, err, calls.Load(), logs)
		}
		if freeze.armed.Load() || !strings.Contains(logs.String(), "25P03") {
			t.Fatalf("the COMMIT was not held into a 25P03, the test tests nothing; logs:\n%s", logs)
		}
		wantAppliedOnce(t, pool)
	})
}

// A timeout lowered so far that the handler's normal round trips reach it
// (1ms, over a network of 5ms each way) ends the session on every attempt
// with the handler never idle: unclear, but it must not block forever
// either. Waited out twice in a row while the database answers, the third
// try is charged: the budget of two attempts is spent in six tries, and
// the record is dead-lettered.
func TestLoweredIdleTimeoutReachedByRoundTripsIsBounded(t *testing.T) {
	t.Parallel()
	direct, proxied, px := proxiedConsumeDB(t, nil)
	px.Latency(5 * time.Millisecond)
	logs := &lockedBuffer{}
	p := processorWith(t, idem.NewStore(proxied), idem.ProcessorConfig{
		Retry:          idem.RetryPolicy{MaxAttempts: 2, Initial: time.Millisecond, Max: 2 * time.Millisecond},
		Outage:         idem.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
		StorageTimeout: 5 * time.Second,
		Logger:         slog.New(slog.NewTextHandler(logs, nil)),
	})
	var calls atomic.Int64
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		calls.Add(1)
		if _, err := tx.Exec(ctx, `SET LOCAL idle_in_transaction_session_timeout = '1ms'`); err != nil {
			return err
		}
		for range 3 {
			if err := insertEffect(ctx, tx, e); err != nil {
				return err
			}
		}
		return nil
	})
	o, err := processWithin(p, &h, idleRecord("tiny"), 30*time.Second)
	if err != nil || o != idem.DeadLettered {
		t.Fatalf("Process: %v, %v after %d calls; want dead-lettered (last log lines:\n%s)", o, err, calls.Load(), tail(logs.String(), 3))
	}
	wantRuns(t, &calls, 6, "two unclear tries waited out before each of 2 attempts")
	wantDeadLetter(t, direct, 2, "on 3 tries in a row", "25P03")
}

// The HTTP side of TestHandlerLoweredIdleTimeoutIsDeadLettered: a
// function that lowers idle_in_transaction_session_timeout in its
// transaction and idles past it had its session ended (25P03), and was
// answered a 503 ("storage unavailable; retry later", or "Outcome unknown"
// at the COMMIT): a retry that idles the same way, for a bug of the
// function. It is a 500 "Transaction idle too long", nothing stored, the
// key free: the retry with the same key runs the function once.
func TestFunctionLoweredIdleTimeoutIs500(t *testing.T) {
	lower := func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL idle_in_transaction_session_timeout = '50ms'`); err != nil {
			return err
		}
		time.Sleep(300 * time.Millisecond)
		return nil
	}
	cases := map[string]struct {
		keyed bool
		hook  func(ctx context.Context, tx pgx.Tx) error
	}{
		"COMMIT ends, keyed":  {keyed: true, hook: lower},
		"COMMIT ends, no key": {hook: lower},
		"statement ends": {keyed: true, hook: func(ctx context.Context, tx pgx.Tx) error {
			if err := lower(ctx, tx); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `SELECT 1`)
			return err
		}},
		"25P03 swallowed": {keyed: true, hook: func(ctx context.Context, tx pgx.Tx) error {
			if err := lower(ctx, tx); err != nil {
				return err
			}
			_, _ = tx.Exec(ctx, `SELECT 1`) //idemvet:ignore swallowcancel the mistake this test makes on purpose
			return nil
		}},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t)
			e.captureLogs()
			fix := e.hookUntilFixed(c.hook)
			h := e.handler(idem.Endpoint{KeyOptional: !c.keyed})
			key := ""
			if c.keyed {
				key = "k-lowered"
			}
			r := do(h, key, body1)
			if r.status != http.StatusInternalServerError || !strings.Contains(string(r.body), "Transaction idle too long") || r.header.Get("Retry-After") != "" {
				t.Fatalf("%d %s (Retry-After %q); want a 500 \"Transaction idle too long\" without Retry-After", r.status, r.body, r.header.Get("Retry-After"))
			}
			wantRetryRunsAgain(t, e, h, key, fix)
		})
	}
}
