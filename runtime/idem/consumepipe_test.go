package idem_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/benchkit"
	"github.com/idemgen/idemgen/internal/faultproxy"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// Issue 11: the consumer sends BEGIN and the dedupe insert (which makes the
// transaction's settings) as one pipeline. Counted on the wire (pgx's
// statement cache warm), an applied record costs BEGIN+dedupe insert │ the
// handler's INSERT │ CheckOwnTransaction+COMMIT:
// 3, as many as the bare handler's BEGIN │ INSERT │ COMMIT (it was 4). A
// duplicate costs the pipeline │ ROLLBACK: 2 (was 3). A batch of n records
// costs the pipeline │ n handler INSERTs │ COMMIT (was one more). The minimum
// over a few records is taken: the pool pings a connection that sat idle
// over a second, which is not the record's cost.
//
// The statements sent are counted too (issue 11, branch consmerge): the
// transaction's settings are made by the dedupe insert itself, no longer by
// a set_config statement of their own, so an applied record sends 5
// statements (BEGIN, dedupe insert │ handler INSERT │ CheckOwnTransaction,
// COMMIT; it was 6), a duplicate 3 (BEGIN, dedupe insert │ ROLLBACK; was 4)
// a batch of n records n+4 (was n+5), and a batch of duplicates 4.
func TestConsumerRoundTripsOnTheWire(t *testing.T) {
	t.Parallel()
	var rt benchkit.RoundTrips
	var stmts statementCount
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) {
		c.MaxConns = 1
		c.ConnConfig.DialFunc = rt.Dial
		c.ConnConfig.Tracer = &stmts
	})
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
	p := processor(t, idem.NewStore(pool), 1)
	h := handler(insertEffect)
	rec := func(id string) *idem.Record {
		return &idem.Record{Topic: "events", Value: fmt.Appendf(nil, `{"id":%q,"amount":1}`, id)}
	}
	// trips returns the fewest round trips and the fewest statements of
	// five runs of op.
	trips := func(op func(i int)) (int64, int64) {
		t.Helper()
		best, fewest := int64(1<<30), int64(1<<30)
		for i := range 5 {
			before, sent := rt.Count(), stmts.n.Load()
			op(i)
			best = min(best, rt.Count()-before)
			fewest = min(fewest, stmts.n.Load()-sent)
		}
		return best, fewest
	}
	// Warm the statement cache, in both modes.
	processBounded(t, p, &h, rec("warm"))
	if _, err := p.ProcessBatch(context.Background(), &h, []*idem.Record{rec("warm-b1"), rec("warm-b2")}); err != nil {
		t.Fatal(err)
	}

	applied, appliedStmts := trips(func(i int) {
		if o := processBounded(t, p, &h, rec(fmt.Sprintf("rt-%d", i))); o != idem.Applied {
			t.Fatalf("outcome %v, want applied", o)
		}
	})
	duplicate, duplicateStmts := trips(func(int) {
		if o := processBounded(t, p, &h, rec("warm")); o != idem.Duplicate {
			t.Fatalf("outcome %v, want duplicate", o)
		}
	})
	const batch = 10
	batched, batchedStmts := trips(func(i int) {
		recs := make([]*idem.Record, batch)
		for j := range recs {
			recs[j] = rec(fmt.Sprintf("rt-b%d-%d", i, j))
		}
		outcomes, err := p.ProcessBatch(context.Background(), &h, recs)
		if err != nil || len(outcomes) != batch || outcomes[batch-1] != idem.Applied {
			t.Fatalf("batch: %v, %v", outcomes, err)
		}
	})
	if applied != 3 {
		t.Errorf("applied record: %d round trips, want 3", applied)
	}
	if duplicate != 2 {
		t.Errorf("duplicate: %d round trips, want 2", duplicate)
	}
	if batched != batch+2 {
		t.Errorf("batch of %d: %d round trips, want %d", batch, batched, batch+2)
	}
	// A batch of duplicates is committed like any batch: BEGIN, dedupe
	// insert │ CheckOwnTransaction, COMMIT. The check passes only if the
	// dedupe insert made the mark although it inserted no row; had it not,
	// the batch would fall back to per-record processing (more round
	// trips, the same outcomes).
	dupBatch, dupBatchStmts := trips(func(int) {
		outcomes, err := p.ProcessBatch(context.Background(), &h, []*idem.Record{rec("warm-b1"), rec("warm-b2")})
		if err != nil || fmt.Sprint(outcomes) != "[duplicate duplicate]" {
			t.Fatalf("batch of duplicates: %v, %v", outcomes, err)
		}
	})
	if dupBatch != 2 || dupBatchStmts != 4 {
		t.Errorf("batch of duplicates: %d round trips and %d statements, want 2 and 4", dupBatch, dupBatchStmts)
	}
	if appliedStmts != 5 {
		t.Errorf("applied record: %d statements, want 5", appliedStmts)
	}
	if duplicateStmts != 3 {
		t.Errorf("duplicate: %d statements, want 3", duplicateStmts)
	}
	if batchedStmts != batch+4 {
		t.Errorf("batch of %d: %d statements, want %d", batch, batchedStmts, batch+4)
	}
}

