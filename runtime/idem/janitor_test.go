package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/internal/db"
)

// seedRetention inserts n rows of every kind the janitor deletes, aged
// (old=true) past the default retention, or fresh; plus old outbox rows the
// janitor must never touch (PENDING and PARKED).
func seedRetention(t testing.TB, pool *pgxpool.Pool, tag string, n int, old bool) {
	t.Helper()
	age := "0"
	if old {
		age = "1"
	}
	pgtest.Exec(t, pool, fmt.Sprintf(`
INSERT INTO idem_keys (scope, principal, key, fingerprint, status_code, expires_at)
SELECT 's', 'p', '%[1]s-' || g, '\x00', 200, CASE WHEN %[3]s = 1 THEN now() - interval '1 minute' ELSE now() + interval '1 day' END
FROM generate_series(1, %[2]d) g;
INSERT INTO idem_processed_events (context, event_id, topic, kpartition, koffset, processed_at)
SELECT 'c', '%[1]s-' || g, 't', 0, g, now() - %[3]s * interval '8 days' FROM generate_series(1, %[2]d) g;
INSERT INTO idem_outbox (topic, payload, status, published_at, created_at)
SELECT 't', '', 'PUBLISHED', now() - %[3]s * interval '2 days', now() - %[3]s * interval '2 days' FROM generate_series(1, %[2]d) g;
INSERT INTO idem_dead_letters (context, topic, kpartition, koffset, attempts, last_error, created_at)
SELECT 'c', '%[1]s', 0, g, 1, 'boom', now() - %[3]s * interval '31 days' FROM generate_series(1, %[2]d) g;
INSERT INTO idem_outbox (topic, payload, status, created_at, last_error)
SELECT 't', '', s, now() - interval '90 days', CASE WHEN s = 'PARKED' THEN 'x' END
FROM unnest(ARRAY['PENDING', 'PARKED']) s;
`, tag, n, age))
}

func migrated(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.Pool(t)
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	return pool
}

type retentionCounts struct{ keys, events, published, deadLetters, pending, parked int64 }

