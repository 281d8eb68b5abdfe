package idem_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/benchkit"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/internal/db"
)

// httpBench is the three handlers the HTTP benchmark compares, on one pool.
type httpBench struct {
	pool  *pgxpool.Pool
	bare  http.Handler
	idemH http.Handler
}

// newHTTPBench builds, on a fresh schema:
//
//   - bare:  a handler that decodes the JSON, INSERTs in its own
//     transaction (pool.Begin, INSERT … RETURNING, Commit: 3 round trips)
//     and encodes the response;
//   - idemH: the idempotent handler (default HTTPConfig) around the same
//     INSERT.
func newHTTPBench(b *testing.B, configure func(*pgxpool.Config)) *httpBench {
	pool := pgtest.PoolConfig(b, func(c *pgxpool.Config) {
		if os.Getenv("BENCH_ASYNC_COMMIT") != "" {
			c.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
		}
		configure(c)
	})
	ctx := context.Background()
	if err := idem.Migrate(ctx, pool); err != nil {
		b.Fatal(err)
	}
	pgtest.Exec(b, pool, `CREATE TABLE IF NOT EXISTS effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount int NOT NULL)`)
	insert := func(ctx context.Context, tx pgx.Tx, req chargeReq) (receipt, error) {
		var id int64
		err := tx.QueryRow(ctx, `INSERT INTO effects (order_id, amount) VALUES ($1, $2) RETURNING id`, req.Order, req.Amount).Scan(&id)
		return receipt{ID: id, Order: req.Order, Amount: req.Amount}, err
	}
	bare := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req chargeReq
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		tx, err := pool.Begin(r.Context())
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		defer tx.Rollback(r.Context())
		resp, err := insert(r.Context(), tx, req)
		if err == nil {
			err = tx.Commit(r.Context())
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(resp)
	})
	engine, err := idem.NewHTTP(idem.NewStore(pool), idem.HTTPConfig{})
	if err != nil {
		b.Fatal(err)
	}
	return &httpBench{pool: pool, bare: bare,
		idemH: idem.Handle(engine, idem.Endpoint{Scope: "bench", Route: "POST /charges", Status: 201}, insert)}
}

func (hb *httpBench) call(b *testing.B, h http.Handler, key string) {
	if r := do(h, key, body1); r.status != http.StatusCreated {
		b.Fatalf("key %q: status %d: %s", key, r.status, r.body)
	}
}

