package idem_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/runtime/idem"
)

// downEngine is an HTTP engine on a database that refuses every connection,
// logging to the returned buffer. Call it inside the synctest bubble: the
// pool's goroutines and the engine's timers belong to it, and time there is
// the bubble's.
func downEngine(t *testing.T, cfg idem.HTTPConfig) (http.Handler, *lockedBuffer) {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:1/none?sslmode=disable&connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	logs := &lockedBuffer{}
	cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	engine, err := idem.NewHTTP(idem.NewStore(pool), cfg)
	if err != nil {
		t.Fatal(err)
	}
	h := idem.Handle(engine, idem.Endpoint{Scope: "s"},
		func(context.Context, pgx.Tx, chargeReq) (receipt, error) { return receipt{}, nil })
	return h, logs
}

// requests sends n keyed requests to h, each answered 503.
func requests(t *testing.T, h http.Handler, n int) {
	t.Helper()
	for i := range n {
		wantProblem(t, do(h, fmt.Sprint("k", i), body1), http.StatusServiceUnavailable)
	}
}

// During a database outage every request is answered 503, and each logged a
// line: an outage at 10k requests a second flooded the log. With the default
// FailureLogInterval (10s) 40 503s log the first failure at once, and one
// line counting the other 39 when the interval has passed.
func TestOutage503sLogFolded(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		h, logs := downEngine(t, idem.HTTPConfig{})
		requests(t, h, 40)
		if n := strings.Count(logs.String(), "idempotency storage failed"); n != 1 {
			t.Fatalf("40 503s logged %d lines, want 1 (and a summary later)", n)
		}
		time.Sleep(10 * time.Second) // the bubble's clock: the interval passes at once
		synctest.Wait()
		lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
		if len(lines) != 2 || !strings.Contains(lines[1], "39 more requests failed with idempotency storage failed") {
			t.Fatalf("log after the interval:\n%s\nwant the first failure and a summary of the 39 others", logs)

		}
	})
}

// The summary of folded failures: written by a timer when the interval has
// passed, even if no request follows, and only when something was counted;
// a sustained outage logs one line per interval; after a quiet interval the
// next failure is logged at once; a negative interval logs every request.
func TestFailureLogSummary(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		h, logs := downEngine(t, idem.HTTPConfig{FailureLogInterval: time.Second})
		lines := func() []string { return strings.Split(strings.TrimSpace(logs.String()), "\n") }
		requests(t, h, 1)
		if n := len(lines()); n != 1 {
			t.Fatalf("the first failure: %d lines, want 1 at once", n)
		}
		time.Sleep(2 * time.Second)
		synctest.Wait()
		if n := len(lines()); n != 1 {
			t.Fatalf("nothing counted, yet %d lines after the interval:\n%s", n, logs)
		}
		// A fresh failure after a quiet interval is logged at once; the ones
		// right after it are counted.
		requests(t, h, 6)
		if got := lines(); len(got) != 2 || strings.Contains(got[1], "more requests") {
			t.Fatalf("after a quiet interval:\n%s\nwant the new failure logged at once, the 5 after it counted", logs)
		}
		time.Sleep(time.Second)
		synctest.Wait()
		if got := lines(); len(got) != 3 || !strings.Contains(got[2], "5 more requests failed with idempotency storage failed") ||
			!strings.Contains(got[2], "requests=5") || !strings.Contains(got[2], "scope=s") || !strings.Contains(got[2], "err=") {
			t.Fatalf("after the interval:\n%s\nwant a summary of the 5 counted failures, with the last one's scope and error", logs)
		}
		// Sustained: the failures of each interval are one line.
		for range 3 {
			requests(t, h, 4)
			time.Sleep(time.Second)
			synctest.Wait()
		}
		if got := lines(); len(got) != 6 || !strings.Contains(got[5], "4 more requests failed") {
			t.Fatalf("three more intervals of 4 failures each:\n%s\nwant one summary each", logs)
		}
		time.Sleep(5 * time.Second)
		synctest.Wait()
		if n := len(lines()); n != 6 {
			t.Fatalf("%d lines after the failures stopped, want no more than 6:\n%s", n, logs)
		}
	})
	synctest.Test(t, func(t *testing.T) {
		h, logs := downEngine(t, idem.HTTPConfig{FailureLogInterval: -1})
		requests(t, h, 5)
		if n := strings.Count(logs.String(), "idempotency storage failed"); n != 5 {
			t.Fatalf("FailureLogInterval -1: %d lines for 5 failures, want 5", n)
		}
	})
}
