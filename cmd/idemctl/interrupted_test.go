package main

import (
	"context"
	"crypto/rand"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/faultproxy"
)

// batchGate interrupts an idemctl command that works in committed batches
// (outbox purge, outbox requeue --all|--topic) in one batch, every time,
// after the server has done that batch's work and before idemctl has read
// the answer, without depending on timing:
//
//   - a trigger in the test's schema (gate) makes the batch's statement
//     wait, on one row, for an advisory lock the test holds: a BEFORE
//     trigger holds the statement's answer, a deferred constraint trigger
//     (run by COMMIT) the COMMIT's;
//   - idemctl's DATABASE_URL goes through a faultproxy, told to hold the
//     server's replies once the batch waits at the gate;
//   - interrupt lets the batch go on, waits for the server to have answered
//     it, cancels the run (SIGINT), and only then delivers the reply.
type batchGate struct {
	t    *testing.T
	what string // the command, in messages: "purge", "requeue"
	// conn is the test's own connection to the schema (not through the
	// proxy): it fills the table, watches idemctl's backend and checks the
	// outcome.
	conn  *pgx.Conn
	proxy *faultproxy.Proxy
	url   string // direct, for the lock holder's connection

	holder    *pgx.Conn
	holderPID uint32
	lockID    int64
	atCommit  bool
	pid       uint32 // idemctl's backend, once it waited at the gate
}

// newBatchGate creates a schema with idemgen's tables, a proxy in front of
// it set as DATABASE_URL, and the test's connection. The test fills the
// table through g.conn, then calls gate.
func newBatchGate(t *testing.T, what string) *batchGate {
	t.Helper()
	dbURL, conn := testSchemaConn(t)
	g := &batchGate{t: t, what: what, url: dbURL, conn: conn}
	g.proxy = faultproxy.New(t, faultproxy.PostgresTarget(dbURL))
	t.Setenv("DATABASE_URL", g.proxy.RewriteURL(dbURL))
	return g
}

// gate installs the trigger that stops op ("DELETE", "UPDATE") of
// idem_outbox at the row with id gateRow (the first row of the batch to
// interrupt) until interrupt lets it go: at the statement (BEFORE op), or
// with atCommit at its COMMIT (a deferred constraint trigger). It takes the
// advisory lock the trigger waits for.
func (g *batchGate) gate(op string, gateRow int64, atCommit bool) {
	t, ctx := g.t, context.Background()
	t.Helper()
	g.atCommit = atCommit
	b := make([]byte, 7)
	_, _ = rand.Read(b)
	for _, c := range b {
		g.lockID = g.lockID<<8 | int64(c)
	}
	trigger := `CREATE TRIGGER batch_gate BEFORE ` + op + ` ON idem_outbox FOR EACH ROW EXECUTE FUNCTION batch_gate()`
	if atCommit {
		trigger = `CREATE CONSTRAINT TRIGGER batch_gate AFTER ` + op + ` ON idem_outbox
			DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION batch_gate()`
	}
	if _, err := g.conn.Exec(ctx, `CREATE FUNCTION batch_gate() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF OLD.id = `+strconv.FormatInt(gateRow, 10)+` THEN
				PERFORM pg_advisory_xact_lock_shared(`+strconv.FormatInt(g.lockID, 10)+`);
			END IF;
			IF TG_OP = 'DELETE' THEN
				RETURN OLD;
			END IF;
			RETURN NEW;
		END $$;
		`+trigger); err != nil {
		t.Fatal(err)
	}
	var err error
	g.holder, err = pgx.Connect(ctx, g.url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.holder.Close(context.Background()) })
	if err := g.holder.QueryRow(ctx, `SELECT pg_backend_pid() FROM (SELECT pg_advisory_lock($1)) l`, g.lockID).Scan(&g.holderPID); err != nil {
		t.Fatal(err)
	}
}

// runResult is what one idemctl run returned and printed.
type runResult struct {
	code           int
	stdout, stderr string
}

