package kafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemgen/idemgen/internal/faultproxy"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// Outside review (rcattack): the claim, run by readCommittedDB as BEGIN,
// the UPDATE and COMMIT pipelined, faulted between its rows and its
// COMMIT's answer. "answer lost": the server committed the claim but the
// relay never hears it (its DBTimeout ends); "terminated in commit": the
// backend dies in the claim's COMMIT (a deferred trigger sleeps in it)
// after the rows were sent. Every event is published in the end, none
// parked or charged an attempt.
func TestRCAttackClaimCommitFaults(t *testing.T) {
	for _, fault := range []string{"answer lost", "terminated in commit"} {
		t.Run(fault, func(t *testing.T) {
			addrs := cluster(t, 2, "events")
			dbURL := pgtest.Schema(t)
			pool := poolOn(t, dbURL)
			ctx := context.Background()
			if err := idem.Migrate(ctx, pool); err != nil {
				t.Fatal(err)
			}
			proxy := faultproxy.New(t, faultproxy.PostgresTarget(dbURL))
			relayPool := poolOn(t, proxy.RewriteURL(dbURL+"&application_name=rcattack_relay"))
			const lease = 2 * time.Second
			relay := newRelay(t, relayPool, publisher(t, addrs), idem.RelayConfig{PollInterval: 20 * time.Millisecond,
				Lease: lease, DBTimeout: 500 * time.Millisecond, PublishTimeout: time.Second, MaxBackoff: 300 * time.Millisecond})
			feed := newFeed(t, pool, 4)
			feed.add(5)
			startRelay(t, relay)
			waitUntil(t, "the first events to be published", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 5 })
			switch fault {
			case "answer lost":
				proxy.HoldReplies()
				feed.add(10)
				// In describe_exec mode the claim waits for its describe's
				// answer and never runs: then the fault is a silent server.
				committed := false
				for end := time.Now().Add(3 * time.Second); !committed && time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
					committed = count(t, pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PUBLISHING'`) > 0
				}
				t.Logf("claim committed while its answer was held: %v", committed)
				time.Sleep(time.Second)
				proxy.Cut()
				proxy.ReleaseReplies()
			case "terminated in commit":
				pgtest.Exec(t, pool, `CREATE TABLE rc_once (x int); INSERT INTO rc_once VALUES (1);
CREATE FUNCTION rc_slow() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN IF NEW.status = 'PUBLISHING' AND EXISTS (SELECT 1 FROM rc_once) THEN PERFORM pg_sleep(30); END IF; RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER rc_slow AFTER UPDATE ON idem_outbox DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION rc_slow()`)
				feed.add(10)
				waitUntil(t, "the claim's COMMIT to sleep", func() bool {
					return count(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND application_name = 'rcattack_relay'`) > 0
				})
				pgtest.Exec(t, pool, `DELETE FROM rc_once; SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND application_name = 'rcattack_relay'`)
			}
			feed.add(5)
			waitUntil(t, "every event to be published", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 20 })
			if c := statusCounts(t, pool); len(c) != 1 || count(t, pool, `SELECT max(attempts) FROM idem_outbox`) != 0 {
				t.Fatalf("statuses %v: want only PUBLISHED, none charged", c)
			}
			if n := count(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE application_name = 'rcattack_relay' AND state LIKE 'idle in transaction%'`); n != 0 {
				t.Fatalf("%d relay sessions idle in transaction", n)
			}
			t.Logf("%s: %d duplicate records", fault, distinctInKeyOrder(t, addrs, "events", 20, 0))
		})
	}
}
