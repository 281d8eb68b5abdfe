package idem_test

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// Outside review (revrt). Folding the 503 log lines must not hide a
// different failure behind another endpoint's: scope a's function fails
// every request at COMMIT (a deferred unique constraint, 23505), and while
// its lines are folded scope b fails once with another error (a deferred
// foreign key, 23503). Both are "idempotency storage failed" 503s; folded by
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
	pgtest.Exec(t, pool, `CREATE TABLE uniq (v text, UNIQUE (v) DEFERRABLE INITIALLY DEFERRED);
CREATE TABLE parent (id int PRIMARY KEY);
CREATE TABLE child (parent int REFERENCES parent DEFERRABLE INITIALLY DEFERRED)`)
	logs := &lockedBuffer{}
	engine, err := idem.NewHTTP(idem.NewStore(pool), idem.HTTPConfig{
		Logger:             slog.New(slog.NewTextHandler(logs, nil)),
		FailureLogInterval: time.Hour, // no summary within the test: only lines logged at once count
	})
	if err != nil {
		t.Fatal(err)
	}
	a := idem.Handle(engine, idem.Endpoint{Scope: "a"}, func(ctx context.Context, tx pgx.Tx, r chargeReq) (receipt, error) {
		_, err := tx.Exec(ctx, `INSERT INTO uniq VALUES ('x'), ('x')`)
		return receipt{}, err
	})
	b := idem.Handle(engine, idem.Endpoint{Scope: "b"}, func(ctx context.Context, tx pgx.Tx, r chargeReq) (receipt, error) {
		_, err := tx.Exec(ctx, `INSERT INTO child VALUES (1)`)
		return receipt{}, err
	})
	wantProblem(t, do(a, "a1", body1), http.StatusServiceUnavailable)
	wantProblem(t, do(a, "a2", body1), http.StatusServiceUnavailable)
	wantProblem(t, do(b, "b1", body1), http.StatusServiceUnavailable)
	wantProblem(t, do(a, "a3", body1), http.StatusServiceUnavailable)
	var aLines, bLines int
	for _, l := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		switch {
		case strings.Contains(l, "scope=a") && strings.Contains(l, "23505"):
			aLines++
		case strings.Contains(l, "scope=b") && strings.Contains(l, "23503"):
			bLines++
		}
	}
	if aLines != 1 || bLines != 1 {
		t.Fatalf("logged %d lines of scope a's 23505 (want 1: the rest folded) and %d of scope b's 23503 (want 1):\n%s", aLines, bLines, logs)
	}
}
