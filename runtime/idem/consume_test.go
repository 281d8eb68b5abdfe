package idem_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// The processor tests call Process directly, without a broker: what they
// prove is the processor's failure policy. runtime/kafka's tests run the same
// cases through the real consumer on kfake.

type event struct {
	ID     *string `json:"id"`
	Amount int64   `json:"amount"`
	Note   string  `json:"note"`
}

func consumeDB(t *testing.T) (*pgxpool.Pool, *idem.Store) {
	t.Helper()
	return tracedConsumeDB(t, nil)
}

// tracedConsumeDB is consumeDB with tracer (when not nil) on the pool's
// connections.
func tracedConsumeDB(t *testing.T, tracer pgx.QueryTracer) (*pgxpool.Pool, *idem.Store) {
	t.Helper()
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) {
		if tracer != nil {
			c.ConnConfig.Tracer = tracer
		}
	})
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
	return pool, idem.NewStore(pool)
}

func processor(t *testing.T, store *idem.Store, attempts int) *idem.Processor {
	t.Helper()
	return processorWith(t, store, idem.ProcessorConfig{
		Retry:  idem.RetryPolicy{MaxAttempts: attempts, Initial: time.Millisecond, Max: 2 * time.Millisecond},
		Outage: idem.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
	})
}

// processorWith is idem.NewProcessor(store, cfg), failing the test on an
// error.
func processorWith(t *testing.T, store *idem.Store, cfg idem.ProcessorConfig) *idem.Processor {
	t.Helper()
	p, err := idem.NewProcessor(store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// deadLetter is the dead letter with id, failing the test when it cannot
// be read.
func deadLetter(t *testing.T, store *idem.Store, id int64) *idem.DeadLetter {
	t.Helper()
	dl, err := store.DeadLetter(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	return dl
}

// rowsWritten is how many rows of effects, processed events and dead
// letters there are: 0 when nothing was committed.
func rowsWritten(t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	return pgtest.Count(t, pool, `SELECT (SELECT count(*) FROM effects) + (SELECT count(*) FROM idem_processed_events) + (SELECT count(*) FROM idem_dead_letters)`)
}

// handler dereferences the id pointer, as generated code for `id=ID` on a
// pointer field does: a null id panics in the accessor.
func handler(fn func(context.Context, pgx.Tx, event) error) idem.EventHandler {
	return idem.Consume(idem.EventSpec[event]{
		Topic: "events", Context: "ctx",
		EventID: func(e event) string { return *e.ID },
	}, fn)
}

func insertEffect(ctx context.Context, tx pgx.Tx, e event) error {
	_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, amount) VALUES ($1, $2)`, *e.ID, e.Amount)
	return err
}

// processBounded runs Process with a bound, so a processor that loops
// forever (the bug this file guards against) fails the test instead of
// hanging it.
func processBounded(t *testing.T, p *idem.Processor, h *idem.EventHandler, rec *idem.Record) idem.Outcome {
	t.Helper()
	return processBoundedIn(t, context.Background(), p, h, rec)
}

// processBoundedIn is processBounded under parent.
func processBoundedIn(t *testing.T, parent context.Context, p *idem.Processor, h *idem.EventHandler, rec *idem.Record) idem.Outcome {
	t.Helper()
	ctx, cancel := context.WithTimeout(parent, 20*time.Second)
	defer cancel()
	o, err := p.Process(ctx, h, rec)
	if err != nil {
		t.Fatalf("Process(offset %d): %v", rec.Offset, err)
	}
	return o
}

// Issue 8 item 1(a): a handler error whose text holds a NUL byte made the
// dead-letter insert fail (22021) and retry forever.
func TestDeadLetterHandlerErrorWithNUL(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	p := processor(t, store, 2)
	var calls atomic.Int64
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		calls.Add(1)
		return errors.New("refused order " + e.Note + " \xff")
	})
	rec := &idem.Record{Topic: "events", Offset: 7, Value: []byte(`{"id":"e1","amount":1,"note":"x\u0000y"}`)}
	if o := processBounded(t, p, &h, rec); o != idem.DeadLettered {
		t.Fatalf("outcome %v, want dead-lettered", o)
	}
	if calls.Load() != 2 {
		t.Fatalf("handler ran %d times, want the budget of 2", calls.Load())
	}
	dl, err := store.DeadLetter(context.Background(), 1)
	if err != nil {
		t.Fatal(err)
	}
	if want := `refused order x\x00y ` + "\uFFFD"; dl.LastError != want || dl.Attempts != 2 || !bytes.Equal(dl.Record.Value, rec.Value) {
		t.Fatalf("dead letter: error %q (want %q), attempts %d, value %q", dl.LastError, want, dl.Attempts, dl.Record.Value)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_processed_events`); n != 0 {
		t.Fatalf("%d processed events for a dead letter", n)
	}
}

// A very long error is stored bounded.
func TestDeadLetterErrorBounded(t *testing.T) {
	t.Parallel()
	_, store := consumeDB(t)
	p := processor(t, store, 1)
	h := handler(func(context.Context, pgx.Tx, event) error { return errors.New(strings.Repeat("é", 100000)) })
	processBounded(t, p, &h, &idem.Record{Topic: "events", Value: []byte(`{"id":"e1"}`)})
	dl, err := store.DeadLetter(context.Background(), 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(dl.LastError) > 4096 || !strings.HasSuffix(dl.LastError, "(truncated)") {
		t.Fatalf("stored error of %d bytes: %q…", len(dl.LastError), dl.LastError[:40])
	}
}

// Issue 8 item 4: a null pointer id panics in the id accessor; a handler
// panics. Both are the record's failures: dead-lettered, and the processor
// (and so the consumer) goes on.
func TestPanicsAreDeadLettered(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	p := processor(t, store, 3)
	var calls atomic.Int64
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		if e.Amount < 0 {
			calls.Add(1)
			var m map[string]int
			m["boom"] = 1 // panics
		}
		return insertEffect(ctx, tx, e)
	})
	recs := []*idem.Record{
		{Topic: "events", Offset: 0, Value: []byte(`{"id":null,"amount":1}`)},
		{Topic: "events", Offset: 1, Value: []byte(`{"id":"neg","amount":-1}`)},
		{Topic: "events", Offset: 2, Value: []byte(`{"id":"ok","amount":2}`)},
	}
	want := []idem.Outcome{idem.DeadLettered, idem.DeadLettered, idem.Applied}
	for i, rec := range recs {
		if o := processBounded(t, p, &h, rec); o != want[i] {
			t.Fatalf("record %d: %v, want %v", i, o, want[i])
		}
	}
	if calls.Load() != 3 {
		t.Fatalf("panicking handler ran %d times, want the budget of 3", calls.Load())
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters WHERE koffset = 0 AND attempts = 1 AND last_error LIKE 'panic in decoding the record or reading its event id: runtime error: invalid memory address%'`); n != 1 {
		t.Fatal("the null id was not dead-lettered as a panic in the id accessor")
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters WHERE koffset = 1 AND attempts = 3 AND last_error LIKE 'panic in handler: assignment to entry in nil map%'`); n != 1 {
		t.Fatal("the handler panic was not dead-lettered after the budget")
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
}

// An event id PostgreSQL cannot store (too long for the index: 54000 from
// the dedupe insert) is the record's failure, not an outage to wait out
// forever, and dead-lettered on its first attempt (TestUnstorableEventIDDeadLetteredAtOnce).
// (A NUL byte is refused before any SQL: TestNULEventIDRefusedBeforeSQL.)
func TestUnstorableEventIDDeadLettered(t *testing.T) {
	t.Parallel()
	_, store := consumeDB(t)
	p := processor(t, store, 2)
	h := handler(insertEffect)
	rec := &idem.Record{Topic: "events", Value: []byte(`{"id":"` + unindexableID() + `","amount":1}`)}
	if o := processBounded(t, p, &h, rec); o != idem.DeadLettered {
		t.Fatalf("outcome %v", o)
	}
	dl, err := store.DeadLetter(context.Background(), 1)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(dl.LastError, "54000") || dl.Attempts != 1 {
		t.Fatalf("dead letter: attempts %d, error %q", dl.Attempts, dl.LastError)
	}
}

// Issue 8 item 2, through the handler: a serialization failure or a
// deadlock reported by the handler's own statements is the database's, not
// the record's: it is retried past the record's budget and then applied.
func TestHandlerSerializationFailureUsesNoAttempts(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	p := processor(t, store, 2)
	var calls atomic.Int64
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		if err := insertEffect(ctx, tx, e); err != nil {
			return err
		}
		switch calls.Add(1) {
		case 1, 2:
			return &pgconn.PgError{Code: "40001", Message: "could not serialize access"}
		case 3, 4:
			return &pgconn.PgError{Code: "40P01", Message: "deadlock detected"}
		}
		return nil
	})
	if o := processBounded(t, p, &h, &idem.Record{Topic: "events", Value: []byte(`{"id":"s1","amount":1}`)}); o != idem.Applied {
		t.Fatalf("outcome %v after %d calls, want applied", o, calls.Load())
	}
	if calls.Load() != 5 || pgtest.Count(t, pool, `SELECT count(*) FROM effects`) != 1 ||
		pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters`) != 0 {
		t.Fatalf("calls %d; want 5 calls, 1 effect, no dead letter", calls.Load())
	}
}

// Cancellation while waiting out an outage returns the context's error and
// commits nothing.
func TestOutageWaitEndsWithContext(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	p := processor(t, store, 1)
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		if err := insertEffect(ctx, tx, e); err != nil {
			return err
		}
		return &pgconn.PgError{Code: "57P01", Message: "terminating connection due to administrator command"}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := p.Process(ctx, &h, &idem.Record{Topic: "events", Value: []byte(`{"id":"o1","amount":1}`)})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Process = %v, want the context's error", err)
	}
	if pgtest.Count(t, pool, `SELECT count(*) FROM effects`)+pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters`)+
		pgtest.Count(t, pool, `SELECT count(*) FROM idem_processed_events`) != 0 {
		t.Fatal("something was committed for a record whose wait was cancelled")
	}
}