// BenchmarkHTTPSideBySide compares, on one pool of 8 connections and one
// PostgreSQL (fsync on unless BENCH_ASYNC_COMMIT is set):
//
//   - bare:        the plain handler (see newHTTPBench);
//   - first:       the idempotent handler on a new key, same INSERT;
//   - replay:      the idempotent handler on completed keys, each request
//     on a key no other request in flight uses;
//   - replay-same: every request on one completed key.
//
// For each concurrency (1, 8, 64 workers, each sending its next request
// when the last is answered) it runs rounds in which every kind runs the
// same number of requests, one kind after the other, so that machine noise
// hits all of them alike; it reports throughput and p50/p99 latency, and the
// ratios. The handlers are called directly (httptest), without a network
// hop, so the figures are the engine's cost, not net/http's.
//
// Then, on a pool of one connection dialed through a counting net.Conn, it
// counts round trips per request on the wire (statement cache warm), and
// checks whether a replay writes: the WAL position before and after, and
// whether the replayed row was locked (xmax set).
//
// Run: go run ./cmd/idembench -only http (or go test ./runtime/idem -run '^$' -bench HTTPSideBySide -benchtime 1x)
func BenchmarkHTTPSideBySide(b *testing.B) {
	hb := newHTTPBench(b, func(c *pgxpool.Config) { c.MaxConns = 8 })
	if n := benchkit.History(); n > 0 {
		pgtest.Exec(b, hb.pool, fmt.Sprintf(`INSERT INTO idem_keys (scope, principal, key, fingerprint, status_code, body, expires_at)
			SELECT 'bench', '', 'h-' || i, '\x00'::bytea, 201, '\x00'::bytea, now() + interval '1 day' FROM generate_series(1, %d) i`, n))
		pgtest.Exec(b, hb.pool, `VACUUM ANALYZE idem_keys`)
	}
	const replayKeys = 1024
	for i := range replayKeys {
		hb.call(b, hb.idemH, fmt.Sprintf("r-%d", i))
	}
	hb.call(b, hb.idemH, "same")
	// The pool's 8 backends, whose CPU time is read around each phase.
	pids, err := benchkit.BackendPIDs(context.Background(), hb.pool, 8)
	if err != nil {
		b.Fatal(err)
	}

	for _, c := range []int{1, 8, 64} {
		rounds := benchkit.Pick(2, 6)
		n := benchkit.Pick(map[int]int{1: 400, 8: 600, 64: 1200}, map[int]int{1: 1000, 8: 3000, 64: 6000})[c]
		r := hb.rounds(b, pids, c, n, rounds, []string{"bare", "first", "replay", "replay-same"}, replayKeys)
		thr, p50, p99, cpu := r.thr, r.p50, r.p99, r.cpu
		detail := func(a, z string) string {
			return fmt.Sprintf("%s %.0f/s p50 %.2fms p99 %.2fms; %s %.0f/s p50 %.2fms p99 %.2fms",
				a, thr[a], benchkit.Ms(p50[a]), benchkit.Ms(p99[a]), z, thr[z], benchkit.Ms(p50[z]), benchkit.Ms(p99[z]))
		}
		sec := fmt.Sprintf("HTTP c=%d", c) + benchkit.HistoryLabel()
		latTarget, thrTarget := "", ""
		if c == 1 {
			latTarget = "≤ 1.25"
		}
		if c == 64 {
			thrTarget = "≥ 0.85"
		}
		benchkit.Emit(benchkit.Row{Section: sec, Name: "first/bare latency p50", Unit: "ratio", Target: latTarget,
			Value: float64(p50["first"]) / float64(p50["bare"]), Detail: detail("bare", "first")})
		benchkit.Emit(benchkit.Row{Section: sec, Name: "first/bare latency p99", Unit: "ratio",
			Value: float64(p99["first"]) / float64(p99["bare"])})
		benchkit.Emit(benchkit.Row{Section: sec, Name: "first/bare throughput", Unit: "ratio", Target: thrTarget,
			Value: thr["first"] / thr["bare"]})
		benchkit.Emit(benchkit.Row{Section: sec, Name: "replay/first latency p50", Unit: "ratio",
			Value: float64(p50["replay"]) / float64(p50["first"]), Detail: detail("replay", "replay-same")})
		benchkit.Emit(benchkit.Row{Section: sec, Name: "replay/first throughput", Unit: "ratio",
			Value: thr["replay"] / thr["first"]})
		perReq := func(k string) (client, server float64) {
			ops := float64(n * rounds)
			return float64(cpu[k].Client.Microseconds()) / ops, float64(cpu[k].Server.Microseconds()) / ops
		}
		bc, bs := perReq("bare")
		fc, fs := perReq("first")
		rc, rs := perReq("replay")
		benchkit.Emit(benchkit.Row{Section: sec, Name: "first/bare CPU per request", Unit: "ratio",
			Value:  (fc + fs) / (bc + bs),
			Detail: fmt.Sprintf("µs of CPU per request, client + PostgreSQL backends: bare %.0f + %.0f, first %.0f + %.0f, replay %.0f + %.0f", bc, bs, fc, fs, rc, rs)})
		if c > 1 {
			benchkit.Emit(benchkit.Row{Section: sec, Name: "same-key/distinct-key replay throughput", Unit: "ratio", Target: "≥ 0.95",
				Value: thr["replay-same"] / thr["replay"]})
		}
		b.ReportMetric(float64(p50["first"])/float64(p50["bare"]), fmt.Sprintf("c%d-first/bare-p50", c))
	}

	// Round trips, on a fresh pool of one connection: exact per request.
	var rt benchkit.RoundTrips
	one := newHTTPBench(b, func(c *pgxpool.Config) { c.MaxConns = 1; c.ConnConfig.DialFunc = rt.Dial })
	per := func(what func(i int)) float64 {
		for i := range 20 { // warm the statement cache
			what(-1 - i)
		}
		const ops = 50
		before := rt.Count()
		for i := range ops {
			what(i)
		}
		return float64(rt.Count()-before) / ops
	}
	bareRT := per(func(int) { one.call(b, one.bare, "") })
	firstRT := per(func(i int) { one.call(b, one.idemH, fmt.Sprintf("rt-%d-%d", b.N, i)) })
	one.call(b, one.idemH, "rt-replay")
	replayRT := per(func(int) { one.call(b, one.idemH, "rt-replay") })
	benchkit.Emit(benchkit.Row{Section: "Round trips", Name: "HTTP bare request", Unit: "round trips", Value: bareRT,
		Detail: "BEGIN │ INSERT │ COMMIT"})
	benchkit.Emit(benchkit.Row{Section: "Round trips", Name: "HTTP first request", Unit: "round trips", Value: firstRT, Target: "3",
		Detail: "BEGIN+settings+claim │ the INSERT │ StoreKey+COMMIT"})
	benchkit.Emit(benchkit.Row{Section: "Round trips", Name: "HTTP replay", Unit: "round trips", Value: replayRT, Target: "2",
		Detail: "BEGIN+settings+claim │ ROLLBACK, sent after the response: the client waits for 1"})

	// Does a replay write? WAL is server-wide: other sessions' writes count
	// too, so the byte figure is an upper bound; the row's xmax is exact
	// (a replay that locks the row leaves its transaction id there).
	ctx := context.Background()
	var xmaxAfter, walBefore, walAfter string
	q := `SELECT xmax::text FROM idem_keys WHERE key = 'rt-replay'`
	_ = one.pool.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&walBefore)
	const replays = 100
	for range replays {
		one.call(b, one.idemH, "rt-replay")
	}
	_ = one.pool.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&walAfter)
	_ = one.pool.QueryRow(ctx, q).Scan(&xmaxAfter)
	var walBytes float64
	_ = one.pool.QueryRow(ctx, `SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::float8`, walAfter, walBefore).Scan(&walBytes)
	benchkit.Emit(benchkit.Row{Section: "Round trips", Name: "HTTP replay WAL (server-wide upper bound)", Unit: "bytes/replay",
		Value: walBytes / replays, Target: "0",
		Detail: fmt.Sprintf("replayed row xmax after replays: %s (0: not locked)", xmaxAfter)})

	statementCPU(b, one.pool)
}