// interrupt runs idemctl with args, interrupts it at the gate with the
// batch's answer held, as described on batchGate, and returns what it
// reported.
func (g *batchGate) interrupt(args []string) runResult {
	t, ctx := g.t, context.Background()
	t.Helper()
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan runResult, 1)
	go func() {
		var stdout, stderr strings.Builder
		code := run(rctx, args, &stdout, &stderr)
		done <- runResult{code, stdout.String(), stderr.String()}
	}()
	// poll waits up to 30s for cond, failing the test if the run ends first.
	poll := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
			select {
			case r := <-done:
				t.Fatalf("the %s ended (exit %d) before %s\nstdout: %s\nstderr: %s", g.what, r.code, what, r.stdout, r.stderr)
			default:
			}
			if time.Now().After(deadline) {
				t.Fatalf("30s and still not %s", what)
			}
		}
	}

	// The batches before are committed; this one waits at the gate.
	poll("the "+g.what+"'s backend waits at the gate", func() bool {
		err := g.conn.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))`, g.holderPID).Scan(&g.pid)
		if err != nil && err != pgx.ErrNoRows {
			t.Fatal(err)
		}
		return err == nil
	})
	g.proxy.HoldReplies()
	if _, err := g.holder.Exec(ctx, `SELECT pg_advisory_unlock($1)`, g.lockID); err != nil {
		t.Fatal(err)
	}
	poll("the server answered the gated batch", func() bool {
		var state string
		if err := g.conn.QueryRow(ctx, `SELECT coalesce(state, '') FROM pg_stat_activity WHERE pid = $1`, g.pid).Scan(&state); err != nil {
			t.Fatal(err)
		}
		return state != "active"
	})

	cancel() // SIGINT
	// A client that gives up on the batch closes its connection: it sends
	// Terminate (not held), and the backend ends.
	if g.atCommit {
		// idemctl waits for the commit's answer: nothing marks that it
		// decided to, so a client that would give up instead is given the
		// time to do so (microseconds) before the answer is delivered.
		g.backendGone(time.Second)
	} else if !g.backendGone(30 * time.Second) {
		t.Fatalf("idemctl, cancelled while its batch's answer was held, did not close its connection")
	}
	g.proxy.ReleaseReplies()
	return <-done
}

// backendGone reports whether idemctl's backend ended within the time.
func (g *batchGate) backendGone(within time.Duration) bool {
	for deadline := time.Now().Add(within); ; time.Sleep(5 * time.Millisecond) {
		var alive bool
		if err := g.conn.QueryRow(context.Background(), `SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)`, g.pid).Scan(&alive); err != nil {
			g.t.Fatal(err)
		}
		if !alive {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
	}
}

// settled waits for idemctl's backend to end after the run: what the
// interrupted batch did is final then.
func (g *batchGate) settled() {
	g.t.Helper()
	if !g.backendGone(30 * time.Second) {
		g.t.Fatalf("the %s's backend %d still runs 30s after idemctl exited", g.what, g.pid)
	}
}

// TestRequeueInterruptedCountsWhatItRequeued: outbox requeue --all or
// --topic interrupted (SIGINT) in its third batch reports exactly the rows
// its committed batches returned to PENDING, and the database agrees row
// by row: the first N selected rows in id order PENDING with a fresh
// attempt budget, every other row PARKED as it was. Exit 2 (an error, as
// the README's exit statuses say), "requeued N parked row(s) before stopping
// on an error (run it again for the rest)", and the rerun requeues the rest.
//
// As TestPurgeInterruptedCountsWhatItDeleted (batchGate), with the answer in
// flight:
//
//   - "update": the UPDATE's (a BEFORE UPDATE trigger). In the batch's
//     transaction, the cancelled batch is rolled back: 2 batches. Sent alone
//     (autocommit), the UPDATE was committed as it answered but idemctl
//     counted nothing for it.
//   - "commit": the COMMIT's (a deferred constraint trigger, run by the
//     commit). commitAnswered commits even when cancelled, so idemctl waits
//     for that answer and counts the batch: 3 batches; tx.Commit(ctx) gave
//     up on a commit the server made.
//
// Each with --all and with --topic: the rows alternate between two topics,
// so --topic's batches skip the other topic's rows, which must stay PARKED.
func TestRequeueInterruptedCountsWhatItRequeued(t *testing.T) {
	for _, at := range []string{"update", "commit"} {
		for _, sel := range []string{"all", "topic"} {
			t.Run(at+"/"+sel, func(t *testing.T) { testRequeueInterrupted(t, at == "commit", sel == "topic") })
		}
	}
}

func testRequeueInterrupted(t *testing.T, atCommit, byTopic bool) {
	g := newBatchGate(t, "requeue")
	ctx := context.Background()
	const rows = 10 * requeueBatch // topics a and b, alternating
	if _, err := g.conn.Exec(ctx, `INSERT INTO idem_outbox (topic, payload, status, attempts, last_error, parked_at)
		SELECT CASE WHEN g % 2 = 0 THEN 'a' ELSE 'b' END, '', 'PARKED', 10, 'refused', now() - interval '1 day'
		FROM generate_series(1, $1::int) g`, rows); err != nil {
		t.Fatal(err)
	}
	args := []string{"outbox", "requeue", "--all", "--yes"}
	topic, selected := "", int64(rows)
	if byTopic {
		args = []string{"outbox", "requeue", "--topic", "a", "--yes"}
		topic, selected = "a", rows/2
	}
	// The requeue goes through its selection in id order, requeueBatch
	// rows a batch: the selected row at offset 2*requeueBatch is the first
	// of the third batch.
	var gateRow int64
	if err := g.conn.QueryRow(ctx, `SELECT id FROM idem_outbox WHERE $1 = '' OR topic = $1 ORDER BY id OFFSET $2 LIMIT 1`,
		topic, 2*requeueBatch).Scan(&gateRow); err != nil {
		t.Fatal(err)
	}
	g.gate("UPDATE", gateRow, atCommit)
	r := g.interrupt(args)
	want := int64(2 * requeueBatch)
	if atCommit {
		want = 3 * requeueBatch
	}

	if r.code != exitError {
		t.Errorf("interrupted requeue: exit %d, want %d (an error)", r.code, exitError)
	}
	if !strings.HasPrefix(r.stderr, "idemctl outbox requeue: ") || !strings.Contains(r.stderr, "context canceled") ||
		strings.Count(r.stderr, "\n") != 1 || !strings.HasSuffix(r.stderr, "\n") {
		t.Errorf("interrupted requeue: stderr %q; want one line, idemctl outbox requeue: … context canceled", r.stderr)
	}
	m := regexp.MustCompile(`\Arequeued (\d+) parked row\(s\) before stopping on an error \(run it again for the rest\)\n\z`).FindStringSubmatch(r.stdout)
	if m == nil {
		t.Fatalf("interrupted requeue did not report its count as the README says:\nstdout: %q\nstderr: %s", r.stdout, r.stderr)
	}
	reported, _ := strconv.ParseInt(m[1], 10, 64)
	g.settled()
	pending, parked, misplaced := requeueOutcome(t, g.conn, topic, reported)
	if pending != reported || parked != rows-reported || misplaced != 0 {
		t.Errorf("interrupted requeue said %q, but the database has %d PENDING and %d PARKED rows, %d of them not as "+
			"the first %d selected rows (id order) requeued and the rest untouched", strings.TrimSpace(m[0]), pending, parked, misplaced, reported)
	}
	if reported != want {
		t.Errorf("interrupted requeue said %q, want %d rows (the batches committed when it was interrupted)", strings.TrimSpace(m[0]), want)
	}

	// "run it again for the rest": the rerun requeues exactly the rest.
	var stdout, stderr strings.Builder
	if code := run(ctx, args, &stdout, &stderr); code != exitOK {
		t.Fatalf("rerun: exit %d\nstdout: %s\nstderr: %s", code, stdout.String(), stderr.String())
	}
	left := selected - pending
	if w := fmt.Sprintf("requeued %d parked row(s)\n", left); stdout.String() != w {
		t.Errorf("rerun said %q, want %q (the %d selected rows still parked)", stdout.String(), w, left)
	}
	if pending, parked, misplaced := requeueOutcome(t, g.conn, topic, selected); pending != selected || parked != rows-selected || misplaced != 0 {
		t.Errorf("after the rerun: %d PENDING and %d PARKED rows, %d misplaced; want every selected row (%d) requeued and only those",
			pending, parked, misplaced, selected)
	}
}

// requeueOutcome counts the PENDING and PARKED rows and the misplaced ones:
// rows that are not as a requeue of topic ("" for all) that committed its
// first n selected rows in id order leaves them — those PENDING with
// attempts 0 and no parked_at, every other row PARKED with the 10 attempts
// and parking time the test gave it.
func requeueOutcome(t *testing.T, conn *pgx.Conn, topic string, n int64) (pending, parked, misplaced int64) {
	t.Helper()
	err := conn.QueryRow(context.Background(), `
		WITH sel AS (
			SELECT id, row_number() OVER (ORDER BY id) AS n FROM idem_outbox WHERE $1 = '' OR topic = $1
		)
		SELECT count(*) FILTER (WHERE o.status = 'PENDING'),
		       count(*) FILTER (WHERE o.status = 'PARKED'),
		       count(*) FILTER (WHERE NOT CASE WHEN sel.n <= $2
		           THEN o.status = 'PENDING' AND o.attempts = 0 AND o.parked_at IS NULL
		           ELSE o.status = 'PARKED' AND o.attempts = 10 AND o.parked_at IS NOT NULL END)
		FROM idem_outbox o LEFT JOIN sel USING (id)`, topic, n).Scan(&pending, &parked, &misplaced)
	if err != nil {
		t.Fatal(err)
	}
	return pending, parked, misplaced
}
