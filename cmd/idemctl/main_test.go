package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/rogpeppe/go-internal/testscript"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/internal/faultproxy"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestMain lets the test binary act as idemctl inside scripts, so `exec
// idemctl` runs the real main, exit codes included.
func TestMain(m *testing.M) {
	testscript.Main(m, map[string]func(){
		"idemctl": main,
	})
}

// TestScripts runs testdata/script/*.txtar against real PostgreSQL: each
// script gets its own schema (with idemgen's tables) through DATABASE_URL's
// search_path, and its own in-process Kafka (kfake) at KAFKA_BROKERS with
// the topic orders.confirmed.
func TestScripts(t *testing.T) {
	testscript.Run(t, testscript.Params{
		Dir: "testdata/script",
		Setup: func(env *testscript.Env) error {
			dbURL, drop, err := newSchema()
			if err != nil {
				return err
			}
			env.Defer(drop)
			env.Setenv("DATABASE_URL", dbURL)
			passGORACE(env)
			cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders.confirmed"))
			if err != nil {
				return err
			}
			env.Defer(cluster.Close)
			env.Setenv("KAFKA_BROKERS", strings.Join(cluster.ListenAddrs(), ","))
			return nil
		},
		Cmds: scriptCmds,
	})
}

// passGORACE gives a script's idemctl (this test binary, built with -race
// under CI) the race detector options this test runs with: testscript
// starts commands with an environment of its own, without GORACE. CI sets
// atexit_sleep_ms=0 there (.ci/run), which spares the second every race
// binary otherwise sleeps on exit, a second per idemctl run.
func passGORACE(env *testscript.Env) {
	if v := os.Getenv("GORACE"); v != "" {
		env.Setenv("GORACE", v)
	}
}

var scriptCmds = map[string]func(ts *testscript.TestScript, neg bool, args []string){
	"sql":         cmdSQL,
	"holdkey":     cmdHoldKey,
	"kconsume":    cmdKConsume,
	"pgblackhole": cmdPGBlackhole,
}

// TestFaultScripts runs testdata/faults/*.txtar: idemctl against a database
// or broker that never answers. Each script's idemctl runs must end on their
// own (IDEMCTL_TIMEOUT, --timeout); the deadline below kills a hung one so
// that a regression fails the test within a minute instead of hanging it.
func TestFaultScripts(t *testing.T) {
	testscript.Run(t, testscript.Params{
		Dir:      "testdata/faults",
		Deadline: time.Now().Add(60 * time.Second),
		Setup: func(env *testscript.Env) error {
			dbURL, drop, err := newSchema()
			if err != nil {
				return err
			}
			env.Defer(drop)
			env.Setenv("DATABASE_URL", dbURL)
			passGORACE(env)
			return nil
		},
		Cmds: scriptCmds,
	})
}

// cmdPGBlackhole runs "pgblackhole": from now on DATABASE_URL goes through a
// proxy that accepts connections and never answers (a network partition).
func cmdPGBlackhole(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) != 0 {
		ts.Fatalf("usage: pgblackhole")
	}
	url := ts.Getenv("DATABASE_URL")
	p, err := faultproxy.Start(faultproxy.PostgresTarget(url))
	if err != nil {
		ts.Fatalf("pgblackhole: %v", err)
	}
	ts.Defer(func() { _ = p.Close() })
	p.Blackhole()
	ts.Setenv("DATABASE_URL", p.RewriteURL(url))
}

// newSchema creates a schema with idemgen's tables and returns a URL whose
// search_path selects it, and a function that drops it.
func newSchema() (string, func(), error) {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, pgtest.BaseURL())
	if err != nil {
		return "", nil, fmt.Errorf("connect to PostgreSQL (set DATABASE_URL): %w", err)
	}
	defer conn.Close(ctx)
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	name := "t_" + hex.EncodeToString(b)
	if _, err := conn.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{name}.Sanitize()); err != nil {
		return "", nil, err
	}
	drop := func() {
		conn, err := pgx.Connect(context.Background(), pgtest.BaseURL())
		if err != nil {
			return
		}
		defer conn.Close(context.Background())
		_, _ = conn.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{name}.Sanitize()+" CASCADE")
	}
	u, err := url.Parse(pgtest.BaseURL())
	if err != nil {
		return "", drop, err
	}
	q := u.Query()
	q.Set("search_path", name)
	u.RawQuery = q.Encode()
	pool, err := pgxpool.New(ctx, u.String())
	if err != nil {
		return "", drop, err
	}
	defer pool.Close()
	if err := idem.Migrate(ctx, pool); err != nil {
		return "", drop, err
	}
	return u.String(), drop, nil
}

