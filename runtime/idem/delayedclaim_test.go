package idem_test

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// A claim whose simple-protocol BEGIN+claim Query is received before the
// previous row expires but runs after it expired and was purged (delayed
// here by a table lock held from another connection, standing in for a
// backend descheduled on a loaded machine): the key runs again, with a
// transaction start (now()) less than a TTL after the previous run's but a
// run time (clock_timestamp()) more than a TTL after it. This is why the
// storm tests compare run times (TestAttackStormAcrossReplicas failed in CI
// comparing transaction starts). Without the purge the stale now() makes
// the row, expired in real time, look live, and the request replays.
// (Found by an outside review of that failure.)
func TestDelayedClaimAfterPurge(t *testing.T) {
	for _, purge := range []bool{true, false} {
		t.Run(map[bool]string{true: "purged", false: "not purged"}[purge], func(t *testing.T) {
			dbURL, admin := stormSchema(t)
			ttl := time.Second
			ep := idem.Endpoint{Scope: "storm", Route: "POST /storm", TTL: ttl, Wait: 10 * time.Second}
			var calls atomic.Int64
			srv := stormReplica(t, dbURL, idem.HTTPConfig{}, ep, pgx.QueryExecModeSimpleProtocol, &calls)
			post := func() (int, int64, string) {
				req, _ := http.NewRequest(http.MethodPost, srv.URL+"/storm", strings.NewReader(`{"order":"o","amount":1}`))
				req.Header.Set("Idempotency-Key", "k")
				resp, err := srv.Client().Do(req)
				if err != nil {
					t.Error(err)
					return 0, 0, ""
				}
				defer resp.Body.Close()
				var out stormResp
				_ = json.NewDecoder(resp.Body).Decode(&out)
				return resp.StatusCode, out.ID, resp.Header.Get("Idempotent-Replayed")
			}
			if code, id, _ := post(); code != 200 || id != 1 {
				t.Fatalf("first: %d %d", code, id)
			}
			var expires time.Time
			if err := admin.QueryRow(context.Background(), `SELECT expires_at FROM idem_keys`).Scan(&expires); err != nil {
				t.Fatal(err)
			}
			lk, err := admin.Begin(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if _, err := lk.Exec(context.Background(), `LOCK TABLE idem_keys IN ACCESS EXCLUSIVE MODE`); err != nil {
				t.Fatal(err)
			}
			type res struct {
				code int
				id   int64
				rep  string
			}
			done := make(chan res, 1)
			go func() { c, id, r := post(); done <- res{c, id, r} }()
			// The claim is received (its transaction started) and waits,
			// while the row is still live.
			for pgtest.Count(t, admin, `SELECT count(*) FROM pg_stat_activity
				WHERE application_name = $1 AND wait_event_type = 'Lock' AND query LIKE '%ClaimKey%'`, stormApp(t)) == 0 {
				if time.Now().After(expires) {
					t.Fatal("the claim did not wait on the table lock before the row expired")
				}
				time.Sleep(5 * time.Millisecond)
			}
			time.Sleep(time.Until(expires) + 100*time.Millisecond)
			if purge {
				ct, err := lk.Exec(context.Background(), `DELETE FROM idem_keys WHERE expires_at <= clock_timestamp()`)
				if err != nil {
					t.Fatal(err)
				}
				t.Logf("purged %d", ct.RowsAffected())
			}
			if err := lk.Commit(context.Background()); err != nil {
				t.Fatal(err)
			}
			r := <-done
			t.Logf("second: %d id %d replayed %q", r.code, r.id, r.rep)
			rows, err := admin.Query(context.Background(), `SELECT id, tx_start, ran_at FROM storm_effects ORDER BY id`)
			if err != nil {
				t.Fatal(err)
			}
			var starts, rans []time.Time
			for rows.Next() {
				var id int64
				var s, ra time.Time
				if err := rows.Scan(&id, &s, &ra); err != nil {
					t.Fatal(err)
				}
				starts, rans = append(starts, s), append(rans, ra)
				t.Logf("effect %d tx_start %s ran_at %s", id, s.Format(time.StampMicro), ra.Format(time.StampMicro))
			}
			t.Logf("previous row expired at %s", expires.Format(time.StampMicro))
			if purge {
				if len(starts) != 2 {
					t.Fatalf("%d effects", len(starts))
				}
				if g := starts[1].Sub(starts[0]); g >= ttl {
					t.Errorf("transaction starts %v apart, want less than the TTL %v (the claim's transaction began before the row expired)", g, ttl)
				}
				if g := rans[1].Sub(rans[0]); g < ttl {
					t.Errorf("runs %v apart, want at least the TTL %v", g, ttl)
				}
				if !starts[1].Before(expires) {
					t.Errorf("second transaction started at %s, after the row's expiry %s: the claim was not delayed", starts[1].Format(time.StampMicro), expires.Format(time.StampMicro))
				}
			} else if len(starts) != 1 || r.rep != "true" {
				t.Fatalf("expected a replay, got %d effects, %+v", len(starts), r)
			}
		})
	}
}
