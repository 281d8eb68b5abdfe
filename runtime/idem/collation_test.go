package idem_test

import (
	"bytes"
	"context"
	"net/http"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/internal/db"
)

// keyColumns are the text columns of the two primary keys every request
// and every consumed record descends (templates/schema.sql).
const keyColumns = `(attrelid = 'idem_keys'::regclass AND attname IN ('scope', 'principal', 'key'))
	OR (attrelid = 'idem_processed_events'::regclass AND attname IN ('context', 'event_id'))`

// keyCollations counts the key columns whose collation is "C", and those of
// the two primary-key indexes (pg_index.indcollation: what the btree
// compares with).
func keyCollations(t *testing.T, pool *pgxpool.Pool) (columns, indexColumns int64) {
	t.Helper()
	columns = pgtest.Count(t, pool, `SELECT count(*) FROM pg_attribute a JOIN pg_collation c ON c.oid = a.attcollation
		WHERE (`+keyColumns+`) AND c.collname = 'C'`)
	indexColumns = pgtest.Count(t, pool, `SELECT count(*) FROM pg_index i, unnest(i.indcollation) AS ic(coll), pg_collation c
		WHERE i.indexrelid IN ('idem_keys_pkey'::regclass, 'idem_processed_events_pkey'::regclass) AND c.oid = ic.coll AND c.collname = 'C'`)
	return columns, indexColumns
}

// keyLookupsUseIndex explains the runtime's lookups by key: each must read
// the primary key (a collation in the query text that differed from the
// column's would make the index unusable, and the plan a scan).
func keyLookupsUseIndex(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	k := []any{"s", "p", "k"}
	for name, q := range map[string]capturedQuery{
		"ClaimKey":       {db.ClaimKey, append(k, int64(1))},
		"GetKey":         {db.GetKey, k},
		"LockExpiredKey": {db.LockExpiredKey, append(k, int64(1))},
		"AdminGetKey":    {db.AdminGetKey, k},
		"LockKeyNowait":  {db.LockKeyNowait, k},
		"DeleteKey":      {db.DeleteKey, k},
	} {
		var usesPK bool
		for _, n := range explain(t, pool, q) {
			if n.Type == "Seq Scan" {
				t.Errorf("%s: plan has a Seq Scan on %s", name, n.Relation)
			}
			usesPK = usesPK || n.Index == "idem_keys_pkey"
		}
		if !usesPK {
			t.Errorf("%s: plan does not read idem_keys_pkey", name)
		}
	}
}

// Issue 11: a fresh schema's key columns, and so their primary keys, are
// COLLATE "C" (memcmp, not strcoll, on every btree descent), and the
// runtime's lookups by key still read the primary key. Fails on the schema
// before (the database's default collation: 0 of 5).
func TestMigrateKeyColumnsCollateC(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	if cols, idx := keyCollations(t, pool); cols != 5 || idx != 5 {
		t.Fatalf(`%d of 5 key columns and %d of 5 primary-key index columns are COLLATE "C"`, cols, idx)
	}
	keyLookupsUseIndex(t, pool)
}

// Issue 11: applying the schema to tables of the version before (key
// columns in the database's collation), with a request and a consumed
// record in flight on them, neither waits for them nor changes the tables:
// Migrate returns (its DDL would queue behind their ROW EXCLUSIVE locks for
// at most 1s an attempt and retry until ctx ends), the columns keep their
// collation, neither table nor primary key is rewritten (same relfilenode),
// the transactions in flight commit, and the runtime works on the old
// tables: a first request, then its replay.
func TestMigrateKeepsOldKeyCollation(t *testing.T) {
	t.Parallel()
	old, err := os.ReadFile("testdata/schema-ed6b0ed.sql")
	if err != nil {
		t.Fatal(err)
	}
	pool := pgtest.Pool(t)
	pgtest.Exec(t, pool, string(old))
	if cols, idx := keyCollations(t, pool); cols != 0 || idx != 0 {
		t.Fatalf("the old schema has %d key columns and %d index columns in C", cols, idx)
	}
	const files = `SELECT string_agg(pg_relation_filenode(r)::text, ',' ORDER BY r::text) FROM unnest(ARRAY[
		'idem_keys', 'idem_keys_pkey', 'idem_processed_events', 'idem_processed_events_pkey']::regclass[]) AS r`
	var before string
	if err := pool.QueryRow(context.Background(), files).Scan(&before); err != nil {
		t.Fatal(err)
	}

	ctx := context.Background()
	inFlight, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer inFlight.Rollback(ctx)
	if _, err := inFlight.Exec(ctx, `INSERT INTO idem_keys (scope, principal, key, fingerprint, expires_at) VALUES ('s', '', 'in-flight', '', now() + interval '1 hour');
		INSERT INTO idem_processed_events (context, event_id, topic, kpartition, koffset) VALUES ('c', 'e', 't', 0, 0)`); err != nil {
		t.Fatal(err)
	}
	mctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	if err := idem.Migrate(mctx, pool); err != nil {
		t.Fatalf("Migrate on the old tables with a request and a record in flight: %v", err)
	}
	if err := inFlight.Commit(ctx); err != nil {
		t.Fatalf("the transaction in flight: %v", err)
	}
	if v := pgtest.Count(t, pool, `SELECT count(*) FROM idem_schema_version WHERE digest = $1`, idem.SchemaVersion()); v != 1 {
		t.Fatal("schema version not recorded")
	}
	if cols, idx := keyCollations(t, pool); cols != 0 || idx != 0 {
		t.Fatalf("Migrate changed the old tables: %d key columns and %d index columns now in C", cols, idx)
	}
	var after string
	if err := pool.QueryRow(ctx, files).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if after != before {
		t.Fatalf("tables or primary keys rewritten: filenodes %s, were %s", after, before)
	}
	keyLookupsUseIndex(t, pool)

	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount int NOT NULL)`)
	e := &env{t: t, pool: pool}
	url := serveReal(t, e.handler(idem.Endpoint{})) + "/charges"
	first := send(t, url, "k-old-table", body1)
	if first.status != http.StatusCreated {
		t.Fatalf("first request on the old tables: %d %s", first.status, first.body)
	}
	replay := send(t, url, "k-old-table", body1)
	if replay.status != http.StatusCreated || !bytes.Equal(replay.body, first.body) || e.calls.Load() != 1 {
		t.Fatalf("replay on the old tables: %d %s (first %s), %d calls", replay.status, replay.body, first.body, e.calls.Load())
	}
}
