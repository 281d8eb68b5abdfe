package idem_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// Outside review (revrt). A COMMIT that went through on the server, whose
// session the server then ended before answering: committed locally, it
// waits for a synchronous standby that never comes, and the backend is
// terminated during that wait (WARNING "canceling wait for synchronous
// replication", FATAL 57P01). The processor sees a COMMIT whose session
// ended: an outage, retried on a fresh connection, where the processed-event
// row makes the retry a duplicate. Exactly once: one effect, one
// processed-event row, no dead letter, even with a budget of one attempt.
// (A private cluster: synchronous_standby_names is server-wide.)
func TestRevrtCommitLandedThenSessionEndedIsExactlyOnce(t *testing.T) {
	t.Parallel()
	cl := pgtest.PrivateCluster(t)
	pool := pgtest.PoolURL(t, cl.URL, nil)
	ctx := context.Background()
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
	p := processor(t, idem.NewStore(pool), 1)
	var calls atomic.Int64
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		calls.Add(1)
		return insertEffect(ctx, tx, e)
	})
	pgtest.SyncStandbyNamed(t, cl.URL, "phantom")
	type result struct {
		o   idem.Outcome
		err error
	}
	done := make(chan result, 1)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		o, err := processWithin(p, &h, &idem.Record{Topic: "events", Value: []byte(`{"id":"s1","amount":1}`)}, 60*time.Second)
		done <- result{o, err}
	}()
	if !pgtest.WaitSyncRep(t, cl.URL, finished) {
		r := <-done
		t.Fatalf("Process returned before its COMMIT waited for the standby: %v, %v", r.o, r.err)
	}
	if n := countOn(t, cl.URL, `SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep') s`); n != 1 {
		t.Fatalf("terminated %d sessions waiting for the standby, want 1", n)
	}
	var r result
	select {
	case r = <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("Process did not return 30s after its committed session was terminated")
	}
	pgtest.SyncStandbyNamed(t, cl.URL, "")
	if r.err != nil || (r.o != idem.Duplicate && r.o != idem.Applied) {
		t.Fatalf("Process = %v, %v; want applied (reported as a duplicate: the retry found the committed row)", r.o, r.err)
	}
	effects := countOn(t, cl.URL, `SELECT count(*) FROM effects`)
	processed := countOn(t, cl.URL, `SELECT count(*) FROM idem_processed_events`)
	dead := countOn(t, cl.URL, `SELECT count(*) FROM idem_dead_letters`)
	if effects != 1 || processed != 1 || dead != 0 || calls.Load() != 1 {
		t.Fatalf("%d effects, %d processed events, %d dead letters, %d handler calls; want 1, 1, 0, 1 (outcome %v)",
			effects, processed, dead, calls.Load(), r.o)
	}
	t.Logf("outcome %v", r.o)
}