// httpRounds is what hb.rounds measured, by kind: throughput (requests a
// second), p50 and p99 latency, and the CPU used (this process, the
// pool's backends).
type httpRounds struct {
	thr      map[string]float64
	p50, p99 map[string]time.Duration
	cpu      map[string]benchkit.CPU
}

// noReplayKeys is rounds' replayKeys for kinds without "replay": no
// completed keys r-<i> were made, and none is asked for.
const noReplayKeys = 0

// rounds runs, rounds times, n requests of each of kinds ("bare", "first":
// a new key each, "replay": one of the replayKeys completed keys r-<i>,
// "replay-same": the completed key "same") one kind after the other, from
// c workers each sending its next request when the last is answered; pids
// are the pool's backends, whose CPU is read around each kind's run.
// replayKeys is noReplayKeys unless kinds has "replay"; then it must be
// positive (the keys r-0 … r-<replayKeys-1> completed beforehand). A kind
// not listed above fails the benchmark: it would measure nothing.
func (hb *httpBench) rounds(b *testing.B, pids []int32, c, n, rounds int, kinds []string, replayKeys int64) httpRounds {
	type kind struct {
		name string
		op   func(i int64)
	}
	var ks []kind
	for _, k := range kinds {
		var op func(i int64)
		switch k {
		case "bare":
			op = func(int64) { hb.call(b, hb.bare, "") }
		case "first":
			op = func(i int64) { hb.call(b, hb.idemH, fmt.Sprintf("f-%d-%d-%d", c, b.N, i)) }
		case "replay":
			if replayKeys <= 0 {
				b.Fatalf("rounds: kind replay with %d replay keys: complete the keys r-<i> first and pass how many", replayKeys)
			}
			op = func(i int64) { hb.call(b, hb.idemH, fmt.Sprintf("r-%d", i%replayKeys)) }
		case "replay-same":
			op = func(int64) { hb.call(b, hb.idemH, "same") }
		default:
			b.Fatalf("rounds: unknown kind %q", k)
		}
		ks = append(ks, kind{name: k, op: op})
	}
	if replayKeys != noReplayKeys && !slices.Contains(kinds, "replay") {
		b.Fatalf("rounds: %d replay keys for kinds %q without replay", replayKeys, kinds)
	}
	lat := map[string][]time.Duration{}
	wall := map[string]time.Duration{}
	cpu := map[string]benchkit.CPU{}
	var seq atomic.Int64
	for range rounds {
		for _, k := range ks {
			start, cpuStart := time.Now(), benchkit.ReadCPU(pids)
			var mu sync.Mutex
			var wg sync.WaitGroup
			var left atomic.Int64
			left.Store(int64(n))
			for range c {
				wg.Add(1)
				go func() {
					defer wg.Done()
					var mine []time.Duration
					for left.Add(-1) >= 0 {
						t := time.Now()
						k.op(seq.Add(1))
						mine = append(mine, time.Since(t))
					}
					mu.Lock()
					lat[k.name] = append(lat[k.name], mine...)
					mu.Unlock()
				}()
			}
			wg.Wait()
			wall[k.name] += time.Since(start)
			used := benchkit.ReadCPU(pids).Sub(cpuStart)
			cpu[k.name] = benchkit.CPU{Client: cpu[k.name].Client + used.Client, Server: cpu[k.name].Server + used.Server}
		}
	}
	r := httpRounds{thr: map[string]float64{}, p50: map[string]time.Duration{}, p99: map[string]time.Duration{}, cpu: cpu}
	for _, k := range ks {
		r.thr[k.name] = float64(n*rounds) / wall[k.name].Seconds()
		r.p50[k.name] = benchkit.Percentile(lat[k.name], 0.50)
		r.p99[k.name] = benchkit.Percentile(lat[k.name], 0.99)
	}
	return r
}