// testSchema is newSchema for a test: the schema is dropped when the test
// ends, and an error creating it fails the test.
func testSchema(t *testing.T) string {
	t.Helper()
	dbURL, drop, err := newSchema()
	if drop != nil {
		t.Cleanup(drop)
	}
	if err != nil {
		t.Fatal(err)
	}
	return dbURL
}

// testSchemaConn is testSchema and the test's own connection to the
// schema (not through any proxy), closed when the test ends.
func testSchemaConn(t *testing.T) (string, *pgx.Conn) {
	t.Helper()
	dbURL := testSchema(t)
	conn, err := pgx.Connect(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return dbURL, conn
}

// cmdSQL runs "sql STATEMENT" in the script's schema and prints the result
// rows, one per line, values separated by spaces.
func cmdSQL(ts *testscript.TestScript, neg bool, args []string) {
	if len(args) != 1 {
		ts.Fatalf("usage: sql STATEMENT")
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, ts.Getenv("DATABASE_URL"))
	if err != nil {
		ts.Fatalf("sql: %v", err)
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, args[0])
	if err == nil {
		for rows.Next() {
			vals, err := rows.Values()
			if err != nil {
				ts.Fatalf("sql: %v", err)
			}
			s := make([]string, len(vals))
			for i, v := range vals {
				s[i] = fmt.Sprint(v)
			}
			fmt.Fprintln(ts.Stdout(), strings.Join(s, " "))
		}
		rows.Close()
		err = rows.Err()
	}
	if (err != nil) != neg {
		ts.Fatalf("sql %q: %v", args[0], err)
	}
}

// cmdHoldKey runs "holdkey SCOPE PRINCIPAL KEY": a request in flight on an
// expired key, as the HTTP engine runs it — a transaction that has claimed
// (taken over) the key row and not yet committed. The transaction stays open
// until the script ends.
func cmdHoldKey(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) != 3 {
		ts.Fatalf("usage: holdkey SCOPE PRINCIPAL KEY")
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, ts.Getenv("DATABASE_URL"))
	if err != nil {
		ts.Fatalf("holdkey: %v", err)
	}
	ts.Defer(func() { conn.Close(context.Background()) })
	tx, err := conn.Begin(ctx)
	if err != nil {
		ts.Fatalf("holdkey: %v", err)
	}
	tag, err := tx.Exec(ctx, `UPDATE idem_keys SET expires_at = now() + interval '1 hour'
		WHERE scope = $1 AND principal = $2 AND key = $3`, args[0], args[1], args[2])
	if err != nil || tag.RowsAffected() != 1 {
		ts.Fatalf("holdkey: claim: %v (%d rows)", err, tag.RowsAffected())
	}
}

// cmdKConsume runs "kconsume TOPIC N": reads the first N records of TOPIC
// and prints each one's key, value and headers, Go-quoted.
func cmdKConsume(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) != 2 {
		ts.Fatalf("usage: kconsume TOPIC N")
	}
	var n int
	if _, err := fmt.Sscan(args[1], &n); err != nil {
		ts.Fatalf("kconsume: %v", err)
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(strings.Split(ts.Getenv("KAFKA_BROKERS"), ",")...),
		kgo.ConsumeTopics(args[0]), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		ts.Fatalf("kconsume: %v", err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for got := 0; got < n; {
		fetches := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			ts.Fatalf("kconsume: %d of %d records after 10s", got, n)
		}
		fetches.EachRecord(func(r *kgo.Record) {
			got++
			fmt.Fprintf(ts.Stdout(), "record key=%q value=%q\n", r.Key, r.Value)
			for _, h := range r.Headers {
				fmt.Fprintf(ts.Stdout(), "  header %q=%q\n", h.Key, h.Value)
			}
		})
	}
}

