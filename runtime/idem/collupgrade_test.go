package idem_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/internal/db"
)

// readmeCollationUpgrade returns the manual upgrade of the key columns'
// collation as README "Storage" gives it, so the tests run what users are
// told to run.
func readmeCollationUpgrade(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	i := strings.Index(s, "ALTER TABLE idem_keys ALTER COLUMN scope TYPE text COLLATE \"C\"")
	if i < 0 {
		t.Fatal("README has no manual collation upgrade")
	}
	start := strings.LastIndex(s[:i], "```sql\n")
	j := strings.Index(s[i:], "```")
	if start < 0 || j < 0 {
		t.Fatal("README's manual collation upgrade is not in a sql block")
	}
	return s[start+len("```sql\n") : i+j]
}

// The README's manual collation upgrade, run while replicas are up: their
// pooled connections hold the runtime's statements prepared (pgx's default
// statement cache). A statement that returns a key column had its result
// described with the column's old collation, and after the ALTER
// PostgreSQL refuses to run it ("cached plan must not change result type",
// 0A000) — once on every pooled connection. For the batch consumer that
// was every connection's next batch failing and falling back to record by
// record, logged as a failed batch (InsertProcessedEvents returns
// event_id); for the admin API an operator's key lookup failing
// (AdminGetKey returns scope, principal, key). The statements now return
// these columns with a collation of their own, so the ALTER does not change
// their result. Fails before (the batch falls back; AdminGetKey: 0A000).
func TestReadmeCollationUpgradeKeepsPreparedStatements(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	old, err := os.ReadFile("testdata/schema-ed6b0ed.sql")
	if err != nil {
		t.Fatal(err)
	}
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 1 })
	pgtest.Exec(t, pool, string(old))
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
	var logs lockedBuffer
	p, err := idem.NewProcessor(idem.NewStore(pool), idem.ProcessorConfig{
		Retry:  idem.RetryPolicy{MaxAttempts: 3, Initial: time.Millisecond, Max: 2 * time.Millisecond},
		Outage: idem.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	h := handler(insertEffect)
	batch := func(from int) {
		t.Helper()
		recs := make([]*idem.Record, 3)
		for i := range recs {
			recs[i] = &idem.Record{Topic: "events", Offset: int64(from + i),
				Value: fmt.Appendf(nil, `{"id":"e-%d","amount":1}`, from+i)}
		}
		bctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		got, err := p.ProcessBatch(bctx, &h, recs)
		if err != nil || fmt.Sprint(got) != "[applied applied applied]" {
			t.Fatalf("ProcessBatch from offset %d: %v %v", from, got, err)
		}
	}
	adminGet := func() error {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		_, err = db.New(tx).AdminGetKey(ctx, db.AdminGetKeyParams{Scope: "s", Principal: "", Key: "k"})
		return err
	}
	pgtest.Exec(t, pool, `INSERT INTO idem_keys (scope, principal, key, fingerprint, expires_at) VALUES ('s', '', 'k', '', now() + interval '1 hour')`)

	// The pool's one connection prepares both statements.
	batch(0)
	if err := adminGet(); err != nil {
		t.Fatalf("AdminGetKey before the upgrade: %v", err)
	}
	if strings.Contains(logs.String(), "batch failed") {
		t.Fatalf("a batch failed before the upgrade:\n%s", logs.String())
	}

	pgtest.Exec(t, pool, readmeCollationUpgrade(t))
	if cols, idx := keyCollations(t, pool); cols != 5 || idx != 5 {
		t.Fatalf(`after the README's upgrade %d of 5 key columns and %d of 5 index columns are "C"`, cols, idx)
	}

	batch(3)
	if strings.Contains(logs.String(), "batch failed") {
		t.Errorf("the first batch after the README's upgrade failed:\n%s", logs.String())
	}
	if err := adminGet(); err != nil {
		t.Errorf("AdminGetKey after the README's upgrade: %v", err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 6 {
		t.Errorf("%d effects, want 6", n)
	}
}

// README's manual collation upgrade with a request in flight on idem_keys:
// the request's transaction holds a lock on the table from its claim to its
// COMMIT (the handler's whole run), the ALTER's ACCESS EXCLUSIVE lock
// queues behind it, and every request that arrives meanwhile queues behind
// the ALTER. The README's statements bound that wait (lock_timeout): the
// ALTER gives up with 55P03, nothing is changed, and new requests go
// through. Fails before: the README's statements had no bound, so the ALTER
// (and every request behind it) waited for the request in flight, here
// until the test's 10s bound.
func TestReadmeCollationUpgradeBoundedByRequestInFlight(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	old, err := os.ReadFile("testdata/schema-ed6b0ed.sql")
	if err != nil {
		t.Fatal(err)
	}
	pool := pgtest.Pool(t)
	pgtest.Exec(t, pool, string(old))
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	inFlight, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer inFlight.Rollback(ctx)
	// ClaimKey's read: ACCESS SHARE on idem_keys until the request ends.
	if _, err := db.New(inFlight).GetKey(ctx, db.GetKeyParams{Scope: "s", Principal: "", Key: "in-flight"}); err == nil || !strings.Contains(err.Error(), "no rows") {
		t.Fatalf("GetKey in flight: %v", err)
	}

	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	actx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err = conn.Exec(actx, readmeCollationUpgrade(t))
	if sqlState(err) != "55P03" {
		t.Fatalf("README's upgrade with a request in flight: %v, want a lock timeout (55P03)", err)
	}
	if cols, idx := keyCollations(t, pool); cols != 0 || idx != 0 {
		t.Fatalf("the upgrade that gave up changed %d key columns and %d index columns", cols, idx)
	}
	if err := inFlight.Commit(ctx); err != nil {
		t.Fatalf("the request in flight: %v", err)
	}
	// Nothing else in flight: it goes through.
	if _, err := conn.Exec(ctx, readmeCollationUpgrade(t)); err != nil {
		t.Fatalf("README's upgrade with nothing in flight: %v", err)
	}
	if cols, idx := keyCollations(t, pool); cols != 5 || idx != 5 {
		t.Fatalf(`after the README's upgrade %d of 5 key columns and %d of 5 index columns are "C"`, cols, idx)
	}
}

// README "Storage": a user's query joining idem_processed_events.event_id
// (COLLATE "C" since the key columns' change) to a text column of their
// own compares under "C", so the index on their column (the database's
// collation) cannot serve the join and their table is read whole; the
// README's form, COLLATE "default" on the key column, reads it through
// their index. Fails before: README said only that such joins "still
// compare, under "C"", and gave no form that keeps the user's index.
func TestUserJoinToKeyColumnUsesUserIndex(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	i := strings.Index(s, "JOIN orders o ON o.event_id = p.event_id COLLATE \"default\"")
	if i < 0 {
		t.Fatal(`README has no join of a user's column to event_id COLLATE "default"`)
	}
	start := strings.LastIndex(s[:i], "```sql\n")
	end := strings.Index(s[i:], "```")
	if start < 0 || end < 0 {
		t.Fatal("README's join is not in a sql block")
	}
	readme := s[start+len("```sql\n") : i+end]
	pgtest.Exec(t, pool, `CREATE TABLE orders (id bigserial PRIMARY KEY, event_id text NOT NULL, amount int NOT NULL);
		CREATE INDEX orders_event_id ON orders (event_id);
		INSERT INTO orders (event_id, amount) SELECT 'e' || g, 1 FROM generate_series(1, 20000) g;
		INSERT INTO idem_processed_events (context, event_id, topic, kpartition, koffset, processed_at)
		SELECT 'billing', 'e' || g, 't', 0, g, CASE WHEN g <= 5 THEN now() ELSE now() - interval '2 days' END
		FROM generate_series(1, 20000) g;
		ANALYZE orders; ANALYZE idem_processed_events`)
	// The plans as the planner chooses them (explain's enable_seqscan=off
	// would turn the plain join's seq scan into a full index scan).
	plan := func(q string) (seqOrders, userIndex bool) {
		rows, err := pool.Query(context.Background(), "EXPLAIN "+q)
		if err != nil {
			t.Fatal(err)
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		text := strings.Join(lines, "\n")
		return strings.Contains(text, "Seq Scan on orders"), strings.Contains(text, "Index Scan using orders_event_id on orders")
	}
	plain := strings.Replace(readme, ` COLLATE "default"`, "", 1)
	if seq, idx := plan(plain); !seq || idx {
		t.Errorf("the plain join reads orders through its index (seq scan %v, index %v): README's warning is wrong\n%s", seq, idx, plain)
	}
	if seq, idx := plan(readme); seq || !idx {
		t.Errorf("README's join does not read orders through orders_event_id (seq scan %v, index %v)\n%s", seq, idx, readme)
	}
	var plainN, readmeN int64
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM (`+strings.TrimSuffix(strings.TrimSpace(plain), ";")+`) x`).Scan(&plainN); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM (`+strings.TrimSuffix(strings.TrimSpace(readme), ";")+`) x`).Scan(&readmeN); err != nil {
		t.Fatal(err)
	}
	if plainN != 5 || readmeN != 5 {
		t.Errorf("the joins return %d and %d rows, want 5 and 5", plainN, readmeN)
	}
}