// statementCPU measures what the runtime's own statements cost PostgreSQL,
// without the round trips: the CPU time of a backend per transaction sent
// as ONE pipelined batch, for
//
//   - bare:    BEGIN, the benchmark's INSERT, COMMIT;
//   - runtime: BEGIN, SetTxSettings, ClaimKey, GetKey, RestoreLockTimeout,
//     the same INSERT, StoreNewKey, COMMIT — a first request's statements
//     (its three round trips squeezed into one; no LockExpiredKey, which
//     only the takeover of an expired key sends);
//
// each on a new key. The two shapes run on two connections of pool's
// configuration, each with its own backend, one transaction of each in
// turn (1,000 of each per round, 5,000 long; 5 rounds), so that the
// machine's load, which changes what a COMMIT's WAL flush costs the
// backend, hits both alike.
func statementCPU(b *testing.B, pool *pgxpool.Pool) {
	ctx := context.Background()
	connect := func() (*pgx.Conn, []int32) {
		conn, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig.Copy())
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { conn.Close(context.Background()) })
		var pid int32
		if err := conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			b.Fatal(err)
		}
		return conn, []int32{pid}
	}
	bareConn, barePID := connect()
	runtimeConn, runtimePID := connect()
	send := func(runtime bool, key string) {
		conn := bareConn
		bt := &pgx.Batch{}
		bt.Queue("begin")
		if runtime {
			conn = runtimeConn
			bt.Queue(db.SetTxSettings, "10000ms", "1000ms", "120000ms")
			bt.Queue(db.ClaimKey, "bench", "", key, int64(len(key)))
			bt.Queue(db.GetKey, "bench", "", key)
			bt.Queue(db.RestoreLockTimeout)
		}
		bt.Queue(`INSERT INTO effects (order_id, amount) VALUES ($1, $2) RETURNING id`, "o-1", 100)
		if runtime {
			bt.Queue(db.StoreNewKey, "bench", "", key, []byte{1}, int32(201), []byte(`{"Location":["/x"]}`), []byte(`{"id":1}`), 86400.0)
		}
		bt.Queue("commit")
		if err := conn.SendBatch(ctx, bt).Close(); err != nil {
			b.Fatal(err)
		}
	}
	for i := range 100 { // warm both shapes' statements and plans
		send(false, "")
		send(true, fmt.Sprintf("cpu-warm-%d-%d", b.N, i))
	}
	n := benchkit.Pick(1000, 5000)
	var bare, runtime time.Duration
	for round := range 5 {
		b0, r0 := benchkit.ReadCPU(barePID).Server, benchkit.ReadCPU(runtimePID).Server
		for i := range n {
			send(false, "")
			send(true, fmt.Sprintf("cpu-%d-%d-%d", b.N, round, i))
		}
		bare += benchkit.ReadCPU(barePID).Server - b0
		runtime += benchkit.ReadCPU(runtimePID).Server - r0
	}
	per := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 / float64(5*n) }
	benchkit.Emit(benchkit.Row{Section: "Server CPU", Name: "first request's statements/bare, one pipeline", Unit: "ratio",
		Value:  per(runtime) / per(bare),
		Detail: fmt.Sprintf("µs of backend CPU per transaction sent as one batch, interleaved on two backends: BEGIN+INSERT+COMMIT %.0f; with the runtime's 5 statements %.0f", per(bare), per(runtime))})
}