// statementCount is a pgx tracer counting the statements sent: each query
// of a batch, and each query sent on its own (the handler's, a ROLLBACK).
type statementCount struct{ n atomic.Int64 }

func (s *statementCount) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	s.n.Add(1)
	return ctx
}
func (s *statementCount) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (s *statementCount) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	s.n.Add(int64(d.Batch.Len()))
	return ctx
}
func (s *statementCount) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (s *statementCount) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// Issue 11: an event id PostgreSQL cannot store fails the dedupe insert
// inside the pipeline (too long for the index: 54000). It is still the record's failure, named as
// the dedupe insert's, and dead-lettered at once; the aborted transaction is rolled
// back before the connection goes back to the pool, so the pool keeps its
// one connection (a connection released in a transaction is destroyed) and
// the next record is applied on it.
func TestPipelinedDedupeInsertDataError(t *testing.T) {
	t.Parallel()
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 1 })
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
	store := idem.NewStore(pool)
	p := processor(t, store, 2)
	h := handler(insertEffect)
	pid := func() (pid uint32) {
		t.Helper()
		c, err := pool.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Release()
		if s := c.Conn().PgConn().TxStatus(); s != 'I' {
			t.Fatalf("pooled connection in transaction status %q", s)
		}
		return c.Conn().PgConn().PID()
	}
	processBounded(t, p, &h, &idem.Record{Topic: "events", Value: []byte(`{"id":"before","amount":1}`)})
	first, conns := pid(), pool.Stat().NewConnsCount()

	if o := processBounded(t, p, &h, &idem.Record{Topic: "events", Offset: 1, Value: []byte(`{"id":"` + unindexableID() + `","amount":1}`)}); o != idem.DeadLettered {
		t.Fatalf("outcome %v, want dead-lettered", o)
	}
	dl, err := store.DeadLetter(context.Background(), 1)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(dl.LastError, "record processed event: ") || !strings.Contains(dl.LastError, "54000") || dl.Attempts != 1 {
		t.Fatalf("dead letter: attempts %d, error %q; want 1 attempt of the dedupe insert failing with 54000", dl.Attempts, dl.LastError)
	}
	if got := pid(); got != first || pool.Stat().NewConnsCount() != conns {
		t.Fatalf("the connection was replaced (pid %d, was %d; %d connections made, was %d): released in a transaction",
			got, first, pool.Stat().NewConnsCount(), conns)
	}
	if o := processBounded(t, p, &h, &idem.Record{Topic: "events", Offset: 2, Value: []byte(`{"id":"after","amount":1}`)}); o != idem.Applied {
		t.Fatalf("next record: %v, want applied", o)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 2 {
		t.Fatalf("%d effects, want 2", n)
	}
}

