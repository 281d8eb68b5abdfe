package idem_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// Outside review (revrt). Folding the 503 log lines must not hide a
// different failure behind another endpoint's: scope a's function fails
// every request at COMMIT with an outage SQLSTATE (a deferred trigger raises
// 53100, disk full), and while its lines are folded scope b fails once with
// another (53200, out of memory). (This test used a deferred unique
// constraint, 23505, and foreign key, 23503: those are the function's
// failures now, 500s, TestDeferredConstraintAtCommitIsNotOutage.) Both are
// "idempotency storage failed" 503s; folded by
// message alone, b's failure was only counted, and the interval's summary
// carries the last failure's scope and error (a's): b's never reached the
// log. Each endpoint and SQLSTATE is its own kind now, so b's first failure
// is logged at once, with its scope and error.
func TestRevrtFoldedFailuresKeepScopesApart(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE FUNCTION fail_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'failing at COMMIT' USING ERRCODE = NEW.code; END $$;
CREATE TABLE fails (code text);
CREATE CONSTRAINT TRIGGER fail_commit AFTER INSERT ON fails DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION fail_commit()`)
	logs := &lockedBuffer{}
	engine, err := idem.NewHTTP(idem.NewStore(pool), idem.HTTPConfig{
		Logger:             slog.New(slog.NewTextHandler(logs, nil)),
		FailureLogInterval: time.Hour, // no summary within the test: only lines logged at once count
	})
	if err != nil {
		t.Fatal(err)
	}
	a := idem.Handle(engine, idem.Endpoint{Scope: "a"}, func(ctx context.Context, tx pgx.Tx, r chargeReq) (receipt, error) {
		_, err := tx.Exec(ctx, `INSERT INTO fails VALUES ('53100')`)
		return receipt{}, err
	})
	b := idem.Handle(engine, idem.Endpoint{Scope: "b"}, func(ctx context.Context, tx pgx.Tx, r chargeReq) (receipt, error) {
		_, err := tx.Exec(ctx, `INSERT INTO fails VALUES ('53200')`)
		return receipt{}, err
	})
	wantProblem(t, do(a, "a1", body1), http.StatusServiceUnavailable)
	wantProblem(t, do(a, "a2", body1), http.StatusServiceUnavailable)
	wantProblem(t, do(b, "b1", body1), http.StatusServiceUnavailable)
	wantProblem(t, do(a, "a3", body1), http.StatusServiceUnavailable)
	var aLines, bLines int
	for _, l := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		switch {
		case strings.Contains(l, "scope=a") && strings.Contains(l, "53100"):
			aLines++
		case strings.Contains(l, "scope=b") && strings.Contains(l, "53200"):
			bLines++
		}
	}
	if aLines != 1 || bLines != 1 {
		t.Fatalf("logged %d lines of scope a's 53100 (want 1: the rest folded) and %d of scope b's 53200 (want 1):\n%s", aLines, bLines, logs)
	}
}

// Outside review (revrt). Concurrent 503s of two endpoints during an outage,
// over several intervals: every failure is accounted for (the lines logged
// at once plus the counts of the summaries equal the requests, per scope),
// no summary is written twice for one count, and once the failures stop no
// timer or goroutine is left (the bubble ends with nothing running).
func TestRevrtFoldedFailuresAllCounted(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		pool, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:1/none?sslmode=disable&connect_timeout=2")
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		logs := &lockedBuffer{}
		engine, err := idem.NewHTTP(idem.NewStore(pool), idem.HTTPConfig{
			Logger: slog.New(slog.NewJSONHandler(logs, nil)), FailureLogInterval: time.Second,
		})
		if err != nil {
			t.Fatal(err)
		}
		fn := func(context.Context, pgx.Tx, chargeReq) (receipt, error) { return receipt{}, nil }
		hs := map[string]http.Handler{
			"a": idem.Handle(engine, idem.Endpoint{Scope: "a"}, fn),
			"b": idem.Handle(engine, idem.Endpoint{Scope: "b"}, fn),
		}
		const rounds, per = 5, 20
		var wg sync.WaitGroup
		for round := range rounds {
			for scope, h := range hs {
				for i := range per {
					wg.Add(1)
					go func() {
						defer wg.Done()
						if r := do(h, fmt.Sprint(scope, round, "-", i), body1); r.status != http.StatusServiceUnavailable {
							t.Errorf("status %d, want 503", r.status)
						}
					}()
				}
			}
			wg.Wait()
			time.Sleep(400 * time.Millisecond)
		}
		time.Sleep(5 * time.Second) // every summary due is written
		synctest.Wait()
		got := map[string]int{}
		re := regexp.MustCompile(`^(\d+) more requests failed with idempotency storage failed$`)
		for _, l := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
			var rec map[string]any
			if err := json.Unmarshal([]byte(l), &rec); err != nil {
				t.Fatalf("%v: %s", err, l)
			}
			msg, _ := rec["msg"].(string)
			scope, _ := rec["scope"].(string)
			switch m := re.FindStringSubmatch(msg); {
			case msg == "idempotency storage failed":
				got[scope]++
			case m != nil:
				n, _ := strconv.Atoi(m[1])
				got[scope] += n
			default:
				t.Fatalf("unexpected line %s", l)
			}
		}
		t.Logf("%d log lines for %d failures", strings.Count(logs.String(), "\n"), 2*rounds*per)
		for scope := range hs {
			if got[scope] != rounds*per {
				t.Errorf("scope %s: the log accounts for %d failures, want %d\n%s", scope, got[scope], rounds*per, logs)
			}
		}
	})
}
