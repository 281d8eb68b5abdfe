package idem_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/admin"
	"github.com/idemgen/idemgen/runtime/idem"
)

// TestMigrateAddsParkedAt: the outbox of the previous version (no
// parked_at), with rows and writers enqueueing, is upgraded by four
// processes migrating at once: the column is added, nullable and without
// a default (no table rewrite: same relfilenode), the rows are all there
// with parked_at NULL, and a second Migrate is a no-op. A row parked
// before the upgrade has an unknown parking time: a purge by age keeps it
// and counts it (it went by created_at, ten days ago, and deleted it).
func TestMigrateAddsParkedAt(t *testing.T) {
	t.Parallel()
	old, err := os.ReadFile("testdata/schema-70cc43b.sql")
	if err != nil {
		t.Fatal(err)
	}
	dbURL := pgtest.Schema(t)
	pool, err := pgxpool.New(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	pgtest.Exec(t, pool, string(old))
	pgtest.Exec(t, pool, `
INSERT INTO idem_schema_version (digest) VALUES ('the previous version');
INSERT INTO idem_outbox (topic, payload, status, attempts, last_error, created_at)
VALUES ('t', '', 'PARKED', 10, 'x', now() - interval '10 days'),
       ('t', '', 'PENDING', 0, NULL, now() - interval '10 days');
INSERT INTO idem_outbox (topic, payload, status, published_at) VALUES ('t', '', 'PUBLISHED', now());`)
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM pg_attribute WHERE attrelid = 'idem_outbox'::regclass AND attname = 'parked_at'`); n != 0 {
		t.Fatal("the previous version's outbox has parked_at already")
	}
	const filenode = `SELECT pg_relation_filenode('idem_outbox')::bigint`
	before := pgtest.Count(t, pool, filenode)

	stopWriters := outboxWriters(t, pool, 2)
	time.Sleep(50 * time.Millisecond)
	migrateInChildren(t, dbURL, 4, 60*time.Second)
	inserted := stopWriters()
	if t.Failed() {
		return
	}
	ctx := context.Background()
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM pg_attribute a JOIN pg_type ty ON ty.oid = a.atttypid
		WHERE a.attrelid = 'idem_outbox'::regclass AND a.attname = 'parked_at' AND NOT a.attisdropped
		  AND ty.typname = 'timestamptz' AND NOT a.attnotnull AND NOT a.atthasdef`); n != 1 {
		t.Fatal("parked_at not added as a nullable timestamptz without a default")
	}
	if v := pgtest.Count(t, pool, `SELECT count(*) FROM idem_schema_version WHERE digest = $1`, idem.SchemaVersion()); v != 1 {
		t.Fatal("schema version not recorded")
	}
	if after := pgtest.Count(t, pool, filenode); after != before {
		t.Errorf("idem_outbox rewritten: filenode %d, was %d", after, before)
	}
	if rows, want := pgtest.Count(t, pool, `SELECT count(*) FROM idem_outbox WHERE parked_at IS NULL`), 3+inserted; rows != want {
		t.Errorf("%d rows with parked_at NULL, want all %d", rows, want)
	}

	a := admin.New(pool)
	weekAgo := time.Now().Add(-7 * 24 * time.Hour)
	if n, err := a.PurgeOutbox(ctx, admin.StatusParked, weekAgo, 1000); err != nil || n != 0 {
		t.Errorf("purge of rows parked a week ago deleted %d (%v), want 0: the row's parking time is unknown", n, err)
	}
	if n, err := a.CountParkedUnknownTime(ctx); err != nil || n != 1 {
		t.Errorf("%d parked rows of unknown parking time (%v), want 1", n, err)
	}
	evs, err := a.ParkedEvents(ctx, admin.OutboxFilter{}, 10)
	if err != nil || len(evs) != 1 || !evs[0].ParkedAt.IsZero() {
		t.Errorf("parked listing after the upgrade: %+v, %v", evs, err)
	}
}