// Issue 8 item 3: the same position (a topic re-created, a cluster
// restored) with different bytes is a new dead letter; the same bytes again
// (a redelivery) are not stored twice.
func TestDeadLetterOffsetReuseKeepsBoth(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	p := processor(t, store, 1)
	h := handler(insertEffect)
	first := &idem.Record{Topic: "events", Partition: 0, Offset: 0, Value: []byte(`{not json`)}
	second := &idem.Record{Topic: "events", Partition: 0, Offset: 0, Value: []byte(`{also not json`)}
	for _, rec := range []*idem.Record{first, first, second} {
		if o := processBounded(t, p, &h, rec); o != idem.DeadLettered {
			t.Fatalf("outcome %v", o)
		}
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters`); n != 2 {
		t.Fatalf("%d dead letters, want 2: one per distinct record, the redelivery not twice", n)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters WHERE value = '{also not json'::bytea`); n != 1 {
		t.Fatal("the new record at the reused offset was dropped")
	}
}

// Issue 8 item 7 (dead letters): a replayed dead letter goes through the
// exactly-once path: applied once however often it is replayed, marked in
// the same transaction, and a failing replay updates the dead letter in place.
func TestReplayDeadLetter(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	p := processor(t, store, 2)
	var broken atomic.Bool
	broken.Store(true)
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		if broken.Load() {
			return errors.New("downstream refused")
		}
		return insertEffect(ctx, tx, e)
	})
	processBounded(t, p, &h, &idem.Record{Topic: "events", Offset: 3, Key: []byte("k"), Value: []byte(`{"id":"r1","amount":4}`),
		Headers: []idem.RecordHeader{{Key: "trace", Value: []byte("a")}, {Key: "trace", Value: []byte("b")}}})
	ctx := context.Background()

	// Still broken: the dead letter stays, attempts add up, no new row.
	if o, err := p.ReplayDeadLetter(ctx, &h, 1); err != nil || o != idem.DeadLettered {
		t.Fatalf("replay while broken: %v, %v", o, err)
	}
	dl, err := store.DeadLetter(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	if dl.Attempts != 4 || !dl.ReplayedAt.IsZero() || pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters`) != 1 {
		t.Fatalf("after a failed replay: attempts %d, replayed at %v", dl.Attempts, dl.ReplayedAt)
	}

	broken.Store(false)
	other := idem.Consume(idem.EventSpec[event]{Topic: "events", Context: "other", EventID: func(e event) string { return *e.ID }}, insertEffect)
	if _, err := p.ReplayDeadLetter(ctx, &other, 1); err == nil {
		t.Fatal("replayed a dead letter with another context's handler")
	}
	if o, err := p.ReplayDeadLetter(ctx, &h, 1); err != nil || o != idem.Applied {
		t.Fatalf("replay: %v, %v", o, err)
	}
	if _, err := p.ReplayDeadLetter(ctx, &h, 1); !errors.Is(err, idem.ErrDeadLetterReplayed) {
		t.Fatalf("second replay: %v, want ErrDeadLetterReplayed", err)
	}
	if _, err := p.ReplayDeadLetter(ctx, &h, 99); !errors.Is(err, idem.ErrDeadLetterNotFound) {
		t.Fatalf("replay of a missing id: %v", err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE event_id = 'r1' AND amount = 4`); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_processed_events WHERE event_id = 'r1'`); n != 1 {
		t.Fatalf("%d processed events, want 1", n)
	}
	dl, err = store.DeadLetter(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	if dl.ReplayedAt.IsZero() || string(dl.Record.Key) != "k" || len(dl.Record.Headers) != 2 || string(dl.Record.Headers[1].Value) != "b" {
		t.Fatalf("dead letter after replay: %+v", dl)
	}
}

// A replay whose transaction fails at COMMIT leaves the dead letter
// unreplayed: the mark and the effect are one transaction.
func TestReplayRollsBackWithTheEffect(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	p := processor(t, store, 1)
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error { return errors.New("no") })
	processBounded(t, p, &h, &idem.Record{Topic: "events", Value: []byte(`{"id":"r2","amount":1}`)})
	// The handler writes, then cancels the replay's context: nothing of it
	// may commit, the dead-letter mark included.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	h2 := handler(func(hctx context.Context, tx pgx.Tx, e event) error {
		if err := insertEffect(hctx, tx, e); err != nil {
			return err
		}
		cancel()
		return nil
	})
	if _, err := p.ReplayDeadLetter(ctx, &h2, 1); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled replay: %v", err)
	}
	if pgtest.Count(t, pool, `SELECT count(*) FROM effects`) != 0 ||
		pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NULL`) != 1 {
		t.Fatal("a cancelled replay committed something")
	}
}

