package idem_test

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/faultproxy"
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
			direct, proxied, px := proxiedConsumeDB(t, nil)
			p, logs := budgetOfOne(t, proxied, 5*time.Second)
			var calls atomic.Int64
			h := faultOnFirstCall(&calls, func() { stallNetwork(px, time.Second) }, fn)
			o, err := processWithin(p, &h, idleRecord("stalled"), 30*time.Second)
			if err != nil || o != idem.Applied {
				t.Fatalf("Process: %v, %v after %d calls; want applied once the network is back (logs:\n%s)", o, err, calls.Load(), logs.String())
			}
			wantAppliedOnce(t, direct)
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
			testFunctionOwnContextFaultIs503(t, fn,
				func(px *faultproxy.Proxy) { stallNetwork(px, time.Second) },
				func(*faultproxy.Proxy) { time.Sleep(time.Second) }) // the stall is over
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