func countRetention(t testing.TB, pool *pgxpool.Pool) retentionCounts {
	t.Helper()
	return retentionCounts{
		keys:        pgtest.Count(t, pool, `SELECT count(*) FROM idem_keys`),
		events:      pgtest.Count(t, pool, `SELECT count(*) FROM idem_processed_events`),
		published:   pgtest.Count(t, pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PUBLISHED'`),
		deadLetters: pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters`),
		pending:     pgtest.Count(t, pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PENDING'`),
		parked:      pgtest.Count(t, pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PARKED'`),
	}
}

// TestJanitorDeletesOnlyOldRows: with the default ages, one run deletes the
// old rows of each kind in batches of BatchSize and keeps the fresh ones and
// every unpublished outbox row, however old.
func TestJanitorDeletesOnlyOldRows(t *testing.T) {
	pool := migrated(t)
	seedRetention(t, pool, "old", 7, true)
	seedRetention(t, pool, "new", 5, false)
	j, err := idem.NewJanitor(idem.NewStore(pool), idem.JanitorConfig{BatchSize: 3})
	if err != nil {
		t.Fatal(err)
	}
	run, err := j.RunOnce(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if run.Skipped || run.ExpiredKeys != 7 || run.ProcessedEvents != 7 || run.PublishedOutbox != 7 || run.DeadLetters != 7 {
		t.Fatalf("run = %+v, want 7 of each kind deleted", run)
	}
	// 7 rows in batches of 3: 3, 3, 1 per kind.
	if run.Batches != 12 {
		t.Errorf("batches = %d, want 12 (3 per kind)", run.Batches)
	}
	got := countRetention(t, pool)
	want := retentionCounts{keys: 5, events: 5, published: 5, deadLetters: 5, pending: 2, parked: 2}
	if got != want {
		t.Errorf("rows left = %+v, want %+v", got, want)
	}
	// Idempotent: a second run finds nothing.
	if run, err := j.RunOnce(context.Background()); err != nil || run.Deleted() != 0 {
		t.Errorf("second run = %+v, %v; want nothing deleted", run, err)
	}
}

// TestJanitorConfig: ages are configurable, JanitorDisabled turns one kind
// off, and invalid configurations are refused.
func TestJanitorConfig(t *testing.T) {
	pool := migrated(t)
	seedRetention(t, pool, "old", 4, true)
	seedRetention(t, pool, "new", 4, false) // fresh: published now, dead letters now, processed now
	j, err := idem.NewJanitor(idem.NewStore(pool), idem.JanitorConfig{
		ExpiredKeyAge:      idem.JanitorDisabled,
		ProcessedEventAge:  time.Hour * 24 * 365, // keeps even the old ones (8 days)
		PublishedOutboxAge: time.Nanosecond,      // deletes even the fresh ones
		DeadLetterAge:      idem.JanitorDisabled,
	})
	if err != nil {
		t.Fatal(err)
	}
	run, err := j.RunOnce(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if run.ExpiredKeys != 0 || run.ProcessedEvents != 0 || run.PublishedOutbox != 8 || run.DeadLetters != 0 {
		t.Fatalf("run = %+v, want only the 8 published rows deleted", run)
	}
	cfg := j.Config()
	if cfg.Interval != idem.DefaultJanitorInterval || cfg.Jitter != idem.DefaultJanitorInterval/10 || cfg.BatchSize != idem.DefaultJanitorBatchSize {
		t.Errorf("defaults not filled in: %+v", cfg)
	}
	for _, bad := range []idem.JanitorConfig{
		{Interval: -time.Second},
		{BatchSize: -1},
		{Interval: time.Second, Jitter: time.Second},
	} {
		if _, err := idem.NewJanitor(idem.NewStore(pool), bad); err == nil {
			t.Errorf("NewJanitor(%+v) accepted an invalid configuration", bad)
		}
	}
	if _, err := idem.NewJanitor(nil, idem.JanitorConfig{}); err == nil {
		t.Error("NewJanitor(nil store) succeeded")
	}
}

// TestJanitorOneAtATime: while another session holds the janitor lock (a
// janitor in another replica), a run deletes nothing and says it skipped;
// once released, the next run works, and the lock is not left behind on a
// pooled connection.
func TestJanitorOneAtATime(t *testing.T) {
	pool := migrated(t)
	seedRetention(t, pool, "old", 3, true)
	ctx := context.Background()
	other, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := db.New(other).TryJanitorLock(ctx); err != nil || !got {
		t.Fatalf("take lock: %v %v", got, err)
	}
	j, err := idem.NewJanitor(idem.NewStore(pool), idem.JanitorConfig{})
	if err != nil {
		t.Fatal(err)
	}
	run, err := j.RunOnce(ctx)
	if err != nil || !run.Skipped || run.Deleted() != 0 {
		t.Fatalf("run while locked = %+v, %v; want skipped", run, err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_keys`); n != 3 {
		t.Fatalf("%d keys left, want 3 (nothing deleted while another janitor runs)", n)
	}
	if _, err := db.New(other).JanitorUnlock(ctx); err != nil {
		t.Fatal(err)
	}
	other.Release()
	run, err = j.RunOnce(ctx)
	if err != nil || run.Skipped || run.ExpiredKeys != 3 {
		t.Fatalf("run after release = %+v, %v; want 3 keys deleted", run, err)
	}
	// Two janitors racing: exactly one works per round, and afterwards no
	// connection still holds the lock.
	var skipped atomic.Int32
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if r, err := j.RunOnce(ctx); err != nil {
				t.Error(err)
			} else if r.Skipped {
				skipped.Add(1)
			}
		}()
	}
	wg.Wait()
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 7652 AND objid = 'idem_keys'::regclass::oid AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`); n != 0 {
		t.Errorf("%d janitor locks still held after the runs", n)
	}
}

// TestJanitorSkipsKeyInUse: an expired key that a request is taking over
// right now (its response stored over the expired row, which the request's
// transaction holds locked until it commits) is neither deleted nor waited
// on.
func TestJanitorSkipsKeyInUse(t *testing.T) {
	pool := migrated(t)
	seedRetention(t, pool, "old", 2, true)
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	// The claim's settings first: StoreKey checks it runs in the
	// transaction that claimed the key.
	if err := db.New(tx).SetLockTimeout(ctx, "5s"); err != nil {
		t.Fatal(err)
	}
	if err := db.New(tx).StoreKey(ctx, db.StoreKeyParams{Scope: "s", Principal: "p", Key: "old-1", Fingerprint: []byte{1},
		StatusCode: 201, Headers: `{}`, Body: []byte(`{}`), TtlSeconds: 60}); err != nil {
		t.Fatalf("take over expired key: %v", err)
	}
	j, err := idem.NewJanitor(idem.NewStore(pool), idem.JanitorConfig{})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	run, err := j.RunOnce(rctx)
	if err != nil || run.ExpiredKeys != 1 {
		t.Fatalf("run = %+v, %v; want the one unlocked expired key deleted, without waiting", run, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_keys WHERE key = 'old-1' AND expires_at > now()`); n != 1 {
		t.Error("the key taken over by the request is gone")
	}
}

// TestJanitorCancelBetweenBatches: cancelling the context during a run stops
// it after the batch in progress; committed batches stay deleted, the rest
// stays, and the run returns context.Canceled.
func TestJanitorCancelBetweenBatches(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var deletes atomic.Int32
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) {
		c.ConnConfig.Tracer = &queryEnd{fn: func(sql string) {
			// Cancel after the second batch committed.
			if strings.Contains(sql, "DeleteKeysExpiredAgo") && deletes.Add(1) == 2 {
				cancel()
			}
		}}
	})
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	seedRetention(t, pool, "old", 10, true)
	j, err := idem.NewJanitor(idem.NewStore(pool), idem.JanitorConfig{BatchSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	run, err := j.RunOnce(ctx)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	if run.ExpiredKeys != 4 || run.Batches != 2 {
		t.Errorf("run = %+v, want 2 batches, 4 keys", run)
	}
	got := countRetention(t, pool)
	if got.keys != 6 || got.events != 10 || got.published != 10 || got.deadLetters != 10 {
		t.Errorf("rows left = %+v, want 6 keys and every other row", got)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 7652 AND objid = 'idem_keys'::regclass::oid AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`); n != 0 {
		t.Errorf("janitor lock still held after a cancelled run")
	}
}

// TestJanitorRunLoop: Run runs repeatedly on its interval, reports each run
// to OnRun, and returns nil when its context is cancelled.
func TestJanitorRunLoop(t *testing.T) {
	pool := migrated(t)
	seedRetention(t, pool, "old", 3, true)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	runs := make(chan idem.JanitorRun, 10)
	j, err := idem.NewJanitor(idem.NewStore(pool), idem.JanitorConfig{
		Interval: 20 * time.Millisecond, Jitter: 5 * time.Millisecond,
		OnRun: func(r idem.JanitorRun) {
			select {
			case runs <- r:
			default:
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- j.Run(ctx) }()
	first, second := <-runs, <-runs
	if first.ExpiredKeys != 3 || second.Deleted() != 0 {
		t.Errorf("runs = %+v then %+v; want the 3 keys deleted by the first", first, second)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run returned %v after cancellation, want nil", err)
	}
}

// TestJanitorQueriesUseIndexes: every retention DELETE reads its victims
// through the index on its age column, already in order: no sequential scan
// and no sort, so a batch costs the rows it deletes, not the table's size.
// The statements are captured as the janitor sends them (with their
// arguments) and explained with sequential scans priced out, which makes
// the planner show whether an index path exists at all.
func TestJanitorQueriesUseIndexes(t *testing.T) {
	var mu sync.Mutex
	captured := map[string]capturedQuery{}
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) {
		c.ConnConfig.Tracer = &queryStart{fn: func(sql string, args []any) {
			mu.Lock()
			defer mu.Unlock()
			captured[queryName(sql)] = capturedQuery{sql, args}
		}}
	})
	ctx := context.Background()
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	seedRetention(t, pool, "old", 50, true)
	seedRetention(t, pool, "new", 50, false)
	pgtest.Exec(t, pool, `ANALYZE`)
	j, err := idem.NewJanitor(idem.NewStore(pool), idem.JanitorConfig{BatchSize: 10})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := j.RunOnce(ctx); err != nil {
		t.Fatal(err)
	}
	for name, index := range map[string]string{
		"DeleteKeysExpiredAgo":        "idem_keys_expires_at",
		"DeleteProcessedEventsBefore": "idem_processed_events_processed_at",
		"DeletePublishedOutbox":       "idem_outbox_published",
		"DeleteDeadLettersBefore":     "idem_dead_letters_created_at",
	} {
		q, ok := captured[name]
		if !ok {
			t.Errorf("the janitor never ran %s", name)
			continue
		}
		nodes := explain(t, pool, q)
		var usesIndex bool
		for _, n := range nodes {
			if n.Type == "Seq Scan" || n.Type == "Sort" {
				t.Errorf("%s: plan has a %s (on %s):\n%s", name, n.Type, n.Relation, q.sql)
			}
			usesIndex = usesIndex || n.Index == index
		}
		if !usesIndex {
			t.Errorf("%s: plan does not read %s; nodes: %+v", name, index, nodes)
		}
	}
}

type capturedQuery struct {
	sql  string
	args []any
}

type planNode struct{ Type, Relation, Index string }

// explain returns the plan nodes of q, explained inside a transaction that
// is rolled back (EXPLAIN without ANALYZE runs nothing anyway).
func explain(t *testing.T, pool *pgxpool.Pool, q capturedQuery) []planNode {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SET LOCAL enable_seqscan = off`); err != nil {
		t.Fatal(err)
	}
	var out []byte
	if err := tx.QueryRow(ctx, "EXPLAIN (FORMAT JSON) "+q.sql, q.args...).Scan(&out); err != nil {
		t.Fatalf("explain: %v", err)
	}
	var plans []struct{ Plan json.RawMessage }
	if err := json.Unmarshal(out, &plans); err != nil {
		t.Fatal(err)
	}
	var nodes []planNode
	var walk func(raw json.RawMessage)
	walk = func(raw json.RawMessage) {
		var n struct {
			NodeType string            `json:"Node Type"`
			Relation string            `json:"Relation Name"`
			Index    string            `json:"Index Name"`
			Plans    []json.RawMessage `json:"Plans"`
		}
		if err := json.Unmarshal(raw, &n); err != nil {
			t.Fatal(err)
		}
		nodes = append(nodes, planNode{n.NodeType, n.Relation, n.Index})
		for _, p := range n.Plans {
			walk(p)
		}
	}
	walk(plans[0].Plan)
	return nodes
}

// queryName is the sqlc name of a query: its first line is "-- name: X :kind".
func queryName(sql string) string {
	f := strings.Fields(sql)
	if len(f) >= 3 && f[0] == "--" && f[1] == "name:" {
		return f[2]
	}
	return ""
}

type queryStart struct{ fn func(sql string, args []any) }

func (q *queryStart) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	q.fn(d.SQL, d.Args)
	return ctx
}
func (q *queryStart) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

type queryEnd struct{ fn func(sql string) }

type sqlKey struct{}

func (q *queryEnd) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, sqlKey{}, d.SQL)
}
func (q *queryEnd) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	if sql, _ := ctx.Value(sqlKey{}).(string); d.Err == nil {
		q.fn(sql)
	}
}

// BenchmarkJanitor measures retention at scale. Before the timed loop it
// seeds JANITOR_ROWS old rows (default 20000; the README's figure uses
// 1000000), split evenly over the four kinds, plus as many rows that must be
// kept, and times one run that deletes every old row (reported as purge_s
// and rows/s), then one run that finds nothing right after it
// (idle_before_vacuum_us). The timed loop, after a VACUUM, is the steady
// state: a run that finds nothing to delete among the kept rows, which the
// janitor pays every interval.
//
//	JANITOR_ROWS=1000000 go test ./runtime/idem -run '^$' -bench Janitor -benchtime 20x
func BenchmarkJanitor(b *testing.B) {
	rows := 20000
	if s := os.Getenv("JANITOR_ROWS"); s != "" {
		var err error
		if rows, err = strconv.Atoi(s); err != nil {
			b.Fatalf("JANITOR_ROWS: %v", err)
		}
	}
	pool := migrated(b)
	seedRetention(b, pool, "old", rows/4, true)
	seedRetention(b, pool, "new", rows/4, false)
	pgtest.Exec(b, pool, `VACUUM ANALYZE`)
	j, err := idem.NewJanitor(idem.NewStore(pool), idem.JanitorConfig{})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	start := time.Now()
	run, err := j.RunOnce(ctx)
	purge := time.Since(start)
	if err != nil || run.Deleted() != int64(rows/4*4) {
		b.Fatalf("purge run = %+v, %v; want %d deleted", run, err, rows/4*4)
	}
	// The first idle run right after the purge still steps over the purged
	// rows' dead index entries; then vacuum (autovacuum's job) and time the
	// steady state.
	start = time.Now()
	if r, err := j.RunOnce(ctx); err != nil || r.Deleted() != 0 {
		b.Fatalf("idle run = %+v, %v", r, err)
	}
	beforeVacuum := time.Since(start)
	pgtest.Exec(b, pool, `VACUUM ANALYZE`)
	b.ResetTimer()
	for b.Loop() {
		if r, err := j.RunOnce(ctx); err != nil || r.Deleted() != 0 {
			b.Fatalf("idle run = %+v, %v", r, err)
		}
	}
	b.StopTimer()
	idle := b.Elapsed() / time.Duration(b.N)
	b.ReportMetric(purge.Seconds(), "purge_s")
	b.ReportMetric(float64(run.Deleted())/purge.Seconds(), "rows/s")
	b.ReportMetric(float64(run.Batches), "batches")
	b.ReportMetric(float64(beforeVacuum.Microseconds()), "idle_before_vacuum_us")
	b.Logf("rows=%d deleted=%d in %d batches: purge %v (%.0f rows/s); idle run over %d kept rows: %v before vacuum, %v after; purge/idle = %.0fx",
		rows, run.Deleted(), run.Batches, purge.Round(time.Millisecond), float64(run.Deleted())/purge.Seconds(),
		rows/4*4, beforeVacuum.Round(time.Microsecond), idle, float64(purge)/float64(idle))
}