func TestNewProcessorValidates(t *testing.T) {
	t.Parallel()
	store := idem.NewStore(nil)
	for _, cfg := range []idem.ProcessorConfig{
		{Retry: idem.RetryPolicy{MaxAttempts: -1}},
		{Retry: idem.RetryPolicy{Initial: time.Second, Max: time.Millisecond}},
		{Outage: idem.Backoff{Initial: -1}},
		{StorageTimeout: -time.Second},
	} {
		if _, err := idem.NewProcessor(store, cfg); err == nil {
			t.Errorf("NewProcessor(%+v) accepted it", cfg)
		}
	}
	if _, err := idem.NewProcessor(nil, idem.ProcessorConfig{}); err == nil {
		t.Error("NewProcessor(nil store) accepted it")
	}
}

// Migrate upgrades a dead-letter table of the first layout in place: the
// jsonb headers become the byte arrays, and the (context, topic, partition,
// offset) uniqueness that dropped new poison records at a reused offset is
// gone.
func TestMigrateUpgradesDeadLetters(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	pgtest.Exec(t, pool, `CREATE TABLE idem_dead_letters (
    id          bigserial   PRIMARY KEY,
    context     text        NOT NULL,
    topic       text        NOT NULL,
    kpartition  integer     NOT NULL,
    koffset     bigint      NOT NULL,
    record_key  bytea,
    value       bytea,
    headers     jsonb       NOT NULL DEFAULT '{}',
    attempts    integer     NOT NULL,
    last_error  text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (context, topic, kpartition, koffset)
);
INSERT INTO idem_dead_letters (context, topic, kpartition, koffset, value, headers, attempts, last_error)
VALUES ('ctx', 'events', 0, 0, 'old', '{"trace": "t-1"}', 1, 'decode');`)
	for range 2 { // twice: the upgrade is idempotent
		if err := idem.Migrate(context.Background(), pool); err != nil {
			t.Fatal(err)
		}
	}
	store := idem.NewStore(pool)
	dl, err := store.DeadLetter(context.Background(), 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(dl.Record.Headers) != 1 || dl.Record.Headers[0].Key != "trace" || string(dl.Record.Headers[0].Value) != "t-1" || string(dl.Record.Value) != "old" {
		t.Fatalf("upgraded dead letter: %+v", dl)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
	p := processor(t, store, 1)
	h := handler(insertEffect)
	processBounded(t, p, &h, &idem.Record{Topic: "events", Value: []byte(`new`)})
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters WHERE koffset = 0`); n != 2 {
		t.Fatalf("%d dead letters at offset 0 after the upgrade, want 2", n)
	}
}

// What the handler enqueues in the outbox lives and dies with its
// transaction, and the processor decides that transaction's fate: a failed
// attempt, a dead-lettered record, a cancelled one and a duplicate leave no
// outbox row; the one successful application leaves exactly one. (A test
// that enqueues and rolls back by hand only tests PostgreSQL; this one fails
// if the processor commits a failed attempt, commits after a cancellation,
// or runs the handler for a duplicate.)
func TestProcessorRollsBackHandlerOutboxEvents(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	p := processor(t, store, 3)
	var calls atomic.Int64
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	h := handler(func(hctx context.Context, tx pgx.Tx, e event) error {
		if err := idem.Enqueue(hctx, tx, "receipts", *e.ID, map[string]any{"id": *e.ID, "call": calls.Add(1)}); err != nil {
			return err
		}
		switch {
		case *e.ID == "poison":
			return errors.New("always fails")
		case *e.ID == "cancelled":
			cancel()
			return nil // swallows the cancellation: must still not commit
		case *e.ID == "flaky" && calls.Load() < 3:
			return errors.New("fails twice")
		}
		return nil
	})
	run := func(c context.Context, id string) (idem.Outcome, error) {
		return p.Process(c, &h, &idem.Record{Topic: "events", Value: []byte(`{"id":"` + id + `"}`)})
	}
	if o, err := run(context.Background(), "flaky"); err != nil || o != idem.Applied {
		t.Fatalf("flaky: %v %v", o, err)
	}
	if o, err := run(context.Background(), "flaky"); err != nil || o != idem.Duplicate {
		t.Fatalf("flaky again: %v %v", o, err)
	}
	if o, err := run(context.Background(), "poison"); err != nil || o != idem.DeadLettered {
		t.Fatalf("poison: %v %v", o, err)
	}
	if _, err := run(ctx, "cancelled"); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled: %v", err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_outbox`); n != 1 {
		t.Fatalf("%d outbox rows, want 1: the successful third attempt of flaky", n)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_outbox WHERE record_key = 'flaky'::bytea AND convert_from(payload, 'UTF8')::jsonb->>'call' = '3'`); n != 1 {
		t.Fatal("the outbox row is not the one of the successful attempt")
	}
}
