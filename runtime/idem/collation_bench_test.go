package idem_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/benchkit"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/internal/db"
)

// BenchmarkKeyCollation measures what the collation of the key columns
// (idem_keys' scope, principal, key; idem_processed_events' context,
// event_id) costs the PostgreSQL backend: the same tables, with 200k rows
// of history each (1M in long mode, IDEMBENCH_LONG), their key columns in
// the database's default collation (what tables of earlier versions have),
// in "C" (what Migrate creates now), and in "en-US-x-icu" when the server
// has ICU (a stand-in for en_US.UTF-8, which a server whose OS has no such
// locale cannot create). Each variant has its own schema and backend; per
// round they take turns, one transaction at a time, so the machine's noise
// hits all alike:
//
//   - lookup: GetKey of an existing key (one btree descent and the
//     statement around it), 50 to a batch so that the round trip's cost
//     is spread;
//   - first request: BEGIN, SetTxSettings, ClaimKey, GetKey,
//     RestoreLockTimeout, an INSERT, StoreNewKey, COMMIT, as one batch;
//   - record: BEGIN, InsertProcessedEvent, an INSERT, CheckOwnTransaction,
//     COMMIT, as one batch.
//
// The connections run with synchronous_commit=off: the WAL flush of each
// COMMIT is the same for all variants and only adds noise. It prints µs of
// backend CPU per statement or transaction, each round's values, and the
// median over rounds of each variant's ratio to "C" in the same round. Run:
//
//	go test ./runtime/idem -run '^$' -bench BenchmarkKeyCollation -benchtime 1x
//
// Against another server or database (one created with an en_US.UTF-8 or
// ICU default collation, say), set DATABASE_URL.
func BenchmarkKeyCollation(b *testing.B) {
	ctx := context.Background()
	rows := benchkit.Pick(200_000, 1_000_000)
	collations := []string{"default", "C"}
	if pgtest.Count(b, pgtest.Pool(b), `SELECT count(*) FROM pg_collation WHERE collname = 'en-US-x-icu'`) == 1 {
		collations = append(collations, "en-US-x-icu")
	}
	type variant struct {
		collation string
		conn      *pgx.Conn
		pid       []int32
		keys      []string
		us        map[string][]float64
	}
	var vs []*variant
	for _, coll := range collations {
		pool := pgtest.Pool(b)
		if err := idem.Migrate(ctx, pool); err != nil {
			b.Fatal(err)
		}
		q := fmt.Sprintf("TYPE text COLLATE %q", coll)
		pgtest.Exec(b, pool, fmt.Sprintf(`ALTER TABLE idem_keys ALTER COLUMN scope %[1]s, ALTER COLUMN principal %[1]s, ALTER COLUMN key %[1]s;
			ALTER TABLE idem_processed_events ALTER COLUMN context %[1]s, ALTER COLUMN event_id %[1]s;
			CREATE TABLE effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount bigint NOT NULL);
			INSERT INTO idem_keys (scope, principal, key, fingerprint, status_code, headers, body, expires_at)
			SELECT 'POST /charges', '', gen_random_uuid()::text, '\x01', 201, '{}', '\x00', now() + interval '1 day'
			FROM generate_series(1, %[2]d);
			INSERT INTO idem_processed_events (context, event_id, topic, kpartition, koffset)
			SELECT 'orders', gen_random_uuid()::text, 'events', 0, g FROM generate_series(1, %[2]d) g`, q, rows))
		pgtest.Exec(b, pool, `VACUUM ANALYZE idem_keys`)
		pgtest.Exec(b, pool, `VACUUM ANALYZE idem_processed_events`)
		cfg := pool.Config().ConnConfig.Copy()
		cfg.RuntimeParams["synchronous_commit"] = "off"
		conn, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { conn.Close(context.Background()) })
		v := &variant{collation: coll, conn: conn, us: map[string][]float64{}}
		var pid int32
		if err := conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			b.Fatal(err)
		}
		v.pid = []int32{pid}
		r, _ := conn.Query(ctx, `SELECT key FROM idem_keys ORDER BY random() LIMIT 1000`)
		if v.keys, err = pgx.CollectRows(r, pgx.RowTo[string]); err != nil {
			b.Fatal(err)
		}
		vs = append(vs, v)
	}
	newID := func() string {
		u := make([]byte, 16)
		_, _ = rand.Read(u)
		return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
	}
	send := func(v *variant, bt *pgx.Batch) {
		if err := v.conn.SendBatch(ctx, bt).Close(); err != nil {
			b.Fatal(err)
		}
	}
	const lookups = 50 // per batch: the lookup's own cost, not the round trip's
	shapes := []struct {
		name string
		per  int // statements or transactions per run
		run  func(v *variant, i int)
	}{
		{"lookup", lookups, func(v *variant, i int) {
			bt := &pgx.Batch{}
			for l := range lookups {
				bt.Queue(db.GetKey, "POST /charges", "", v.keys[(i*lookups+l)%len(v.keys)])
			}
			send(v, bt)
		}},
		{"first request", 1, func(v *variant, _ int) {
			key := newID()
			bt := &pgx.Batch{}
			bt.Queue("begin")
			bt.Queue(db.SetTxSettings, "10000ms", "1000ms", "120000ms")
			bt.Queue(db.ClaimKey, "POST /charges", "", key, int64(len(key)))
			bt.Queue(db.GetKey, "POST /charges", "", key)
			bt.Queue(db.RestoreLockTimeout)
			bt.Queue(`INSERT INTO effects (order_id, amount) VALUES ($1, $2) RETURNING id`, "o-1", 100)
			bt.Queue(db.StoreNewKey, "POST /charges", "", key, []byte{1}, int32(201), []byte(`{"Location":["/x"]}`), []byte(`{"id":1}`), 86400.0)
			bt.Queue("commit")
			send(v, bt)
		}},
		{"record", 1, func(v *variant, _ int) {
			bt := &pgx.Batch{}
			bt.Queue("begin")
			bt.Queue(db.InsertProcessedEvent, "orders", newID(), "events", int32(0), int64(1), "")
			bt.Queue(`INSERT INTO effects (order_id, amount) VALUES ($1, $2) RETURNING id`, "o-1", 100)
			bt.Queue(db.CheckOwnTransaction)
			bt.Queue("commit")
			send(v, bt)
		}},
	}
	for _, v := range vs { // warm the statements, their plans and the caches
		for i := range 200 {
			for _, s := range shapes {
				s.run(v, i)
			}
		}
	}
	const rounds = 7
	n := benchkit.Pick(1000, 3000)
	for range rounds {
		for _, s := range shapes {
			spent := make([]time.Duration, len(vs))
			for i := range n {
				for j, v := range vs {
					before := benchkit.ReadCPU(v.pid).Server
					s.run(v, i)
					spent[j] += benchkit.ReadCPU(v.pid).Server - before
				}
			}
			for j, v := range vs {
				v.us[s.name] = append(v.us[s.name], float64(spent[j].Nanoseconds())/1e3/float64(n*s.per))
			}
		}
	}
	median := func(xs []float64) float64 {
		s := append([]float64(nil), xs...)
		sort.Float64s(s)
		return s[len(s)/2]
	}
	c := vs[1] // "C"
	for _, s := range shapes {
		for _, v := range vs {
			var ratios []float64
			for r := range rounds {
				ratios = append(ratios, v.us[s.name][r]/c.us[s.name][r])
			}
			vals := make([]string, rounds)
			for r, x := range v.us[s.name] {
				vals[r] = fmt.Sprintf("%.1f", x)
			}
			b.Logf("%-13s %-11s µs of backend CPU: median %.1f, rounds %s; /C median %.3f",
				s.name, v.collation, median(v.us[s.name]), strings.Join(vals, " "), median(ratios))
		}
	}
}
