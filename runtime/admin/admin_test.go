package admin_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/admin"
	"github.com/idemgen/idemgen/runtime/idem"
)

func migrated(t *testing.T, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.PoolConfig(t, configure)
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	return pool
}

// TestOutboxStatus: counts per state and the oldest pending row's age, and
// the statement reads only partial indexes: with sequential scans priced
// out, its plan has none on idem_outbox (a status page must not scan a
// table of millions of published rows).
func TestOutboxStatus(t *testing.T) {
	var mu sync.Mutex
	var statusSQL string
	pool := migrated(t, func(c *pgxpool.Config) {
		c.ConnConfig.Tracer = tracer(func(sql string) {
			if strings.Contains(sql, "name: OutboxStatus") {
				mu.Lock()
				statusSQL = sql
				mu.Unlock()
			}
		})
	})
	pgtest.Exec(t, pool, `
INSERT INTO idem_outbox (topic, payload, status, created_at) SELECT 't', '', 'PENDING', now() - interval '10 minutes' + g * interval '1 second' FROM generate_series(1, 3) g;
INSERT INTO idem_outbox (topic, payload, status, published_at) SELECT 't', '', 'PUBLISHED', now() FROM generate_series(1, 500) g;
INSERT INTO idem_outbox (topic, payload, status, last_error) VALUES ('t', '', 'PARKED', 'x');
ANALYZE idem_outbox;`)
	st, err := admin.New(pool).OutboxStatus(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if st.Pending != 3 || st.Published != 500 || st.Parked != 1 || st.Publishing != 0 {
		t.Errorf("status = %+v", st)
	}
	if st.OldestPendingAge < 9*time.Minute || st.OldestPendingAge > 10*time.Minute {
		t.Errorf("oldest pending age = %v, want ~9m59s", st.OldestPendingAge)
	}
	if st.Leader != nil {
		t.Errorf("leader = %+v with no relay running", st.Leader)
	}

	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SET LOCAL enable_seqscan = off`); err != nil {
		t.Fatal(err)
	}
	var plan []byte
	if err := tx.QueryRow(ctx, "EXPLAIN (FORMAT JSON) "+statusSQL).Scan(&plan); err != nil {
		t.Fatal(err)
	}
	var nodes []map[string]any
	var walk func(n map[string]any)
	walk = func(n map[string]any) {
		nodes = append(nodes, n)
		if ps, ok := n["Plans"].([]any); ok {
			for _, p := range ps {
				walk(p.(map[string]any))
			}
		}
	}
	var top []map[string]any
	if err := json.Unmarshal(plan, &top); err != nil {
		t.Fatal(err)
	}
	walk(top[0]["Plan"].(map[string]any))
	indexes := map[string]bool{}
	for _, n := range nodes {
		if n["Node Type"] == "Seq Scan" {
			t.Errorf("outbox status scans %v sequentially", n["Relation Name"])
		}
		if name, ok := n["Index Name"].(string); ok {
			indexes[name] = true
		}
	}
	for _, want := range []string{"idem_outbox_pending", "idem_outbox_publishing", "idem_outbox_published", "idem_outbox_parked"} {
		if !indexes[want] {
			t.Errorf("outbox status does not read %s; reads %v", want, indexes)
		}
	}
}

// TestReplayDeadLetter: a failed produce leaves the dead letter unreplayed;
// two operators replaying the same dead letter at once produce it once (the
// row is locked during the produce); after the ack it is marked replayed and
// a further replay does nothing.
func TestReplayDeadLetter(t *testing.T) {
	app := "admin-replay-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	pool := migrated(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["application_name"] = app })
	pgtest.Exec(t, pool, `INSERT INTO idem_dead_letters (context, topic, kpartition, koffset, record_key, value, header_keys, header_values, attempts, last_error)
VALUES ('billing', 'orders', 0, 7, 'k', 'v', ARRAY['idem-event-id'::bytea], ARRAY['ev-7'::bytea], 5, 'boom')`)
	a := admin.New(pool)
	ctx := context.Background()
	id := pgtest.Count(t, pool, `SELECT id FROM idem_dead_letters`)

	brokerDown := errors.New("broker down")
	if _, err := a.ReplayDeadLetter(ctx, id, func(context.Context, admin.DeadLetter) error { return brokerDown }); !errors.Is(err, brokerDown) {
		t.Fatalf("err = %v, want the produce error", err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NULL`); n != 1 {
		t.Fatal("a failed replay marked the dead letter replayed")
	}

	var produced atomic.Int32
	var got admin.DeadLetter
	entered := make(chan struct{})
	release := make(chan struct{})
	produce := func(_ context.Context, d admin.DeadLetter) error {
		if produced.Add(1) == 1 {
			close(entered)
			<-release // hold the row while the second replay starts
		}
		got = d
		return nil
	}
	results := make(chan bool, 2)
	go func() {
		ok, err := a.ReplayDeadLetter(ctx, id, produce)
		if err != nil {
			t.Error(err)
		}
		results <- ok
	}()
	<-entered
	go func() {
		ok, err := a.ReplayDeadLetter(ctx, id, produce)
		if err != nil {
			t.Error(err)
		}
		results <- ok
	}()
	// The second replay is blocked on the row lock (not producing).
	waitBlocked(t, pool, app)
	close(release)
	first, second := <-results, <-results
	if !(first != second) || produced.Load() != 1 {
		t.Fatalf("replays = %v, %v with %d produces; want exactly one replay to produce", first, second, produced.Load())
	}
	if string(got.Key) != "k" || string(got.Value) != "v" || len(got.Headers) != 1 || got.Headers[0].Key != idem.EventIDHeader || string(got.Headers[0].Value) != "ev-7" {
		t.Errorf("produced %+v, want the record with its key, value and event-id header", got)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NOT NULL`); n != 1 {
		t.Error("the replayed dead letter is not marked replayed")
	}
	if ok, err := a.ReplayDeadLetter(ctx, id, produce); ok || err != nil || produced.Load() != 1 {
		t.Errorf("replaying a replayed dead letter: %v, %v, %d produces; want nothing done", ok, err, produced.Load())
	}
}

// TestReplayDeadLetterOnPoolOfOne: a replay holds one connection at a time.
// It read the dead letter through the pool while its transaction held the
// pool's only connection, and waited forever (here: until the deadline).
func TestReplayDeadLetterOnPoolOfOne(t *testing.T) {
	pool := migrated(t, func(c *pgxpool.Config) { c.MaxConns = 1 })
	pgtest.Exec(t, pool, `INSERT INTO idem_dead_letters (context, topic, kpartition, koffset, record_key, value, attempts, last_error)
VALUES ('billing', 'orders', 0, 7, 'k', 'v', 5, 'boom')`)
	id := pgtest.Count(t, pool, `SELECT id FROM idem_dead_letters`)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var got admin.DeadLetter
	ok, err := admin.New(pool).ReplayDeadLetter(ctx, id, func(_ context.Context, d admin.DeadLetter) error {
		got = d
		return nil
	})
	if !ok || err != nil || string(got.Value) != "v" {
		t.Fatalf("replay on a pool of one: %v, %v, produced %q; want replayed", ok, err, got.Value)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NOT NULL`); n != 1 {
		t.Error("the replayed dead letter is not marked replayed")
	}
	if ok, err := admin.New(pool).ReplayDeadLetter(ctx, id+1, func(context.Context, admin.DeadLetter) error { return nil }); ok || err != nil {
		t.Errorf("replaying a dead letter that does not exist: %v, %v; want false, nil", ok, err)
	}
}