// TestNoGeneratorDependencies: idemctl is the operator's binary and must not
// link the generator's golang.org/x/tools (see the package comment).
func TestNoGeneratorDependencies(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, dep := range strings.Fields(string(out)) {
		if strings.HasPrefix(dep, "golang.org/x/tools") || strings.HasPrefix(dep, "github.com/idemgen/idemgen/generator") {
			t.Errorf("idemctl links %s", dep)
		}
	}
}

// TestFlagsNotUTF8: a flag value a text column cannot hold is a usage error
// naming the flag (PostgreSQL refused the query: "invalid byte sequence for
// encoding UTF8"); a principal may be any bytes (stored hashed).
func TestFlagsNotUTF8(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://postgres@127.0.0.1:1/none") // never reached
	for _, args := range [][]string{
		{"keys", "show", "--scope", "s\xff", "--principal", "", "--key", "k"},
		{"keys", "release", "--scope", "s", "--principal", "", "--key", "k\xfe", "--yes"},
		{"deadletters", "list", "--topic", "t\xff"},
		{"outbox", "requeue", "--topic", "t\xff", "--yes"},
	} {
		var stdout, stderr strings.Builder
		code := run(context.Background(), args, &stdout, &stderr)
		if code != exitError || !strings.Contains(stderr.String(), "is not valid UTF-8 text") {
			t.Errorf("%q: exit %d, stderr %q; want exit 2 naming the flag", args, code, stderr.String())
		}
	}
}

// TestPurgeKeptParkedRowsExit1: a purge of parked rows that kept some (no
// parking time: parked by an older version) did not do all it was asked:
// exit 1, the refused outcome, with the rows it could delete deleted; its
// dry run exits 0. (purgeparkedat.txtar covers the messages.)
func TestPurgeKeptParkedRowsExit1(t *testing.T) {
	dbURL, conn := testSchemaConn(t)
	t.Setenv("DATABASE_URL", dbURL)
	if _, err := conn.Exec(context.Background(), `INSERT INTO idem_outbox (topic, payload, status, created_at, parked_at)
		VALUES ('t', '', 'PARKED', now() - interval '2 days', NULL), ('t', '', 'PARKED', now() - interval '2 days', now() - interval '2 days')`); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args []string
		code int
	}{
		{[]string{"outbox", "purge", "--parked", "--older-than", "24h"}, exitOK},
		{[]string{"outbox", "purge", "--parked", "--older-than", "24h", "--yes"}, exitRefused},
		{[]string{"outbox", "purge", "--published", "--older-than", "24h", "--yes"}, exitOK},
	} {
		var stdout, stderr strings.Builder
		if code := run(context.Background(), c.args, &stdout, &stderr); code != c.code {
			t.Errorf("%q: exit %d, want %d\nstdout: %s\nstderr: %s", c.args, code, c.code, stdout.String(), stderr.String())
		}
	}
	var left int
	if err := conn.QueryRow(context.Background(), `SELECT count(*) FROM idem_outbox WHERE parked_at IS NULL`).Scan(&left); err != nil || left != 1 {
		t.Errorf("%d rows without parked_at left (%v), want the 1 kept", left, err)
	}
}

// TestPurgeCutoffByDatabaseClock: the operator's machine two hours ahead of
// the database. parked_at and published_at are the database's clock, so
// purge --older-than 1h must not delete rows parked or published half an
// hour ago by it (the cutoff was the machine's clock less the age: it
// deleted both, and the dry run said it would).
//
// Two ways: the machine's clock as idemctl reads it (clientNow) set two
// hours ahead, and the database's clock as idemctl's statements read it
// (now(), shadowed in the test's schema) two hours behind. The latter does
// not depend on the purge reading the machine's clock through clientNow: a
// purge computing its cutoff from time.Now() directly, as it did before,
// passed the first way, the skewed clientNow unread.
func TestPurgeCutoffByDatabaseClock(t *testing.T) {
	for _, way := range []string{"machine ahead", "database behind"} {
		t.Run(way, func(t *testing.T) {
			testPurgeCutoffByDatabaseClock(t, way == "database behind")
		})
	}
}

