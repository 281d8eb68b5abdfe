package idem_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// BenchmarkHTTPSideBySide runs, interleaved in one loop so that machine noise
// hits all of them alike:
//
//   - bare:   a handler that decodes the JSON, INSERTs in its own
//     transaction, commits and encodes the response;
//   - first:  the idempotent handler on a new key doing the same INSERT;
//   - replay: the idempotent handler on a completed key.
//
// It reports each one's mean latency and the ratios first/bare and
// replay/first. Run: go test ./runtime -run '^$' -bench HTTPSideBySide
func BenchmarkHTTPSideBySide(b *testing.B) {
	pool := pgtest.PoolConfig(b, func(c *pgxpool.Config) {
		if os.Getenv("BENCH_ASYNC_COMMIT") != "" {
			c.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
		}
	})
	ctx := context.Background()
	if err := idem.Migrate(ctx, pool); err != nil {
		b.Fatal(err)
	}
	pgtest.Exec(b, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount int NOT NULL)`)

	insert := func(ctx context.Context, tx pgx.Tx, req chargeReq) (receipt, error) {
		var id int64
		err := tx.QueryRow(ctx, `INSERT INTO effects (order_id, amount) VALUES ($1, $2) RETURNING id`, req.Order, req.Amount).Scan(&id)
		return receipt{ID: id, Order: req.Order, Amount: req.Amount}, err
	}
	bare := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req chargeReq
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		tx, err := pool.Begin(r.Context())
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		defer tx.Rollback(r.Context())
		resp, err := insert(r.Context(), tx, req)
		if err == nil {
			err = tx.Commit(r.Context())
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(resp)
	})
	engine, err := idem.NewHTTP(idem.NewStore(pool), idem.HTTPConfig{})
	if err != nil {
		b.Fatal(err)
	}
	idemH := idem.Handle(engine, idem.Endpoint{Scope: "bench", Route: "POST /charges", Status: 201}, insert)
	if r := do(idemH, "replayed", body1); r.status != http.StatusCreated {
		b.Fatal(r.status)
	}

	var tBare, tFirst, tReplay time.Duration
	run := func(total *time.Duration, h http.Handler, key string, want int) {
		start := time.Now()
		r := do(h, key, body1)
		*total += time.Since(start)
		if r.status != want {
			b.Fatalf("status %d: %s", r.status, r.body)
		}
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		run(&tBare, bare, "", http.StatusCreated)
		run(&tFirst, idemH, fmt.Sprintf("k-%d-%d", b.N, i), http.StatusCreated)
		run(&tReplay, idemH, "replayed", http.StatusCreated)
	}
	n := float64(b.N)
	b.ReportMetric(float64(tBare.Microseconds())/n, "bare-µs/req")
	b.ReportMetric(float64(tFirst.Microseconds())/n, "first-µs/req")
	b.ReportMetric(float64(tReplay.Microseconds())/n, "replay-µs/req")
	b.ReportMetric(float64(tFirst)/float64(tBare), "first/bare")
	b.ReportMetric(float64(tReplay)/float64(tFirst), "replay/first")
}