// waitBlocked waits until a session of application app waits on a lock in
// MarkDeadLetterReplayed. (Not any session of the database: it is shared
// with other tests and test runs, whose replays would end the wait early.)
func waitBlocked(t *testing.T, pool *pgxpool.Pool, app string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if pgtest.Count(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND application_name = $1 AND query LIKE '%MarkDeadLetterReplayed%'`, app) > 0 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("the second replay never waited on the row lock")
}

type tracer func(sql string)

func (f tracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	f(d.SQL)
	return ctx
}
func (f tracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestKeyByServicePrincipal: an operator names a key by the principal the
// service saw. One the runtime stores hashed (over 255 bytes, invalid UTF-8,
// or starting with "idem-sha256:") was not found by keys show, and keys
// release said "nothing to release" and left it replaying.
func TestKeyByServicePrincipal(t *testing.T) {
	pool := migrated(t, nil)
	ctx := context.Background()
	for _, principal := range []string{
		"tenant-a",
		"CN=" + strings.Repeat("very-long-distinguished-name,", 12), // 351 bytes
		"idem-sha256:impostor",
		"tenant-\xff",
	} {
		h, err := idem.NewHTTP(idem.NewStore(pool), idem.HTTPConfig{
			Principal: func(*http.Request) (string, error) { return principal, nil },
		})
		if err != nil {
			t.Fatal(err)
		}
		handler := idem.Handle(h, idem.Endpoint{Scope: "admin.principal.v1"}, func(ctx context.Context, tx pgx.Tx, req struct{}) (struct{ OK bool }, error) {
			return struct{ OK bool }{true}, nil
		})
		r := httptest.NewRequest(http.MethodPost, "/", strings.NewReader("{}"))
		r.Header.Set("Content-Type", "application/json")
		r.Header.Set("Idempotency-Key", "k1")
		w := httptest.NewRecorder()
		handler.ServeHTTP(w, r)
		if w.Code != http.StatusOK {
			t.Fatalf("principal %q: status %d: %s", principal, w.Code, w.Body)
		}
		a := admin.New(pool)
		ref := admin.KeyRef{Scope: "admin.principal.v1", Principal: principal, Key: "k1"}
		info, err := a.Key(ctx, ref)
		if err != nil {
			t.Fatalf("principal %q: Key: %v", principal, err)
		}
		if info.Principal != principal {
			t.Errorf("principal %q: KeyInfo.Principal = %q", principal, info.Principal)
		}
		if err := a.ReleaseKey(ctx, ref); err != nil {
			t.Fatalf("principal %q: ReleaseKey: %v", principal, err)
		}
		if _, err := a.Key(ctx, ref); !errors.Is(err, admin.ErrNotFound) {
			t.Errorf("principal %q: after release, Key = %v, want ErrNotFound", principal, err)
		}
	}
}
