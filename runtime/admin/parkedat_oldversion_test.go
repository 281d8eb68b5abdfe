package admin_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/admin"
)

// TestParkedAtByOldVersionStatements: during a rolling upgrade (or after a
// rollback) a version without parked_at still parks and requeues rows, with
// statements that do not name the column. A row parked ten days ago,
// requeued by an old idemctl (parked_at kept) and parked again just now by
// an old relay showed the parking time of ten days ago, and a purge of rows
// parked more than 7 days ago deleted it: its event lost. Such a row gets
// the time of its parking now; one parked by an old relay after the upgrade
// gets it too (it had none: unknown).
func TestParkedAtByOldVersionStatements(t *testing.T) {
	t.Parallel()
	pool := migrated(t, nil)
	ctx := context.Background()
	pgtest.Exec(t, pool, `
INSERT INTO idem_outbox (topic, record_key, payload, status, attempts, last_error, created_at, parked_at)
VALUES ('t', 'reparked', '', 'PARKED', 10, 'x', now() - interval '12 days', now() - interval '10 days'),
       ('t', 'parked-after-upgrade', '', 'PUBLISHING', 0, NULL, now() - interval '12 days', NULL);`)
	// The previous version's RequeueParkedOutbox (all rows), then its
	// MarkOutboxFailed's assignments for a permanent error: neither names
	// parked_at.
	pgtest.Exec(t, pool, `
UPDATE idem_outbox SET status = 'PENDING', attempts = 0, claim_token = NULL, locked_until = NULL
WHERE status = 'PARKED';
UPDATE idem_outbox SET status = 'PUBLISHING' WHERE record_key = 'reparked';`)
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_outbox WHERE parked_at IS NOT NULL`); n != 0 {
		t.Errorf("%d rows not PARKED keep a parked_at after an old version's requeue", n)
	}
	pgtest.Exec(t, pool, `
UPDATE idem_outbox SET status = 'PARKED', attempts = attempts + 1, last_error = 'record too large', claim_token = NULL, locked_until = NULL
WHERE status = 'PUBLISHING';`)
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PARKED' AND parked_at >= now() - interval '1 minute'`); n != 2 {
		t.Errorf("%d of 2 rows parked by an old version's statement have a parked_at of their parking", n)
	}
	a := admin.New(pool)
	n, err := a.PurgeOutbox(ctx, admin.StatusParked, time.Now().Add(-7*24*time.Hour), 1000)
	if err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("purge of rows parked more than 7 days ago deleted %d rows parked just now, want 0", n)
	}
}