func testPurgeCutoffByDatabaseClock(t *testing.T, dbBehind bool) {
	dbURL := testSchema(t)
	if dbBehind {
		// A now() of the schema's own, two hours behind PostgreSQL's, found
		// before pg_catalog's by a search_path that names pg_catalog after
		// the schema: what idemctl's DatabaseNow reads, and the rows below
		// are dated by.
		u, err := url.Parse(dbURL)
		if err != nil {
			t.Fatal(err)
		}
		q := u.Query()
		schema := q.Get("search_path")
		conn, err := pgx.Connect(context.Background(), dbURL)
		if err != nil {
			t.Fatal(err)
		}
		_, err = conn.Exec(context.Background(), `CREATE FUNCTION `+pgx.Identifier{schema, "now"}.Sanitize()+`() RETURNS timestamptz
			LANGUAGE sql STABLE AS $$ SELECT pg_catalog.now() - interval '2 hours' $$`)
		conn.Close(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		q.Set("search_path", schema+",pg_catalog")
		u.RawQuery = q.Encode()
		dbURL = u.String()
	} else {
		old := clientNow
		clientNow = func() time.Time { return time.Now().Add(2 * time.Hour) }
		t.Cleanup(func() { clientNow = old })
	}
	t.Setenv("DATABASE_URL", dbURL)
	conn, err := pgx.Connect(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if dbBehind {
		var skew time.Duration
		if err := conn.QueryRow(context.Background(), `SELECT pg_catalog.now() - now()`).Scan(&skew); err != nil || skew != 2*time.Hour {
			t.Fatalf("the schema's now() is %v (%v) behind PostgreSQL's, want 2h", skew, err)
		}
	}
	if _, err := conn.Exec(context.Background(), `INSERT INTO idem_outbox (topic, payload, status, parked_at, published_at)
		VALUES ('t', '', 'PARKED', now() - interval '30 minutes', NULL), ('t', '', 'PUBLISHED', NULL, now() - interval '30 minutes'),
		       ('t', '', 'PARKED', now() - interval '90 minutes', NULL)`); err != nil {
		t.Fatal(err)
	}
	for _, yes := range []string{"", "--yes"} {
		args := []string{"outbox", "purge", "--parked", "--published", "--older-than", "1h"}
		if yes != "" {
			args = append(args, yes)
		}
		var stdout, stderr strings.Builder
		if code := run(context.Background(), args, &stdout, &stderr); code != exitOK {
			t.Fatalf("%q: exit %d\nstdout: %s\nstderr: %s", args, code, stdout.String(), stderr.String())
		}
		want := []string{"1 PARKED row(s)", "0 PUBLISHED row(s)"}
		for _, w := range want {
			if !strings.Contains(stdout.String(), w) {
				t.Errorf("%q: stdout lacks %q:\n%s", args, w, stdout.String())
			}
		}
	}
	var left int
	if err := conn.QueryRow(context.Background(), `SELECT count(*) FROM idem_outbox`).Scan(&left); err != nil || left != 2 {
		t.Errorf("%d rows left (%v), want the 2 of the last hour", left, err)
	}
}

// TestPurgeInterruptedCountsWhatItDeleted: a purge interrupted (SIGINT)
// mid-way reports exactly the rows it deleted. Its batches were sent alone
// (autocommit): a cancellation as a batch finished returned the context's
// error for a batch the server had committed, and the report said 1,000
// rows fewer than were gone.
//
// The interruption lands in the third batch every time, after the server
// has done its work and before idemctl has read the answer (batchGate: a
// trigger in the test's schema holds the third batch until the test lets
// it go, and a proxy holds the server's reply while the test cancels the
// run). Two places the answer can be in flight:
//
//   - "delete": the DELETE's (a BEFORE DELETE trigger). Sent alone, the
//     DELETE was committed as it answered, but idemctl counted nothing for
//     it; in a transaction, the cancelled batch is rolled back.
//   - "commit": the COMMIT's (a deferred constraint trigger, run by the
//     commit). commitAnswered commits even when cancelled, so idemctl waits
//     for that answer and counts the batch; tx.Commit(ctx) gave up on a
//     commit the server made.
func TestPurgeInterruptedCountsWhatItDeleted(t *testing.T) {
	for _, at := range []string{"delete", "commit"} {
		t.Run(at, func(t *testing.T) { testPurgeInterrupted(t, at == "commit") })
	}
}

func testPurgeInterrupted(t *testing.T, atCommit bool) {
	g := newBatchGate(t, "purge")
	ctx := context.Background()
	conn := g.conn
	const rows = 5 * purgeBatch
	if _, err := conn.Exec(ctx, `INSERT INTO idem_outbox (topic, payload, status, parked_at)
		SELECT 't', '', 'PARKED', now() - interval '10 days' FROM generate_series(1, $1::int)`, rows); err != nil {
		t.Fatal(err)
	}
	// The purge deletes in id order, purgeBatch rows a batch: the row at
	// offset 2*purgeBatch is the first of the third batch.
	var gateRow int64
	if err := conn.QueryRow(ctx, `SELECT id FROM idem_outbox ORDER BY id OFFSET $1 LIMIT 1`, 2*purgeBatch).Scan(&gateRow); err != nil {
		t.Fatal(err)
	}
	g.gate("DELETE", gateRow, atCommit)
	r := g.interrupt([]string{"outbox", "purge", "--parked", "--older-than", "24h", "--yes"})
	want := int64(2 * purgeBatch)
	if atCommit {
		want = 3 * purgeBatch
	}
	if r.code == exitOK || !strings.Contains(r.stderr, "context canceled") {
		t.Errorf("interrupted purge: exit %d, stderr %q; want a failure saying context canceled", r.code, r.stderr)
	}
	m := regexp.MustCompile(`deleted (\d+) PARKED row\(s\)`).FindStringSubmatch(r.stdout)
	if m == nil {
		t.Fatalf("interrupted purge said no count:\nstdout: %s\nstderr: %s", r.stdout, r.stderr)
	}
	reported, _ := strconv.ParseInt(m[1], 10, 64)
	g.settled()
	var left int64
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM idem_outbox`).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if gone := rows - left; gone != reported {
		t.Errorf("interrupted purge said %q, but %d rows were deleted", m[0], gone)
	}
	if reported != want {
		t.Errorf("interrupted purge said %q, want %d rows (the batches committed when it was interrupted)", m[0], want)
	}
}

// TestShowBoundedByDefault: deadletters show of a 4 MiB poison record
// printed all of it (8 MiB as hex) to the terminal. By default each field
// is cut at 4096 bytes with its full size noted; --full prints it whole.
func TestShowBoundedByDefault(t *testing.T) {
	dbURL, conn := testSchemaConn(t)
	t.Setenv("DATABASE_URL", dbURL)
	ctx := context.Background()
	const size = 4 << 20
	if _, err := conn.Exec(ctx, `INSERT INTO idem_dead_letters (id, context, topic, kpartition, koffset, record_key, value, header_keys, header_values, attempts, last_error)
		VALUES (1, 'billing', 'orders.confirmed', 0, 7, convert_to(repeat('k', $1), 'UTF8'), convert_to(repeat('v', $1), 'UTF8'),
		        ARRAY['h'::bytea], ARRAY[decode(repeat('ff', $1), 'hex')], 3, 'boom')`, size); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr strings.Builder
	if code := run(ctx, []string{"deadletters", "show", "--id", "1"}, &stdout, &stderr); code != exitOK {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if n := stdout.Len(); n > 32<<10 {
		t.Errorf("deadletters show printed %d bytes for a record of 3 × %d bytes; want each field cut at 4096 bytes", n, size)
	}
	for _, w := range []string{
		`key:        "` + strings.Repeat("k", 4096) + `" (first 4096 of 4194304 bytes; --full shows all)` + "\n",
		`value:      "` + strings.Repeat("v", 4096) + `" (first 4096 of 4194304 bytes; --full shows all)` + "\n",
		`  "h": hex:` + strings.Repeat("ff", 4096) + ` (first 4096 of 4194304 bytes; --full shows all)` + "\n",
	} {
		if !strings.Contains(stdout.String(), w) {
			t.Errorf("stdout lacks %.60q…", w)
		}
	}
	stdout.Reset()
	if code := run(ctx, []string{"deadletters", "show", "--id", "1", "--full"}, &stdout, &stderr); code != exitOK {
		t.Fatalf("--full: exit %d: %s", code, stderr.String())
	}
	if !strings.Contains(stdout.String(), `value:      "`+strings.Repeat("v", size)+`"`+"\n") || strings.Contains(stdout.String(), "first 4096") {
		t.Errorf("--full did not print the value whole (%d bytes of output)", stdout.Len())
	}
}

// TestShowBoundsHeaderCount: deadletters show cut each header at
// --max-bytes but printed every one: a record of 200,000 small headers
// printed 5 MB. It shows the first 100 and says how many more; --full
// shows all.
func TestShowBoundsHeaderCount(t *testing.T) {
	dbURL, conn := testSchemaConn(t)
	t.Setenv("DATABASE_URL", dbURL)
	ctx := context.Background()
	const n = 200000
	if _, err := conn.Exec(ctx, `INSERT INTO idem_dead_letters (id, context, topic, kpartition, koffset, record_key, value, header_keys, header_values, attempts, last_error)
		SELECT 1, 'billing', 'orders.confirmed', 0, 7, 'k', 'v', array_agg(convert_to('h' || i, 'UTF8') ORDER BY i), array_agg(convert_to('0123456789', 'UTF8') ORDER BY i), 3, 'boom'
		FROM generate_series(1, $1) i`, n); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr strings.Builder
	if code := run(ctx, []string{"deadletters", "show", "--id", "1"}, &stdout, &stderr); code != exitOK {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if got := stdout.Len(); got > 32<<10 {
		t.Errorf("deadletters show printed %d bytes for %d headers of 10 bytes; want the first 100", got, n)
	}
	for _, w := range []string{"headers:    200000\n", `  "h1": "0123456789"` + "\n", `  "h100": "0123456789"` + "\n",
		"  … and 199900 more (first 100 of 200000 headers shown; --full shows all)\n"} {
		if !strings.Contains(stdout.String(), w) {
			t.Errorf("stdout lacks %q", w)
		}
	}
	if strings.Contains(stdout.String(), `"h101"`) {
		t.Error("header 101 shown")
	}
	stdout.Reset()
	if code := run(ctx, []string{"deadletters", "show", "--id", "1", "--full"}, &stdout, &stderr); code != exitOK {
		t.Fatalf("--full: exit %d: %s", code, stderr.String())
	}
	if !strings.Contains(stdout.String(), `  "h200000": "0123456789"`+"\n") || strings.Contains(stdout.String(), "more (first") {
		t.Errorf("--full did not print every header (%d bytes)", stdout.Len())
	}
}

// TestKeysShowBoundedByDefault: keys show printed a stored response whole,
// body and headers' JSON, however large (a 4 MiB body: 4 MiB on the
// terminal). It is bounded as deadletters show is: each field cut at 4096
// bytes with its full size noted, the first 100 headers listed, --full for
// all; the same usage errors, exit 2. And a principal stored hashed because
// it is not valid UTF-8 or holds a NUL is printed escaped, never raw.
func TestKeysShowBoundedByDefault(t *testing.T) {
	dbURL, conn := testSchemaConn(t)
	t.Setenv("DATABASE_URL", dbURL)
	ctx := context.Background()
	const size, headers = 4 << 20, 100_000
	if _, err := conn.Exec(ctx, `INSERT INTO idem_keys (scope, principal, key, fingerprint, status_code, headers, body, expires_at)
		SELECT 'pay.v1', 'tenant-a', 'big', '\x01', 200,
		       jsonb_object_agg('X-H' || lpad(i::text, 6, '0'), jsonb_build_array(repeat('h', 100))),
		       convert_to(repeat('b', $1), 'UTF8'), now() + interval '1 hour'
		FROM generate_series(1, $2) i`, size, headers); err != nil {
		t.Fatal(err)
	}
	keys := []string{"keys", "show", "--scope", "pay.v1", "--principal", "tenant-a", "--key", "big"}
	var stdout, stderr strings.Builder
	if code := run(ctx, keys, &stdout, &stderr); code != exitOK {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if n := stdout.Len(); n > 1<<20 {
		t.Errorf("keys show printed %d bytes for a body of %d bytes and %d headers; want the body cut at 4096 bytes and 100 headers listed", n, size, headers)
	}
	for _, w := range []string{
		`body:        "` + strings.Repeat("b", 4096) + `" (first 4096 of 4194304 bytes; --full shows all)` + "\n",
		"headers:     100000\n",
		`  "X-H000100": "` + strings.Repeat("h", 100) + "\"\n  … and 99900 more (first 100 of 100000 headers shown; --full shows all)\n",
	} {
		if !strings.Contains(stdout.String(), w) {
			t.Errorf("stdout lacks %.60q…", w)
		}
	}
	if strings.Contains(stdout.String(), "X-H000101") {
		t.Errorf("stdout lists a 101st header")
	}
	stdout.Reset()
	if code := run(ctx, append(keys, "--full"), &stdout, &stderr); code != exitOK {
		t.Fatalf("--full: exit %d: %s", code, stderr.String())
	}
	if out := stdout.String(); !strings.Contains(out, `body:        "`+strings.Repeat("b", size)+`"`+"\n") ||
		!strings.Contains(out, `  "X-H100000": "`+strings.Repeat("h", 100)+`"`+"\n") || strings.Contains(out, "first 4096") || strings.Contains(out, "more (first") {
		t.Errorf("--full did not print the body and every header whole (%d bytes of output)", stdout.Len())
	}

	// Usage errors, as deadletters show has them: exit 2, before the database.
	for _, c := range []struct {
		args []string
		want string
	}{
		{append(keys, "--max-bytes", "0"), "idemctl keys show: --max-bytes must be positive (--full prints every field whole)\n"},
		{append(keys, "--max-bytes", "-1"), "idemctl keys show: --max-bytes must be positive (--full prints every field whole)\n"},
		{append(keys, "--full", "--max-bytes", "10"), "idemctl keys show: choose one of --max-bytes N and --full\n"},
		{[]string{"deadletters", "show", "--id", "1", "--max-bytes", "0"}, "idemctl deadletters show: --max-bytes must be positive (--full prints every field whole)\n"},
		{[]string{"deadletters", "show", "--id", "1", "--max-bytes", "10", "--full"}, "idemctl deadletters show: choose one of --max-bytes N and --full\n"},
	} {
		var stdout, stderr strings.Builder
		if code := run(ctx, c.args, &stdout, &stderr); code != exitError || stderr.String() != c.want || stdout.Len() != 0 {
			t.Errorf("%q: exit %d, stdout %q, stderr %q; want exit 2 and %q", c.args, code, stdout.String(), stderr.String(), c.want)
		}
	}

	// Principals the runtime stores hashed (idem-sha256: and the hex SHA-256
	// of the principal's bytes): not valid UTF-8, and holding a NUL.
	for _, c := range []struct{ principal, want string }{
		{"\xfftenant\x00", `principal:   hex:ff74656e616e7400 (stored as "idem-sha256:`},
		{"ten\x00ant", `principal:   "ten\x00ant" (stored as "idem-sha256:`},
	} {
		if _, err := conn.Exec(ctx, `INSERT INTO idem_keys (scope, principal, key, fingerprint, status_code, body, expires_at)
			VALUES ('pay.v1', 'idem-sha256:' || encode(sha256($1::bytea), 'hex'), 'k', '\x01', 200, '\xff00', now() + interval '1 hour')`, []byte(c.principal)); err != nil {
			t.Fatal(err)
		}
		var stdout, stderr strings.Builder
		if code := run(ctx, []string{"keys", "show", "--scope", "pay.v1", "--principal", c.principal, "--key", "k"}, &stdout, &stderr); code != exitOK {
			t.Fatalf("principal %q: exit %d: %s", c.principal, code, stderr.String())
		}
		if out := stdout.String(); !strings.Contains(out, c.want) || !strings.Contains(out, "body:        hex:ff00\n") || strings.ContainsAny(out, "\x00\xff") {
			t.Errorf("principal %q: stdout %q; want %q…, the body as hex, no raw byte", c.principal, out, c.want)
		}
	}
}
