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

// Outside review of hclosed (a handler's own context closing its
// connection).

// stallNetwork stalls the network for d: every chunk crossing the proxy in
// that time is delivered d late, none is lost and no connection is cut (a
// partition shorter than TCP's retransmissions, a stalled switch, a paused
// database VM): a blip that heals by itself.
func stallNetwork(px interface{ Latency(time.Duration) }, d time.Duration) {
	px.Latency(d)
	time.AfterFunc(d+d/2, func() { px.Latency(0) })
}

// A network stall of 1s under a handler that bounds a quick statement with a
// 200ms deadline of its own: the deadline fires because the database does
// not answer, pgx closes the connection. The runtime's probe
// (handlerCulprit's ping) is bounded by StorageTimeout (5s here), longer
// than the stall: it waits the stall out, gets its answer, and concluded
// "the database answers", charging the record. With a budget of one, a good
// record was dead-lettered by a network blip.
func TestHandlerOwnContextDuringNetworkStallIsNoAttempt(t *testing.T) {
	t.Parallel()
	for name, fn := range quickOwnCtxHandlers {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			direct, proxied, px := slowNetworkDB(t)
			if err := idem.Migrate(context.Background(), direct); err != nil {
				t.Fatal(err)
			}
			pgtest.Exec(t, direct, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
			var logs lockedBuffer
			p := processorWith(t, idem.NewStore(proxied), idem.ProcessorConfig{
				Retry:          idem.RetryPolicy{MaxAttempts: 1},
				Outage:         idem.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond},
				StorageTimeout: 5 * time.Second,
				Logger:         slog.New(slog.NewTextHandler(&logs, nil)),
			})
			var calls atomic.Int64
			h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
				if err := insertEffect(ctx, tx, e); err != nil {
					return err
				}
				if calls.Add(1) == 1 {
					stallNetwork(px, time.Second)
				}
				return fn(ctx, tx)
			})
			o, err := processWithin(p, &h, idleRecord("stalled"), 30*time.Second)
			if err != nil || o != idem.Applied {
				t.Fatalf("Process: %v, %v after %d calls; want applied once the network is back (logs:\n%s)", o, err, calls.Load(), logs.String())
			}
			if n := pgtest.Count(t, direct, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
				t.Fatalf("%d dead letters, want 0", n)
			}
			if n := pgtest.Count(t, direct, `SELECT count(*) FROM effects`); n != 1 {
				t.Fatalf("%d effects, want 1", n)
			}
		})
	}
}

// The HTTP side: the same stall under a function's own 200ms deadline was
// answered 500 "Statement ended by the function's own context", blaming
// the function (no Retry-After) for the network's blip. It is a 503
// storage unavailable; the retry runs the function once.
func TestFunctionOwnContextDuringNetworkStallIs503(t *testing.T) {
	t.Parallel()
	for name, fn := range quickOwnCtxHandlers {
		t.Run(name, func(t *testing.T) {
			direct, proxied, px := slowNetworkDB(t)
			e := newEnvPool(t, proxied)
			var stall atomic.Bool
			stall.Store(true)
			e.hook = func(ctx context.Context, tx pgx.Tx, _ chargeReq) error {
				if stall.CompareAndSwap(true, false) {
					stallNetwork(px, time.Second)
				}
				return fn(ctx, tx)
			}
			h := e.handler(idem.Endpoint{})
			r := do(h, "k-stalled", body1)
			wantProblem(t, r, http.StatusServiceUnavailable)
			if !strings.Contains(string(r.body), "storage unavailable") || r.header.Get("Retry-After") == "" {
				t.Fatalf("%d %s (Retry-After %q); want a 503 storage unavailable with Retry-After", r.status, r.body, r.header.Get("Retry-After"))
			}
			time.Sleep(time.Second) // the stall is over
			r = do(h, "k-stalled", body1)
			if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") == "true" {
				t.Fatalf("retry: %d %s, want 201 from a run", r.status, r.body)
			}
			if e.calls.Load() != 2 || pgtest.Count(t, direct, `SELECT count(*) FROM effects`) != 1 {
				t.Fatalf("retry: %d calls, want 2, and one effect", e.calls.Load())
			}
		})
	}
}

// The request cancelled (client gone, shutdown) while the probe waits on a
// blackholed database, after the function's own deadline ended its
// statement: never the function's 500; the cancellation's 503, nothing
// stored, the key free.
func TestFunctionOwnContextRequestCancelledDuringProbe(t *testing.T) {
	direct, proxied, px := slowNetworkDB(t)
	e := newEnvPool(t, proxied)
	var once atomic.Bool
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e.hook = func(fctx context.Context, tx pgx.Tx, _ chargeReq) error {
		if once.CompareAndSwap(false, true) {
			px.Blackhole()
			time.AfterFunc(700*time.Millisecond, cancel) // the probe waits by then
		}
		return ownCtxExec(fctx, tx, false, 200*time.Millisecond, `SELECT 1`)
	}
	h := e.handler(idem.Endpoint{})
	start := time.Now()
	r := doCtx(ctx, h, "k-gone", body1)
	px.Restore()
	if r.status != http.StatusServiceUnavailable || time.Since(start) > 3*time.Second {
		t.Fatalf("%d %s after %v; want a 503 at once", r.status, r.body, time.Since(start))
	}
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM effects`) + pgtest.Count(t, direct, `SELECT count(*) FROM idem_keys`); n != 0 {
		t.Fatalf("%d effects and keys, want 0", n)
	}
	t.Logf("answer: %d %s", r.status, r.body)
}