// Issue 11: the pipeline against a blackholed database (the connection open,
// nothing answered) ends at StorageTimeout, not at the record's context, and
// is an outage: waited out with no attempt used, so with a budget of one
// attempt the record is applied once the database is back, not
// dead-lettered.
func TestPipelineBlackholedIsBoundedOutage(t *testing.T) {
	t.Parallel()
	url := pgtest.Schema(t)
	ctx := context.Background()
	direct, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(direct.Close)
	if err := idem.Migrate(ctx, direct); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, direct, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
	px := faultproxy.New(t, faultproxy.PostgresTarget(url))
	cfg, err := pgxpool.ParseConfig(px.RewriteURL(url))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	proxied, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxied.Close)
	var logs lockedBuffer
	p, err := idem.NewProcessor(idem.NewStore(proxied), idem.ProcessorConfig{
		Retry:          idem.RetryPolicy{MaxAttempts: 1},
		Outage:         idem.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond},
		StorageTimeout: 300 * time.Millisecond,
		Logger:         slog.New(slog.NewTextHandler(&logs, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	h := handler(insertEffect)
	// The pool's one connection is open and was used just now: the next
	// record's pipeline goes out on it, into the blackhole.
	processBounded(t, p, &h, &idem.Record{Topic: "events", Value: []byte(`{"id":"warm","amount":1}`)})
	px.Blackhole()

	// The record's context is far longer than the test waits: only
	// StorageTimeout can end the tries.
	rctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	type result struct {
		o   idem.Outcome
		err error
	}
	done := make(chan result, 1)
	go func() {
		o, err := p.Process(rctx, &h, &idem.Record{Topic: "events", Offset: 1, Value: []byte(`{"id":"e1","amount":1}`)})
		done <- result{o, err}
	}()
	waits := func() int { return strings.Count(logs.String(), "storage unavailable; waiting, no attempt used") }
	deadline := time.Now().Add(20 * time.Second)
	for waits() < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("no outage waits in 20s with a StorageTimeout of 300ms; logs:\n%s", logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The first try was the pipeline on the open connection, bounded by
	// the storage timeout.
	var first string
	for _, line := range strings.Split(logs.String(), "\n") {
		if strings.Contains(line, "storage unavailable") {
			first = line
			break
		}
	}
	if !strings.Contains(first, `err="begin: `) {
		t.Fatalf("first outage is not the pipeline's: %s", first)
	}
	// An operator sees which record holds its partition back, and for how
	// long: every wait names the partition and offset, and the later ones
	// how long this record has waited (at least the first try's
	// StorageTimeout).
	stuck := outageFor(t, logs.String(), "partition=0 offset=1 outage_tries=2 ")
	if stuck < 300*time.Millisecond {
		t.Fatalf("the second wait says the record has waited %v, want at least the first try's 300ms", stuck)
	}
	px.Restore()
	select {
	case r := <-done:
		if r.err != nil || r.o != idem.Applied {
			t.Fatalf("after the blackhole: %v, %v; want applied (an outage uses no attempt)", r.o, r.err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("not applied within 30s of the database coming back")
	}
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
		t.Fatalf("%d dead letters for an outage", n)
	}
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM effects WHERE event_id = 'e1'`); n != 1 {
		t.Fatalf("%d effects for e1, want 1", n)
	}
}

// outageFor is the outage_for of the first outage log line holding prefix.
func outageFor(t *testing.T, logs, prefix string) time.Duration {
	t.Helper()
	for _, line := range strings.Split(logs, "\n") {
		if !strings.Contains(line, "storage unavailable") || !strings.Contains(line, prefix) {
			continue
		}
		_, rest, ok := strings.Cut(line, " outage_for=")
		if !ok {
			t.Fatalf("outage log line without outage_for: %s", line)
		}
		d, err := time.ParseDuration(strings.Fields(rest)[0])
		if err != nil {
			t.Fatalf("outage_for in %s: %v", line, err)
		}
		return d
	}
	t.Fatalf("no outage log line with %q:\n%s", prefix, logs)
	return 0
}