// BenchmarkOutboxAtScale measures the relay's claim of 500 PENDING rows (one
// ClaimOutboxBatch, then one MarkOutboxPublished of the same rows) on an
// empty outbox and after 1M PUBLISHED rows of history (100k unless in long
// mode), for the time-ordered event id (idem_uuid_v7, the default) and for
// the random one it replaced (gen_random_uuid): four outboxes, measured in
// turn 21 times so that the machine's noise hits all four alike; medians.
// And OutboxCounts at that history, measured the same way. Run:
// go run ./cmd/idembench -long -only storage
func BenchmarkOutboxAtScale(b *testing.B) {
	history := benchkit.Pick(100_000, 1_000_000)
	ctx := context.Background()
	token := pgtype.Text{String: "bench", Valid: true}
	type outbox struct {
		pool               *pgxpool.Pool
		claims, marks, cnt []time.Duration
	}
	setup := func(dflt string, rows int) *outbox {
		pool := pgtest.PoolConfig(b, func(c *pgxpool.Config) {
			if os.Getenv("BENCH_ASYNC_COMMIT") != "" {
				c.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
			}
		})
		if err := idem.Migrate(ctx, pool); err != nil {
			b.Fatal(err)
		}
		if dflt != "" {
			pgtest.Exec(b, pool, `ALTER TABLE idem_outbox ALTER COLUMN event_id SET DEFAULT `+dflt)
		}
		if l, err := db.New(pool).AcquireRelayLease(ctx, db.AcquireRelayLeaseParams{Name: "idem_outbox", Holder: "bench", Token: token.String, LeaseSeconds: 3600}); err != nil || !l.Acquired {
			b.Fatalf("lease: %v", err)
		}
		if rows > 0 {
			pgtest.Exec(b, pool, fmt.Sprintf(`INSERT INTO idem_outbox (topic, payload, status, published_at)
				SELECT 'events', '\x00'::bytea, 'PUBLISHED', now() FROM generate_series(1, %d)`, rows))
		}
		pgtest.Exec(b, pool, `VACUUM ANALYZE idem_outbox`)
		return &outbox{pool: pool}
	}
	once := func(o *outbox) {
		q := db.New(o.pool)
		pgtest.Exec(b, o.pool, `INSERT INTO idem_outbox (topic, payload) SELECT 'events', '\x00'::bytea FROM generate_series(1, 500)`)
		start := time.Now()
		rows, err := q.ClaimOutboxBatch(ctx, db.ClaimOutboxBatchParams{Name: "idem_outbox", BatchSize: 500, ClaimToken: token, LeaseSeconds: 60})
		if err != nil || len(rows) != 500 {
			b.Fatalf("claim: %d rows, %v", len(rows), err)
		}
		o.claims = append(o.claims, time.Since(start))
		ids := make([]int64, len(rows))
		for i, r := range rows {
			ids[i] = r.ID
		}
		start = time.Now()
		if n, err := q.MarkOutboxPublished(ctx, db.MarkOutboxPublishedParams{Ids: ids, ClaimToken: token, Name: "idem_outbox"}); err != nil || n != 500 {
			b.Fatalf("mark: %d rows, %v", n, err)
		}
		o.marks = append(o.marks, time.Since(start))
		start = time.Now()
		if _, err := idem.NewStore(o.pool).OutboxCounts(ctx); err != nil {
			b.Fatal(err)
		}
		o.cnt = append(o.cnt, time.Since(start))
	}
	v7Empty, v7Full := setup("", 0), setup("", history)
	rndEmpty, rndFull := setup("gen_random_uuid()::text", 0), setup("gen_random_uuid()::text", history)
	all := []*outbox{v7Empty, v7Full, rndEmpty, rndFull}
	for range 21 {
		for _, o := range all {
			once(o)
		}
	}
	med := func(ds []time.Duration) time.Duration { return benchkit.Percentile(ds, 0.5) }
	sec := fmt.Sprintf("Outbox, %dk history", history/1000)
	for _, v := range []struct {
		name        string
		empty, full *outbox
	}{{"time-ordered event id", v7Empty, v7Full}, {"random event id (old)", rndEmpty, rndFull}} {
		benchkit.Emit(benchkit.Row{Section: sec, Name: "claim+mark 500, history/empty, " + v.name, Unit: "ratio", Target: "≤ 1.3",
			Value: float64(med(v.full.claims)+med(v.full.marks)) / float64(med(v.empty.claims)+med(v.empty.marks)),
			Detail: fmt.Sprintf("empty: claim %.1fms mark %.1fms; history: claim %.1fms mark %.1fms; OutboxCounts %.1fms",
				benchkit.Ms(med(v.empty.claims)), benchkit.Ms(med(v.empty.marks)), benchkit.Ms(med(v.full.claims)), benchkit.Ms(med(v.full.marks)), benchkit.Ms(med(v.full.cnt)))})
	}
}
