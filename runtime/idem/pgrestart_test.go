package idem_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// A real PostgreSQL server (the test's private cluster, not a proxy)
// restarted three ways while clients keep sending keyed requests: a fast
// restart (every session ends with 57P01 admin_shutdown, commits in flight
// end either way), a crash (pg_ctl stop -m immediate, then crash recovery;
// 57P03 "starting up" while it recovers) and a stop of a few seconds
// (connection refused), plus a backend killed with SIGKILL (the postmaster
// ends every session with 57P02, recovers and reopens by itself). Each key
// is sent at once by two clients, one to each of two instances of the
// service on the database; each client retries until it gets an answer that
// is not a 503 (a 409 in flight is retried too).
//
// Afterwards: every key's effect is stored exactly once; both clients'
// final answers are the stored one (the receipt of the one effect row) and
// a replay now answers the same; at most one answer per key was a fresh
// 201, and a key answered only by replays had an attempt that said its
// outcome was unknown (a 503 saying "nothing was done" for work that
// committed would be a lie); every 503 on the way was problem+json with
// Retry-After; no 500 and no other status; no request went unanswered
// within 20s; the pools have no connection left acquired; and the engines
// kept serving after each restart without being restarted.
func TestHTTPThroughRealPostgresRestarts(t *testing.T) {
	t.Parallel()
	cl := pgtest.PrivateCluster(t)
	ctx := context.Background()
	// Two instances of the service (their own pools and engines) on the
	// one database: a key's two clients go one to each, so the second waits
	// for the key in the database (the claim's lock), not in the process.
	newPool := func() *pgxpool.Pool {
		return pgtest.PoolURL(t, cl.URL, func(c *pgxpool.Config) { c.MaxConns = 4 })
	}
	pools := []*pgxpool.Pool{newPool(), newPool()}
	pool := pools[0]
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount int NOT NULL)`)

	var logs syncBuffer
	logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	var calls atomic.Int64
	charge := func(ctx context.Context, tx pgx.Tx, req chargeReq) (receipt, error) {
		calls.Add(1)
		// A little time inside the transaction, so that restarts catch
		// requests mid-transaction and mid-commit, not only between them.
		if _, err := tx.Exec(ctx, `SELECT pg_sleep(0.003)`); err != nil {
			return receipt{}, err
		}
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO effects (order_id, amount) VALUES ($1, $2) RETURNING id`, req.Order, req.Amount).Scan(&id); err != nil {
			return receipt{}, err
		}
		return receipt{ID: id, Order: req.Order, Amount: req.Amount}, nil
	}
	var urls []string
	for _, p := range pools {
		engine, err := idem.NewHTTP(idem.NewStore(p), idem.HTTPConfig{Logger: logger})
		if err != nil {
			t.Fatal(err)
		}
		urls = append(urls, serveReal(t, idem.Handle(engine, idem.Endpoint{Scope: "pgrestart", Route: "POST /charges",
			Status: http.StatusCreated, Wait: 2 * time.Second}, charge))+"/charges")
	}

	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16}}
	t.Cleanup(client.CloseIdleConnections)
	const perRequest = 20 * time.Second // far above Wait: no answer within it is a hang
	type answer struct {
		status            int
		retryAfter, ctype string
		replayed          bool
		body              []byte
		err               error
		took              time.Duration
	}
	call := func(url, key, body string) answer {
		rctx, cancel := context.WithTimeout(ctx, perRequest)
		defer cancel()
		req, _ := http.NewRequestWithContext(rctx, http.MethodPost, url, strings.NewReader(body))
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Content-Type", "application/json")
		start := time.Now()
		resp, err := client.Do(req)
		if err != nil {
			return answer{status: -1, err: err, took: time.Since(start)}
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return answer{status: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After"), ctype: resp.Header.Get("Content-Type"),
			replayed: resp.Header.Get("Idempotent-Replayed") != "", body: b, err: err, took: time.Since(start)}
	}

	// Each key is sent by two clients at once (a retry storm in miniature:
	// the same request, same body), each retrying until it has an answer
	// that is not a 503 or 409.
	const clients = 2
	type keyRun struct {
		key, body string
		mu        sync.Mutex
		final     [clients]answer
		history   []string // per attempt: client, status, the problem's title
		// ran counts answers that were not replays (the function ran and
		// committed for that attempt); mayHaveRun: some attempt may have
		// committed without saying so (an "Outcome unknown" 503, or no
		// answer).
		ran        int
		mayHaveRun bool
	}
	var (
		mu        sync.Mutex
		runs      []*keyRun
		statuses  = map[int]int{}
		problems  []string
		completed atomic.Int64
		seq       atomic.Int64
	)
	problem := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		if len(problems) < 20 {
			problems = append(problems, fmt.Sprintf(format, args...))
		}
	}
	// client sends run's request until it has a final answer.
	sendUntilAnswered := func(run *keyRun, c int) {
		giveUp := time.Now().Add(90 * time.Second)
		for {
			a := call(urls[c], run.key, run.body)
			mu.Lock()
			statuses[a.status]++
			mu.Unlock()
			var p struct{ Title, Detail string }
			_ = json.Unmarshal(a.body, &p)
			run.mu.Lock()
			run.history = append(run.history, fmt.Sprintf("c%d: %d %s", c, a.status, p.Title))
			if a.status == http.StatusCreated && !a.replayed {
				run.ran++
			}
			if a.status == -1 || p.Title == "Outcome unknown" {
				run.mayHaveRun = true
			}
			run.mu.Unlock()
			switch {
			case a.status == -1:
				problem("%s: no answer within %v: %v", run.key, perRequest, a.err)
			case a.status == http.StatusServiceUnavailable || a.status == http.StatusConflict:
				if a.retryAfter == "" || a.ctype != "application/problem+json" {
					problem("%s: %d without Retry-After or problem+json (%q, %q): %s", run.key, a.status, a.retryAfter, a.ctype, a.body)
				}
			case a.status != http.StatusCreated:
				problem("%s: status %d: %s", run.key, a.status, a.body)
			}
			if a.status > 0 && a.status != http.StatusServiceUnavailable && a.status != http.StatusConflict {
				run.final[c] = a
				return
			}
			if time.Now().After(giveUp) {
				problem("%s: no final answer after 90s of retries", run.key)
				run.final[c] = a
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				i := seq.Add(1)
				run := &keyRun{key: fmt.Sprintf("k-%d", i)}
				run.body = fmt.Sprintf(`{"order":%q,"amount":%d}`, run.key, i)
				var both sync.WaitGroup
				for c := 0; c < clients; c++ {
					both.Go(func() { sendUntilAnswered(run, c) })
				}
				both.Wait()
				mu.Lock()
				runs = append(runs, run)
				mu.Unlock()
				if run.final[0].status == http.StatusCreated && run.final[1].status == http.StatusCreated {
					completed.Add(1)
				}
			}
		}()
	}
	stopLoad := sync.OnceFunc(func() { close(stop); wg.Wait() })
	t.Cleanup(stopLoad)

	// progress waits until n more keys completed (the service recovered by
	// itself), within a generous bound.
	progress := func(what string, n int64) {
		t.Helper()
		target := completed.Load() + n
		deadline := time.Now().Add(45 * time.Second)
		for completed.Load() < target {
			if time.Now().After(deadline) {
				mu.Lock()
				t.Errorf("after %s: %d of %d keys completed in 45s; statuses %v; problems %q", what, completed.Load(), target, statuses, problems)
				mu.Unlock()
				t.FailNow()
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	progress("warm-up", 30)
	timings := cl.Disruptions(func(name string) { progress(name, 30) })
	stopLoad()

	mu.Lock()
	defer mu.Unlock()
	t.Logf("%d keys, %d function calls, statuses %v; %s", len(runs), calls.Load(), statuses, strings.Join(timings, "; "))
	for _, p := range problems {
		t.Errorf("client saw: %s", p)
	}

	// Every key: one effect, the final answer is that effect's receipt,
	// and a replay now answers the same body.
	type effect struct {
		id     int64
		amount int
	}
	byOrder := map[string][]effect{}
	rows, err := pool.Query(ctx, `SELECT id, order_id, amount FROM effects`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var e effect
		var order string
		if err := rows.Scan(&e.id, &order, &e.amount); err != nil {
			t.Fatal(err)
		}
		byOrder[order] = append(byOrder[order], e)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(byOrder) != len(runs) {
		t.Errorf("effects for %d orders, %d keys sent", len(byOrder), len(runs))
	}
	bad := 0
	sort.Slice(runs, func(i, j int) bool { return runs[i].key < runs[j].key })
	for _, run := range runs {
		effs := byOrder[run.key]
		wrong := func(format string, args ...any) {
			bad++
			if bad <= 10 {
				t.Errorf("%s: %s (%d effects %v; history %q)", run.key, fmt.Sprintf(format, args...), len(effs), effs, run.history)
			}
		}
		if len(effs) != 1 {
			wrong("the effect is stored %d times", len(effs))
			continue
		}
		// The function ran (and said so with a fresh 201) at most once; a
		// key nobody was told ran must have had an attempt that did not
		// say "nothing was done": otherwise a 503 lied.
		if run.ran > 1 || (run.ran == 0 && !run.mayHaveRun) {
			wrong("%d fresh 201s, and an attempt with an unknown outcome: %v", run.ran, run.mayHaveRun)
		}
		for c := 0; c < clients; c++ {
			var got receipt
			err := json.Unmarshal(run.final[c].body, &got)
			if run.final[c].status != http.StatusCreated || err != nil || got.ID != effs[0].id || got.Order != run.key {
				wrong("client %d was answered %d %s", c, run.final[c].status, run.final[c].body)
			}
		}
		again := call(urls[1], run.key, run.body)
		if again.status != http.StatusCreated || !again.replayed || !bytes.Equal(bytes.TrimSpace(again.body), bytes.TrimSpace(run.final[0].body)) {
			wrong("replay after the restarts %d replayed=%v %s, the client was answered %s", again.status, again.replayed, again.body, run.final[0].body)
		}
	}
	if bad > 10 {
		t.Errorf("... %d keys wrong in all", bad)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_keys WHERE status_code = 0`); n != 0 {
		t.Errorf("%d keys left claimed without a response", n)
	}
	// Nothing left holding a connection: every request returned it.
	deadline := time.Now().Add(10 * time.Second)
	for _, p := range pools {
		for p.Stat().AcquiredConns() != 0 {
			if time.Now().After(deadline) {
				t.Errorf("%d pool connections still acquired 10s after the load ended", p.Stat().AcquiredConns())
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// What the engine logged: storage failures and unknown commits are
	// expected around a restart; a "handler failed" (a 500) is not.
	logged := logs.String()
	if strings.Contains(logged, "idempotent handler failed") {
		t.Errorf("the engine logged handler failures (500s) during restarts:\n%s", firstLines(logged, "idempotent handler failed", 5))
	}
	t.Logf("engine log: %d storage failures, %d unknown commits, %d busy; errors seen: %d 57P01, %d 57P03, %d refused",
		strings.Count(logged, "idempotency storage failed"), strings.Count(logged, "commit outcome unknown"), strings.Count(logged, "database busy"),
		strings.Count(logged, "57P01"), strings.Count(logged, "57P03"), strings.Count(logged, "connection refused"))
}

// firstLines returns up to n lines of s that contain sub.
func firstLines(s, sub string, n int) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
			if len(out) == n {
				break
			}
		}
	}
	return strings.Join(out, "\n")
}

// A COMMIT that went through on the server, whose answer never reached the
// service because the server went down right then: the transaction is
// committed locally and waits for a synchronous standby that never comes
// (synchronous_standby_names names none), and the server is restarted fast
// or crashed during that wait. The client must not be told "nothing was
// done": it is a 503 saying the outcome is unknown, and its retry with the
// key replays the committed response, the effect stored once.
func TestHTTPCommitUnansweredAcrossRestart(t *testing.T) {
	t.Parallel()
	cl := pgtest.PrivateCluster(t)
	ctx := context.Background()
	pool := pgtest.PoolURL(t, cl.URL, nil)
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount int NOT NULL)`)
	engine, err := idem.NewHTTP(idem.NewStore(pool), idem.HTTPConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	url := serveReal(t, idem.Handle(engine, idem.Endpoint{Scope: "pgrestart", Route: "POST /charges", Status: http.StatusCreated},
		func(ctx context.Context, tx pgx.Tx, req chargeReq) (receipt, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO effects (order_id, amount) VALUES ($1, $2) RETURNING id`, req.Order, req.Amount).Scan(&id)
			return receipt{ID: id, Order: req.Order, Amount: req.Amount}, err
		})) + "/charges"

	for _, mode := range []string{"fast", "immediate"} {
		key := "k-" + mode
		body := fmt.Sprintf(`{"order":%q,"amount":1}`, key)
		pgtest.SyncStandbyNamed(t, cl.URL, "phantom")
		answered := make(chan [3]string, 1)
		finished := make(chan struct{})
		go func() {
			defer close(finished)
			st, h, b := callWithin(t, 60*time.Second, "POST", url, key, body)
			answered <- [3]string{fmt.Sprint(st), h.Get("Retry-After"), b}
		}()
		if !pgtest.WaitSyncRep(t, cl.URL, finished) {
			t.Fatalf("%s: the POST was answered before its COMMIT waited for the standby: %q", mode, <-answered)
		}
		if mode == "fast" {
			cl.Restart("fast")
		} else {
			cl.Stop("immediate")
			cl.Start()
		}
		var got [3]string
		select {
		case got = <-answered:
		case <-time.After(30 * time.Second):
			t.Fatalf("%s: no answer 30s after the restart", mode)
		}
		pgtest.SyncStandbyNamed(t, cl.URL, "")
		var p struct{ Title string }
		_ = json.Unmarshal([]byte(got[2]), &p)
		if got[0] != "503" || got[1] == "" || p.Title != "Outcome unknown" {
			t.Errorf("%s: a commit that went through, its answer lost: %s Retry-After %q %s; want a 503 \"Outcome unknown\"", mode, got[0], got[1], got[2])
		}
		n := countOn(t, cl.URL, `SELECT count(*) FROM effects WHERE order_id = $1`, key)
		st, h, b := callWithin(t, 20*time.Second, "POST", url, key, body)
		var r receipt
		_ = json.Unmarshal([]byte(b), &r)
		id := countOn(t, cl.URL, `SELECT coalesce(max(id), 0) FROM effects WHERE order_id = $1`, key)
		if n != 1 || st != http.StatusCreated || h.Get("Idempotent-Replayed") == "" || r.ID != id {
			t.Errorf("%s: %d effects committed before the retry (want 1: the commit went through); retry %d replayed=%q %s, effect id %d",
				mode, n, st, h.Get("Idempotent-Replayed"), b, id)
		}
	}
}

// countOn runs a one-value query on a new connection to url (the test's
// pools may hold connections the last restart ended).
func countOn(t *testing.T, url, sql string, args ...any) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var n int64
	if err := conn.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}
