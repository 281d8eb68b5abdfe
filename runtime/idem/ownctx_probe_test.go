package idem_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// A pool of one connection: the attempt's connection is closed by the
// handler's own deadline, the probe must make another (no deadlock, no
// StorageTimeout wait taken for an outage); the record is dead-lettered
// after its budget.
func TestOwnContextPoolOfOne(t *testing.T) {
	t.Parallel()
	_, proxied, _ := proxiedConsumeDB(t, func(c *pgxpool.Config) { c.MaxConns = 1 })
	p := ownCtxProcessor(t, idem.NewStore(proxied), 2, 3*time.Second)
	h := ownCtxDeadlineHandler()
	start := time.Now()
	o, err := processWithin(p, &h, idleRecord("one"), 20*time.Second)
	if err != nil || o != idem.DeadLettered {
		t.Fatalf("Process: %v, %v after %v; want dead-lettered", o, err, time.Since(start))
	}
	attempts, last := lastDeadLetter(t, proxied)
	if attempts != 2 || !strings.Contains(last, "the handler's own context") {
		t.Fatalf("dead letter: %d attempts, %q", attempts, last)
	}
}

// A shutdown while the probe waits on a blackholed database: Process
// returns the context's error promptly, nothing is dead-lettered or
// applied.
func TestOwnContextShutdownDuringProbe(t *testing.T) {
	t.Parallel()
	direct, proxied, px := proxiedConsumeDB(t, nil)
	p, _ := budgetOfOne(t, proxied, 10*time.Second)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	h := handler(func(hctx context.Context, tx pgx.Tx, e event) error {
		if err := insertEffect(hctx, tx, e); err != nil {
			return err
		}
		px.Blackhole()
		time.AfterFunc(700*time.Millisecond, cancel) // the probe is waiting by then
		return ownCtxExec(hctx, tx, false, 200*time.Millisecond, `SELECT 1`)
	})
	start := time.Now()
	o, err := p.Process(ctx, &h, idleRecord("shutdown"))
	px.Restore()
	if !errors.Is(err, context.Canceled) || time.Since(start) > 3*time.Second {
		t.Fatalf("Process: %v, %v after %v; want context.Canceled at once", o, err, time.Since(start))
	}
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM idem_dead_letters`) + pgtest.Count(t, direct, `SELECT count(*) FROM effects`); n != 0 {
		t.Fatalf("%d dead letters and effects, want 0", n)
	}
}

// The runtime's own cancellation racing the handler's deadline, just
// before it (30-49ms in, the deadline at 50ms): never charged. Budget of
// one, run many times. (A cancellation just after the deadline may find
// the record's failure decided and its dead letter being written: that
// write, ended by the cancellation, may have committed although Process
// returns the context's error; the redelivery finds it stored.)
func TestOwnContextRuntimeCancelRacesHandlerDeadline(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	p := processorWith(t, store, idem.ProcessorConfig{
		Retry:          idem.RetryPolicy{MaxAttempts: 1},
		Outage:         idem.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
		StorageTimeout: 2 * time.Second,
	})
	for i := range 30 {
		ctx, cancel := context.WithCancel(context.Background())
		h := handler(func(hctx context.Context, tx pgx.Tx, e event) error {
			if err := insertEffect(hctx, tx, e); err != nil {
				return err
			}
			time.AfterFunc(time.Duration(30+i%20)*time.Millisecond, cancel)
			return ownCtxStatement(hctx, tx, false)
		})
		o, err := p.Process(ctx, &h, idleRecord("race"))
		cancel()
		if err == nil {
			t.Fatalf("run %d: Process: %v, nil; want the context's error", i, o)
		}
		if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
			t.Fatalf("run %d: %d dead letters, want 0 (err %v)", i, n, err)
		}
	}
}

// pgx's CancelRequestContextWatcherHandler: the handler's own deadline
// gets 57014 with the connection open: the record's failure as documented.
func TestOwnContextCancelRequestWatcher(t *testing.T) {
	t.Parallel()
	direct, proxied, _ := proxiedConsumeDB(t, func(c *pgxpool.Config) {
		c.ConnConfig.BuildContextWatcherHandler = func(pc *pgconn.PgConn) ctxwatch.Handler {
			return &pgconn.CancelRequestContextWatcherHandler{Conn: pc, DeadlineDelay: 5 * time.Second}
		}
	})
	p := ownCtxProcessor(t, idem.NewStore(proxied), 2, 2*time.Second)
	h := ownCtxDeadlineHandler()
	o, err := processWithin(p, &h, idleRecord("cancelreq"), 20*time.Second)
	if err != nil || o != idem.DeadLettered {
		t.Fatalf("Process: %v, %v; want dead-lettered", o, err)
	}
	attempts, last := lastDeadLetter(t, direct)
	if attempts != 2 || !strings.Contains(last, "57014") {
		t.Fatalf("dead letter: %d attempts, %q; want 2 and 57014", attempts, last)
	}
}

// A handler whose optional statement found its own budget already spent
// (pgconn does not send it, the connection stays open: contextAlreadyDone)
// and went on; then the network cuts its connection under its main
// statement. The connection closed because of the network, not the
// handler's context: an outage, no attempt (budget of one), applied once
// the retry runs. The clock's note of the earlier context error made it
// "the handler's own context" and, the database answering the probe,
// dead-lettered the good record.
func TestOwnContextEarlierCtxErrorThenNetworkCut(t *testing.T) {
	t.Parallel()
	direct, proxied, px := proxiedConsumeDB(t, nil)
	p, logs := budgetOfOne(t, proxied, 3*time.Second)
	var calls atomic.Int64
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		n := calls.Add(1)
		// Optional enrichment under a budget of its own, spent already.
		bctx, cancel := context.WithTimeout(ctx, time.Nanosecond)
		defer cancel()
		<-bctx.Done()
		var hint int
		if err := tx.QueryRow(bctx, `SELECT 1`).Scan(&hint); err == nil {
			return errors.New("the spent budget let the statement run")
		}
		if n == 1 {
			time.AfterFunc(100*time.Millisecond, px.Cut) // the network cuts the connection
			if _, err := tx.Exec(ctx, `SELECT pg_sleep(0.5)`); err != nil {
				return err
			}
		}
		return insertEffect(ctx, tx, e)
	})
	o, err := processWithin(p, &h, idleRecord("cut"), 20*time.Second)
	if err != nil || o != idem.Applied {
		t.Fatalf("Process: %v, %v after %d calls; want applied (logs:\n%s)", o, err, calls.Load(), logs.String())
	}
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
		t.Fatalf("%d dead letters, want 0", n)
	}
}

// The probe's guard against blocking forever: a pool that must make a
// connection for every probe (a pool of one, its connection closed by the
// handler's deadline), the probe's first connection slower than the
// handler's statement was given (1s against 200ms) while a round trip and
// the connection the probe makes right after are quick. That is
// slowAnswer on every attempt: each is waited out as an outage, but only
// ownCtxSlowProbes-1 (2) in a row; the next is the record's failure,
// dead-lettered, not blocked forever. Which connection is slow is not left
// to timing: the handler, once its statement has been ended (its
// connection closed), marks the next connection made slow, and only that
// one; that is the probe's first, since nothing else connects before it.
func TestOwnContextSlowConnectProbeStillDeadLetters(t *testing.T) {
	t.Parallel()
	var slowNext atomic.Bool // the next connection made takes 1s
	var slowDials atomic.Int64
	_, proxied, _ := proxiedConsumeDB(t, func(c *pgxpool.Config) {
		c.MaxConns = 1 // the probe makes a connection every time
		c.BeforeConnect = func(ctx context.Context, _ *pgx.ConnConfig) error {
			if slowNext.CompareAndSwap(true, false) {
				slowDials.Add(1)
				select {
				case <-time.After(time.Second):
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			return nil
		}
	})
	p, logs := budgetOfOne(t, proxied, 5*time.Second)
	var calls atomic.Int64
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		calls.Add(1)
		if err := insertEffect(ctx, tx, e); err != nil {
			return err
		}
		err := ownCtxExec(ctx, tx, false, 200*time.Millisecond, `SELECT pg_sleep(2)`)
		slowNext.Store(true)
		return err
	})
	o, err := processWithin(p, &h, idleRecord("slowdial"), 15*time.Second)
	if err != nil || o != idem.DeadLettered {
		t.Fatalf("Process: %v, %v after %d calls; want dead-lettered (logs:\n%s)", o, err, calls.Load(), logs.String())
	}
	// Exactly ownCtxSlowProbes-1 (2) slow probes waited out, then the
	// record's failure on the third attempt (without the guard: slow
	// probes for as long as the test's time allowed, never dead-lettered).
	if n, d, c := strings.Count(logs.String(), "answered only slowly"), slowDials.Load(), calls.Load(); n != 2 || d != 3 || c != 3 {
		t.Fatalf("%d slow probes waited out, %d slow connections, %d calls; want 2, 3 and 3 (logs:\n%s)", n, d, c, logs.String())
	}
	attempts, last := lastDeadLetter(t, proxied)
	if attempts != 1 || !strings.Contains(last, "the handler's own context") {
		t.Fatalf("dead letter: %d attempts, %q; want 1 and the handler's own context named", attempts, last)
	}
}

// The database stalls under the handler's quick statement (its own 200ms
// deadline fires because of it) and goes down before, at or just after
// that deadline, back 1.2s later: never charged (budget of one), applied
// once back.
func TestOwnContextDownAroundHandlerDeadline(t *testing.T) {
	t.Parallel()
	for _, at := range []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 300 * time.Millisecond} {
		t.Run(at.String(), func(t *testing.T) {
			t.Parallel()
			direct, proxied, px := proxiedConsumeDB(t, nil)
			p, logs := budgetOfOne(t, proxied, 5*time.Second)
			var calls atomic.Int64
			h := faultOnFirstCall(&calls, func() {
				px.Latency(2 * time.Second)
				time.AfterFunc(at, px.Down)
				time.AfterFunc(1200*time.Millisecond, px.Restore)
			}, func(ctx context.Context, tx pgx.Tx) error {
				return ownCtxExec(ctx, tx, false, 200*time.Millisecond, `SELECT 1`)
			})
			o, err := processWithin(p, &h, idleRecord("down"), 30*time.Second)
			if err != nil || o != idem.Applied {
				t.Fatalf("Process: %v, %v after %d calls; want applied (logs:\n%s)", o, err, calls.Load(), logs.String())
			}
			if n := pgtest.Count(t, direct, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
				t.Fatalf("%d dead letters, want 0", n)
			}
		})
	}
}
