package idem_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// oneConnConsumeDB is consumeDB on a pool of one connection: every record
// runs on the connection the previous record's handler had.
func oneConnConsumeDB(t *testing.T) (*pgxpool.Pool, *idem.Store) {
	t.Helper()
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 1 })
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
	return pool, idem.NewStore(pool)
}

// A handler that set search_path at session level (to another schema with
// idemgen's tables and the same effects table: another tenant's) left it
// on the pooled connection: the next records there were deduplicated in
// that schema, so a redelivered event was applied a second time. Now the
// runtime puts search_path back before its COMMIT.
func TestHandlerSearchPathDoesNotOutliveRecord(t *testing.T) {
	t.Parallel()
	pool, store := oneConnConsumeDB(t)
	other := otherSchema(t)
	pgtest.Exec(t, pool, `ALTER TABLE `+other+`.effects ALTER COLUMN order_id DROP NOT NULL, ALTER COLUMN amount DROP NOT NULL`)
	p := processor(t, store, 3)
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		if err := insertEffect(ctx, tx, e); err != nil {
			return err
		}
		if e.Note == "switch" {
			_, err := tx.Exec(ctx, "SET search_path = "+other)
			return err
		}
		return nil
	})
	e1 := &idem.Record{Topic: "events", Offset: 1, Value: []byte(`{"id":"e1","amount":1}`)}
	e2 := &idem.Record{Topic: "events", Offset: 2, Value: []byte(`{"id":"e2","amount":1,"note":"switch"}`)}
	if o := processBounded(t, p, &h, e1); o != idem.Applied {
		t.Fatalf("e1: %v, want applied", o)
	}
	if o := processBounded(t, p, &h, e2); o != idem.Applied {
		t.Fatalf("e2: %v, want applied", o)
	}
	// e1 redelivered (a rebalance, a lost offset commit) on the same
	// pooled connection.
	if o := processBounded(t, p, &h, e1); o != idem.Duplicate {
		t.Fatalf("e1 redelivered after e2's handler set search_path: %v, want duplicate (%d effects here, %d in %s)",
			o, pgtest.Count(t, pool, "SELECT count(*) FROM effects"), pgtest.Count(t, pool, "SELECT count(*) FROM "+other+".effects"), other)
	}
	if n := pgtest.Count(t, pool, "SELECT count(*) FROM effects"); n != 2 {
		t.Fatalf("%d effects, want 2", n)
	}
}

// A handler that made default_transaction_read_only the session's left
// every later record on that pooled connection failing ("cannot execute
// INSERT in a read-only transaction"): valid records were dead-lettered.
// Now the runtime puts it back before its COMMIT.
func TestHandlerReadOnlyDefaultDoesNotOutliveRecord(t *testing.T) {
	t.Parallel()
	pool, store := oneConnConsumeDB(t)
	p := processor(t, store, 3)
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		if err := insertEffect(ctx, tx, e); err != nil {
			return err
		}
		if e.Note == "ro" {
			_, err := tx.Exec(ctx, "SET default_transaction_read_only = on")
			return err
		}
		return nil
	})
	for i, v := range []string{`{"id":"e1","amount":1,"note":"ro"}`, `{"id":"e2","amount":1}`, `{"id":"e3","amount":1}`} {
		rec := &idem.Record{Topic: "events", Offset: int64(i), Value: []byte(v)}
		if o := processBounded(t, p, &h, rec); o != idem.Applied {
			var last string
			_ = pool.QueryRow(context.Background(), "SELECT coalesce(max(last_error), '') FROM idem_dead_letters").Scan(&last)
			t.Fatalf("record %d: %v, want applied (dead letter: %s)", i, o, last)
		}
	}
}

// A temporary table named like a runtime table, committed, would hide it
// from every later record on the connection. Now the record's attempt
// fails and rolls back, which drops the table; the retry applies it.
func TestHandlerTempTableRefused(t *testing.T) {
	t.Parallel()
	pool, store := oneConnConsumeDB(t)
	p := processor(t, store, 3)
	var tries int
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		tries++
		if err := insertEffect(ctx, tx, e); err != nil {
			return err
		}
		if tries == 1 {
			_, err := tx.Exec(ctx, "CREATE TEMP TABLE idem_processed_events (LIKE idem_processed_events INCLUDING ALL)")
			return err
		}
		return nil
	})
	rec := &idem.Record{Topic: "events", Offset: 1, Value: []byte(`{"id":"e1","amount":1}`)}
	o := processBounded(t, p, &h, rec)
	if n := pgtest.Count(t, pool, "SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema() AND relname = 'idem_processed_events'"); n != 0 {
		t.Fatalf("e1: %v; a temporary idem_processed_events stays on the pooled connection", o)
	}
	if o != idem.Applied || tries != 2 {
		t.Fatalf("e1: %v after %d tries, want applied after 2", o, tries)
	}
	if n := pgtest.Count(t, pool, "SELECT count(*) FROM effects"); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
}

// A handler's session-level SET ROLE to a role without rights on the
// runtime's tables (its schema not even visible to it) stayed on the
// pooled connection: every later record there waited as a storage outage
// ("relation idem_processed_events does not exist"), no attempt used, for
// as long as the connection lived. Now the runtime puts the role back.
func TestHandlerSetRoleDoesNotOutliveRecord(t *testing.T) {
	t.Parallel()
	pool, store := oneConnConsumeDB(t)
	role := fmt.Sprintf("sess_%d", time.Now().UnixNano())
	pgtest.Exec(t, pool, "CREATE ROLE "+role)
	pgtest.Exec(t, pool, "GRANT "+role+" TO current_user")
	t.Cleanup(func() {
		c, err := pgx.Connect(context.Background(), pgtest.BaseURL())
		if err == nil {
			_, _ = c.Exec(context.Background(), "DROP ROLE IF EXISTS "+role)
			_ = c.Close(context.Background())
		}
	})
	p := processor(t, store, 3)
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		if err := insertEffect(ctx, tx, e); err != nil {
			return err
		}
		if e.Note == "role" {
			_, err := tx.Exec(ctx, "SET ROLE "+role)
			return err
		}
		return nil
	})
	for i, v := range []string{`{"id":"e1","amount":1,"note":"role"}`, `{"id":"e2","amount":1}`} {
		rec := &idem.Record{Topic: "events", Offset: int64(i), Value: []byte(v)}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		o, err := p.Process(ctx, &h, rec)
		cancel()
		if err != nil || o != idem.Applied {
			t.Fatalf("record %d after a handler's SET ROLE: %v, %v; want applied", i, o, err)
		}
	}
}
