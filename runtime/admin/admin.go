// Package admin is the operator's API over idemgen's tables: outbox status
// and repair, dead letters, idempotency keys. cmd/idemctl is a thin command
// line over it; services may also mount it behind their own admin endpoints.
//
// Every mutating method is idempotent (running it twice changes nothing the
// second time) and never waits on a row a live request holds: it refuses
// with ErrInFlight instead.
package admin

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/internal/db"
	"github.com/idemgen/idemgen/runtime/internal/principal"
)

// ErrNotFound: no such row (key, dead letter).
var ErrNotFound = errors.New("not found")

// ErrInFlight: a live transaction holds the row (a request is using the key
// right now); the operation was refused rather than wait or interfere.
var ErrInFlight = errors.New("in flight: a live transaction holds it")

// Admin runs operator commands against one database (and schema: the
// connection's search_path). It is safe for concurrent use.
type Admin struct {
	pool  *pgxpool.Pool
	q     *db.Queries
	store *idem.Store
}

// New returns an Admin on pool.
func New(pool *pgxpool.Pool) *Admin {
	return &Admin{pool: pool, q: db.New(pool), store: idem.NewStore(pool)}
}

// readCommitted is the isolation level of every transaction of Admin that
// writes or locks: whatever the session's default_transaction_isolation
// (a server, database or role may make it repeatable read or
// serializable). Their statements wait on row locks held by a concurrent
// replay, requeue or request and must then read what that transaction
// left (a dead letter marked replayed: nothing to do); under a snapshot
// level PostgreSQL refuses that with a serialization failure (40001), and
// a second operator's replay, a discard racing a replay, or a purge by id
// racing a requeue failed instead of finding nothing left to do
// (TestSessionDefaultIsolationOperatorRaces).
var readCommitted = pgx.TxOptions{IsoLevel: pgx.ReadCommitted}

// inReadCommitted runs fn in one read committed transaction (see
// readCommitted) and commits it.
func (a *Admin) inReadCommitted(ctx context.Context, fn func(q *db.Queries) error) error {
	return pgx.BeginTxFunc(ctx, a.pool, readCommitted, func(tx pgx.Tx) error { return fn(db.New(tx)) })
}

// OutboxStatus is the outbox at a glance.
type OutboxStatus struct {
	// Rows per state.
	Pending, Publishing, Published, Parked int64
	// OldestPending is when the oldest PENDING row was enqueued (zero if
	// none); OldestPendingAge is its age on the database's clock: the relay's
	// lag.
	OldestPending    time.Time
	OldestPendingAge time.Duration
	// Leader is the relay's leadership lease, or nil if no relay ever led.
	Leader *RelayLeader
}

// RelayLeader is the relay's leadership lease (idem_relay_leader): which
// relay holds it and until when. Live is false when the lease has expired
// (the leader is gone or stuck, and a standby may take over).
type RelayLeader struct {
	Name       string
	Holder     string
	AcquiredAt time.Time
	ExpiresAt  time.Time
	Live       bool
	// Remaining is how long the lease still runs, on the database's clock.
	Remaining time.Duration
}

// OutboxStatus returns per-state counts, read from the outbox's partial
// indexes rather than a scan of the table, the oldest pending row's age,
// and the active relay.
func (a *Admin) OutboxStatus(ctx context.Context) (OutboxStatus, error) {
	row, err := a.q.OutboxStatus(ctx)
	if err != nil {
		return OutboxStatus{}, fmt.Errorf("outbox status: %w", err)
	}
	st := OutboxStatus{Pending: row.Pending, Publishing: row.Publishing, Published: row.Published, Parked: row.Parked}
	if row.OldestPending.Valid {
		st.OldestPending = row.OldestPending.Time
		st.OldestPendingAge = row.Now.Time.Sub(row.OldestPending.Time)
	}
	leaders, err := a.q.RelayLeader(ctx)
	if err != nil {
		return st, fmt.Errorf("outbox status: relay leader: %w", err)
	}
	if len(leaders) > 0 {
		l := leaders[0]
		st.Leader = &RelayLeader{Name: l.Name, Holder: l.Holder, AcquiredAt: l.AcquiredAt.Time, ExpiresAt: l.ExpiresAt.Time,
			Live: l.Live, Remaining: time.Duration(l.RemainingSeconds * float64(time.Second))}
	}
	return st, nil
}

// OutboxFilter selects outbox rows; zero fields match everything.
type OutboxFilter struct {
	ID    int64
	Topic string
	// After pages a listing (ParkedEvents): only rows with an id above it.
	// RequeueParked refuses it: a requeue selects by id or topic, not page.
	After int64
}

func (f OutboxFilter) params() (pgtype.Int8, pgtype.Text) {
	return pgtype.Int8{Int64: f.ID, Valid: f.ID != 0}, pgtype.Text{String: f.Topic, Valid: f.Topic != ""}
}

// ParkedEvent is an outbox row the relay gave up on.
type ParkedEvent struct {
	ID        int64
	EventID   string
	Topic     string
	Key       []byte
	Attempts  int32
	CreatedAt time.Time // enqueued
	// ParkedAt is when the relay parked it; zero when it was parked by a
	// version without idem_outbox.parked_at (its parking time is unknown).
	ParkedAt  time.Time
	LastError string
}

// ParkedEvents lists up to limit PARKED rows matching f, oldest first (by
// id, so the last one's id is the After of the next page).
func (a *Admin) ParkedEvents(ctx context.Context, f OutboxFilter, limit int) ([]ParkedEvent, error) {
	if limit < 0 {
		return nil, fmt.Errorf("list parked outbox rows: limit %d is negative", limit)
	}
	id, topic := f.params()
	rows, err := a.q.ListParkedOutbox(ctx, db.ListParkedOutboxParams{ID: id, Topic: topic, After: f.After, MaxRows: int32(min(limit, math.MaxInt32))})
	if err != nil {
		return nil, fmt.Errorf("list parked outbox rows: %w", err)
	}
	out := make([]ParkedEvent, len(rows))
	for i, r := range rows {
		out[i] = ParkedEvent{ID: r.ID, EventID: r.EventID, Topic: r.Topic, Key: r.RecordKey, Attempts: r.Attempts, CreatedAt: r.CreatedAt.Time, ParkedAt: r.ParkedAt.Time, LastError: r.LastError}
	}
	return out, nil
}

// CountParkedEvents returns how many PARKED rows match f (f.After aside):
// the total a listing cut at its limit shows, and what RequeueParked(f)
// would requeue.
func (a *Admin) CountParkedEvents(ctx context.Context, f OutboxFilter) (int64, error) {
	id, topic := f.params()
	n, err := a.q.CountParkedOutbox(ctx, db.CountParkedOutboxParams{ID: id, Topic: topic})
	if err != nil {
		return 0, fmt.Errorf("count parked outbox rows: %w", err)
	}
	return n, nil
}

// RequeueParked returns the PARKED rows matching f to PENDING with a fresh
// attempt budget and wakes the relay (idem.Store's RequeueParked*); it
// returns how many. Their event ids are unchanged, so a consumer that did
// receive an earlier attempt skips it.
func (a *Admin) RequeueParked(ctx context.Context, f OutboxFilter) (int64, error) {
	var n int64
	var err error
	switch {
	case f.After != 0:
		return 0, errors.New("requeue parked outbox rows: After pages a listing; select by id or by topic")
	case f.ID != 0 && f.Topic != "":
		return 0, errors.New("requeue parked outbox rows: select by id or by topic, not both")
	case f.ID != 0:
		n, err = a.store.RequeueParked(ctx, f.ID)
	case f.Topic != "":
		n, err = a.store.RequeueParkedTopic(ctx, f.Topic)
	default:
		n, err = a.store.RequeueAllParked(ctx)
	}
	if err != nil {
		return 0, err // the Store's error says "requeue parked outbox rows" already
	}
	return n, nil
}

// RequeueParkedBatch is one batch of a requeue that commits as it goes:
// it returns up to batchSize PARKED rows of f.Topic (every topic if empty)
// with an id above f.After to PENDING with a fresh attempt budget, lowest
// ids first, in one transaction that also wakes the relay. It returns how
// many, and the highest id among them: the After of the next batch. Zero
// rows means none are left above f.After. (RequeueParked does the whole
// selection in one statement, which for millions of parked rows can take
// longer than a caller's timeout, and then rolls back entirely.) Rows are
// requeued in id order, so a key's events go out in their order.
func (a *Admin) RequeueParkedBatch(ctx context.Context, f OutboxFilter, batchSize int) (n, last int64, err error) {
	if f.ID != 0 {
		return 0, 0, errors.New("requeue parked outbox rows: a batch selects by topic or all; RequeueParked takes an id")
	}
	if batchSize <= 0 {
		return 0, 0, errors.New("requeue parked outbox rows: batch size must be positive")
	}
	tx, err := a.pool.BeginTx(ctx, readCommitted)
	if err != nil {
		return 0, 0, fmt.Errorf("requeue parked outbox rows: begin: %w", err)
	}
	defer rollback(ctx, tx)
	q := db.New(tx)
	ids, err := q.RequeueParkedOutboxBatch(ctx, db.RequeueParkedOutboxBatchParams{
		After: f.After, Topic: pgtype.Text{String: f.Topic, Valid: f.Topic != ""}, BatchSize: int32(min(batchSize, math.MaxInt32)),
	})
	if err != nil {
		return 0, 0, fmt.Errorf("requeue parked outbox rows: %w", err)
	}
	if len(ids) == 0 {
		return 0, 0, nil
	}
	// The NOTIFY trigger fires on INSERT only; wake the relay at commit.
	if err := q.NotifyOutbox(ctx); err != nil {
		return 0, 0, fmt.Errorf("requeue parked outbox rows: notify: %w", err)
	}
	if err := commitAnswered(ctx, tx); err != nil {
		return 0, 0, fmt.Errorf("requeue parked outbox rows: commit: %w", err)
	}
	return int64(len(ids)), slices.Max(ids), nil
}

// OutboxRowStatus returns the state of outbox row id (PENDING, PUBLISHING,
// PUBLISHED or PARKED), or ErrNotFound: what a requeue by id that requeued
// nothing tells the operator.
func (a *Admin) OutboxRowStatus(ctx context.Context, id int64) (string, error) {
	st, err := a.q.OutboxRowStatus(ctx, id)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", fmt.Errorf("outbox row %d: %w", id, ErrNotFound)
	}
	if err != nil {
		return "", fmt.Errorf("outbox row %d: %w", id, err)
	}
	return st, nil
}

// Outbox states PurgeOutbox accepts.
const (
	StatusPublished = "PUBLISHED"
	StatusParked    = "PARKED"
)

// CountOutboxBefore counts the rows PurgeOutbox(status, before) would delete:
// PUBLISHED rows published before before, or PARKED rows parked before it
// (by parked_at; rows without one are not counted, see
// CountParkedUnknownTime).
func (a *Admin) CountOutboxBefore(ctx context.Context, status string, before time.Time) (int64, error) {
	if status != StatusPublished && status != StatusParked {
		return 0, fmt.Errorf("count outbox rows: status %q is neither %s nor %s", status, StatusPublished, StatusParked)
	}
	n, err := a.q.CountOutboxBefore(ctx, db.CountOutboxBeforeParams{Status: status, Before: ts(before)})
	if err != nil {
		return 0, fmt.Errorf("count %s outbox rows: %w", status, err)
	}
	return n, nil
}

// Now returns the database's clock, the one that sets parked_at and
// published_at: a purge's cutoff (now less --older-than) must be taken from
// it, since the operator's machine may be ahead of it (rows parked within
// the difference were deleted as older than the cutoff) or behind.
func (a *Admin) Now(ctx context.Context) (time.Time, error) {
	now, err := a.q.DatabaseNow(ctx)
	if err != nil {
		return time.Time{}, fmt.Errorf("read the database's clock: %w", err)
	}
	return now.Time, nil
}

// CountParkedUnknownTime counts the PARKED rows without a parking time
// (parked_at NULL: parked by a version of the runtime without the column
// before the upgrade added it; after it, the idem_outbox_parked_at trigger
// dates an older replica's parking). A purge by age
// never deletes them, since how long they have been parked is unknown;
// they go by id (PurgeParked) or by a requeue.
func (a *Admin) CountParkedUnknownTime(ctx context.Context) (int64, error) {
	n, err := a.q.CountParkedOutboxUnknownTime(ctx)
	if err != nil {
		return 0, fmt.Errorf("count parked outbox rows without a parking time: %w", err)
	}
	return n, nil
}

// PurgeParked deletes the PARKED outbox row id, whatever its age (its
// event is lost), and returns 1, or 0 when the row is not PARKED or does
// not exist (OutboxRowStatus says which).
func (a *Admin) PurgeParked(ctx context.Context, id int64) (int64, error) {
	var n int64
	err := a.inReadCommitted(ctx, func(q *db.Queries) error {
		var err error
		n, err = q.DeleteParkedOutboxByID(ctx, id)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("purge parked outbox row %d: %w", id, err)
	}
	return n, nil
}

// PurgeOutbox deletes PUBLISHED rows published before before, or PARKED rows
// parked before it, in batches of batchSize each committed on its own,
// and returns how many it deleted. Cancellation stops it between batches.
func (a *Admin) PurgeOutbox(ctx context.Context, status string, before time.Time, batchSize int) (int64, error) {
	var total int64
	for {
		if err := ctx.Err(); err != nil {
			return total, err
		}
		n, err := a.PurgeOutboxBatch(ctx, status, before, batchSize)
		total += n
		if err != nil || n < int64(batchSize) {
			return total, err
		}
	}
}

// PurgeOutboxBatch is one batch of PurgeOutbox: it deletes up to batchSize
// rows in one statement (its own transaction) and returns how many; fewer
// than batchSize means none are left. A caller that bounds each batch
// rather than the whole purge (idemctl: a backlog of millions of rows takes
// longer than a database that never answers may) loops over it.
func (a *Admin) PurgeOutboxBatch(ctx context.Context, status string, before time.Time, batchSize int) (int64, error) {
	if batchSize <= 0 {
		return 0, errors.New("purge outbox: batch size must be positive")
	}
	if status != StatusPublished && status != StatusParked {
		return 0, fmt.Errorf("purge outbox: status %q is neither %s nor %s", status, StatusPublished, StatusParked)
	}
	// The DELETE runs in a transaction committed by commitAnswered: sent
	// alone (autocommit), a cancellation (idemctl's SIGINT) that came as the
	// statement finished returned the context's error for a batch the
	// server had committed, and idemctl reported 1,000 rows fewer than it
	// had deleted, every time.
	tx, err := a.pool.BeginTx(ctx, readCommitted)
	if err != nil {
		return 0, fmt.Errorf("purge %s outbox rows: begin: %w", status, err)
	}
	defer rollback(ctx, tx)
	q := db.New(tx)
	var n int64
	size := int32(min(batchSize, math.MaxInt32))
	if status == StatusPublished {
		n, err = q.DeletePublishedOutbox(ctx, db.DeletePublishedOutboxParams{Before: ts(before), BatchSize: size})
	} else {
		n, err = q.DeleteParkedOutbox(ctx, db.DeleteParkedOutboxParams{Before: ts(before), BatchSize: size})
	}
	if err != nil {
		return 0, fmt.Errorf("purge %s outbox rows: %w", status, err)
	}
	if err := commitAnswered(ctx, tx); err != nil {
		return 0, fmt.Errorf("purge %s outbox rows: commit: %w", status, err)
	}
	return n, nil
}

// commitAnswered commits a transaction whose statements have answered,
// even if ctx was cancelled meanwhile (bounded by ctx's deadline, if any):
// the work is done and its count known, and a commit cut short by the
// cancellation may have committed on the server all the same, leaving the
// caller to report rows it did not count.
func commitAnswered(ctx context.Context, tx pgx.Tx) error {
	cctx := context.WithoutCancel(ctx)
	if d, ok := ctx.Deadline(); ok {
		var cancel context.CancelFunc
		cctx, cancel = context.WithDeadline(cctx, d)
		defer cancel()
	}
	return tx.Commit(cctx)
}

// DeadLetter is a record a consumer could not apply, kept raw.
type DeadLetter struct {
	ID        int64
	Context   string // the consumer context that failed it
	Topic     string
	Partition int32
	Offset    int64
	// Key and Value are nil for a null key or value.
	Key, Value []byte
	ValueLen   int64
	// Headers in delivery order, repeated names kept.
	Headers []Header
	// UnpairedHeaderKeys and UnpairedHeaderValues are set only for a row
	// whose stored header names and values (two arrays the runtime always
	// writes in pairs) differ in length: a row edited by hand. Headers then
	// holds the pairs both arrays have, matched by position (which may be
	// misaligned), and these the rest of the longer array. ReplayDeadLetter
	// refuses such a dead letter (ErrUnpairedHeaders).
	UnpairedHeaderKeys   []string
	UnpairedHeaderValues [][]byte
	Attempts             int32
	LastError            string
	CreatedAt            time.Time
	// ReplayedAt is when it was replayed (re-produced and acked, or applied
	// in place by idem.Processor.ReplayDeadLetter); zero while it is still a
	// dead letter.
	ReplayedAt time.Time
}

// Header is one record header, raw.
type Header struct {
	Key   string
	Value []byte
}

// DeadLetterFilter selects dead letters; zero fields match everything.
type DeadLetterFilter struct {
	Context string
	Topic   string
	// IncludeReplayed lists replayed ones too (kept until retention).
	IncludeReplayed bool
	// After pages a listing: only dead letters with an id above it.
	After int64
}

// DeadLetters lists up to limit dead letters matching f, oldest first,
// without their key, value and headers (see DeadLetter for those).
func (a *Admin) DeadLetters(ctx context.Context, f DeadLetterFilter, limit int) ([]DeadLetter, error) {
	if limit < 0 {
		return nil, fmt.Errorf("list dead letters: limit %d is negative", limit)
	}
	rows, err := a.q.ListDeadLetters(ctx, db.ListDeadLettersParams{
		Context:         pgtype.Text{String: f.Context, Valid: f.Context != ""},
		Topic:           pgtype.Text{String: f.Topic, Valid: f.Topic != ""},
		IncludeReplayed: f.IncludeReplayed,
		After:           f.After,
		MaxRows:         int32(min(limit, math.MaxInt32)),
	})
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	out := make([]DeadLetter, len(rows))
	for i, r := range rows {
		out[i] = DeadLetter{ID: r.ID, Context: r.Context, Topic: r.Topic, Partition: r.Kpartition, Offset: r.Koffset,
			ValueLen: r.ValueLen, Attempts: r.Attempts, LastError: r.LastError, CreatedAt: r.CreatedAt.Time,
			ReplayedAt: r.ReplayedAt.Time}
	}
	return out, nil
}

// CountDeadLetters returns how many dead letters match f (f.After aside).
func (a *Admin) CountDeadLetters(ctx context.Context, f DeadLetterFilter) (int64, error) {
	n, err := a.q.CountDeadLetters(ctx, db.CountDeadLettersParams{
		Context:         pgtype.Text{String: f.Context, Valid: f.Context != ""},
		Topic:           pgtype.Text{String: f.Topic, Valid: f.Topic != ""},
		IncludeReplayed: f.IncludeReplayed,
	})
	if err != nil {
		return 0, fmt.Errorf("count dead letters: %w", err)
	}
	return n, nil
}

// DeadLetter returns dead letter id in full, or ErrNotFound. A row whose
// header arrays differ in length is returned all the same, with what can
// be paired in Headers and the rest in UnpairedHeaderKeys or
// UnpairedHeaderValues: an operator must be able to see (and discard) it.
// (idem.Store.DeadLetter, which feeds an in-place replay, refuses it.)
func (a *Admin) DeadLetter(ctx context.Context, id int64) (DeadLetter, error) {
	r, err := a.q.GetDeadLetter(ctx, id)
	if errors.Is(err, pgx.ErrNoRows) {
		return DeadLetter{}, fmt.Errorf("dead letter %d: %w", id, ErrNotFound)
	}
	if err != nil {
		return DeadLetter{}, fmt.Errorf("read dead letter %d: %w", id, err)
	}
	out := DeadLetter{ID: r.ID, Context: r.Context, Topic: r.Topic, Partition: r.Kpartition,
		Offset: r.Koffset, Key: r.RecordKey, Value: r.Value, ValueLen: int64(len(r.Value)),
		Attempts: r.Attempts, LastError: r.LastError, CreatedAt: r.CreatedAt.Time, ReplayedAt: r.ReplayedAt.Time}
	n := min(len(r.HeaderKeys), len(r.HeaderValues))
	for i := range n {
		out.Headers = append(out.Headers, Header{Key: string(r.HeaderKeys[i]), Value: r.HeaderValues[i]})
	}
	for _, k := range r.HeaderKeys[n:] {
		out.UnpairedHeaderKeys = append(out.UnpairedHeaderKeys, string(k))
	}
	out.UnpairedHeaderValues = r.HeaderValues[n:]
	if len(out.UnpairedHeaderValues) == 0 {
		out.UnpairedHeaderValues = nil
	}
	return out, nil
}

// HeadersDamaged reports whether d's stored header names and values differ
// in length (see UnpairedHeaderKeys).
func (d DeadLetter) HeadersDamaged() bool {
	return len(d.UnpairedHeaderKeys) > 0 || len(d.UnpairedHeaderValues) > 0
}

// ProcessedEventsKeptSince returns when the oldest processed-event row
// still kept was written, and false if none is. Every context forgot the
// events it applied before then (the janitor's ProcessedEventAge): a record
// re-produced to its topic (ReplayDeadLetter) that one of them applied
// before then is applied by it again.
func (a *Admin) ProcessedEventsKeptSince(ctx context.Context) (time.Time, bool, error) {
	t, err := a.q.OldestProcessedEvent(ctx)
	if err != nil {
		return time.Time{}, false, fmt.Errorf("oldest processed event: %w", err)
	}
	return t.Time, t.Valid, nil
}

// DiscardDeadLetter deletes dead letter id. It reports whether there was
// one: discarding twice is not an error.
func (a *Admin) DiscardDeadLetter(ctx context.Context, id int64) (bool, error) {
	var n int64
	err := a.inReadCommitted(ctx, func(q *db.Queries) error {
		var err error
		n, err = q.DeleteDeadLetter(ctx, id)
		return err
	})
	if err != nil {
		return false, fmt.Errorf("discard dead letter %d: %w", id, err)
	}
	return n > 0, nil
}

// ErrUnpairedHeaders: the dead letter's stored header names and values
// differ in length (the row was edited by hand), so which value belongs to
// which header, the event id's included, is unknown; ReplayDeadLetter
// refuses to produce a guess. Discard it, or repair the row.
var ErrUnpairedHeaders = errors.New("its stored header names and values differ in length")

// ErrProducedNotMarked: ReplayDeadLetter produced the record (the broker
// acknowledged it) but could not mark the dead letter replayed, or could
// not tell whether it did (the error's text says which). The dead letter
// (still) looks unreplayed; replaying it again produces a second copy.
var ErrProducedNotMarked = errors.New("the record WAS produced (the broker acked it) but the dead letter was NOT marked replayed")

// markTimeout bounds the commit of a replay's mark once the broker acked,
// which runs even if the caller's context ends (see ReplayDeadLetter).
const markTimeout = 10 * time.Second

// readBackTimeout bounds reading a replay's mark back after its commit
// failed (see ReplayDeadLetter).
const readBackTimeout = 5 * time.Second

// markUnknownError is ErrProducedNotMarked when the mark's commit failed
// without an answer and reading the mark back failed too: the COMMIT may
// have committed.
type markUnknownError struct {
	prefix           string
	commit, readBack error
}

func (e *markUnknownError) Error() string {
	return fmt.Sprintf("%s: the record WAS produced (the broker acked it); whether the dead letter was marked replayed is UNKNOWN: "+
		"its commit failed (%v) and reading the mark back failed (%v)", e.prefix, e.commit, e.readBack)
}

func (e *markUnknownError) Is(target error) bool { return target == ErrProducedNotMarked }

func (e *markUnknownError) Unwrap() []error { return []error{e.commit, e.readBack} }

// markedReplayed reads back whether dead letter id is marked replayed, once
// no transaction holds its row, even if ctx has ended, within
// readBackTimeout (a replay's transaction still open past it: an error).
func (a *Admin) markedReplayed(ctx context.Context, id int64) (bool, error) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), readBackTimeout)
	defer cancel()
	// Under a share lock: a plain read while the replay's COMMIT was still
	// on its way read the mark unset, and the COMMIT landed after it.
	var at pgtype.Timestamptz
	err := a.inReadCommitted(rctx, func(q *db.Queries) error {
		var err error
		at, err = q.DeadLetterReplayedAfterLock(rctx, id)
		return err
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil // discarded since: not marked by this replay
	}
	if err != nil {
		return false, err
	}
	return at.Valid, nil
}

// Producer produces a dead letter's record (topic, key, value, headers) to
// the broker and returns only once the broker acknowledged it.
type Producer func(ctx context.Context, d DeadLetter) error

// ReplayDeadLetter re-produces dead letter id to its topic with produce and
// marks it replayed once the broker acknowledged. The record keeps its key
// (so its partition, with the default partitioner) and its headers in order,
// among them idem-event-id, so it goes through the consumers' ordinary
// exactly-once path: the failed context applies it, and contexts that had
// applied it skip it as a duplicate — as long as their processed-event rows
// are kept (see ProcessedEventsKeptSince: a dead letter older than the
// janitor's ProcessedEventAge is applied again by the others). (A service that wants to re-process in
// place, without the broker, uses idem.Processor.ReplayDeadLetter.)
//
// The mark is written first and committed only after the ack: it locks the
// row, so two operators replaying it at once produce it once, and a failed
// produce rolls the mark back. If the process dies between the ack and the
// commit, the dead letter is still unreplayed and a second replay produces
// it again; consumers deduplicate that by event id (again as long as they
// keep its processed-event row). It returns false if there is no such dead
// letter or it was replayed already.
//
// Once produce has returned nil the record is out and cannot be taken back,
// so the mark is committed even if ctx is cancelled or its deadline passes
// meanwhile (an operator's Ctrl-C right after the ack), like a COMMIT
// already decided: under context.WithoutCancel, bounded by a timeout of its
// own (10s). If that commit fails all the same, the mark is read back
// (within 5s more): a COMMIT whose answer was lost may have committed, and
// then the replay did succeed (true, nil). Otherwise the error wraps
// ErrProducedNotMarked (and the commit's error), saying whether the mark
// was read back unset or could not be read at all: the caller must tell
// the operator that the record went out.
//
// A dead letter whose header arrays differ in length is refused with
// ErrUnpairedHeaders before anything is produced.
//
// It holds one pooled connection at a time: the dead letter is read before
// the transaction begins (the row's bytes never change, so it is the same
// read; a dead letter discarded or replayed in between fails the mark). Read
// inside the transaction through the pool, it needed a second connection
// while holding the first, and on a pool of one waited forever.
func (a *Admin) ReplayDeadLetter(ctx context.Context, id int64, produce Producer) (bool, error) {
	d, err := a.DeadLetter(ctx, id)
	if errors.Is(err, ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("replay: %w", err)
	}
	if d.HeadersDamaged() && d.ReplayedAt.IsZero() {
		return false, fmt.Errorf("replay dead letter %d: %w (%d names, %d values); nothing produced",
			id, ErrUnpairedHeaders, len(d.Headers)+len(d.UnpairedHeaderKeys), len(d.Headers)+len(d.UnpairedHeaderValues))
	}
	tx, err := a.pool.BeginTx(ctx, readCommitted)
	if err != nil {
		return false, fmt.Errorf("replay dead letter %d: begin: %w", id, err)
	}
	defer rollback(ctx, tx)
	n, err := db.New(tx).MarkDeadLetterReplayed(ctx, id)
	if err != nil {
		return false, fmt.Errorf("replay dead letter %d: mark: %w", id, err)
	}
	if n == 0 {
		return false, nil
	}
	if err := produce(ctx, d); err != nil {
		return false, fmt.Errorf("replay dead letter %d: produce to %q partition-key %q: %w", id, d.Topic, d.Key, err)
	}
	// The broker acked: the mark is decided. Committed on ctx, a
	// cancellation now (Ctrl-C just after the ack) rolled it back, and the
	// operator, told the replay failed, replayed the record a second time.
	mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), markTimeout)
	defer cancel()
	if err := tx.Commit(mctx); err != nil {
		// A COMMIT whose answer was lost or came too late (a slow or
		// broken network) may have committed: reported as "NOT marked",
		// the dead letter was marked all the same. Read the mark back,
		// on a connection of its own once this one is released (a pool
		// of one has no other).
		rollback(ctx, tx)
		prefix := fmt.Sprintf("replay dead letter %d to %q (partition-key %q)", id, d.Topic, d.Key)
		marked, rerr := a.markedReplayed(ctx, id)
		switch {
		case rerr != nil:
			return false, &markUnknownError{prefix: prefix, commit: err, readBack: rerr}
		case marked:
			return true, nil
		}
		return false, fmt.Errorf("%s: %w: %w", prefix, ErrProducedNotMarked, err)
	}
	return true, nil
}

// KeyRef names an idempotency key: keys are scoped per endpoint (Scope) and
// per caller (Principal), and an operator must name both. Principal is the
// caller as the service's HTTPConfig.Principal returned it; Key and
// ReleaseKey look it up in its stored form, as the runtime wrote it (a
// principal over idem.MaxPrincipalLength bytes, say, is stored hashed).
type KeyRef struct {
	Scope, Principal, Key string
}

// stored is the row identity of k in idem_keys.
func (k KeyRef) stored() KeyRef {
	k.Principal = principal.Stored(k.Principal)
	return k
}

func (k KeyRef) String() string {
	return fmt.Sprintf("scope=%q principal=%q key=%q", k.Scope, k.Principal, k.Key)
}

// KeyInfo is a stored idempotency key.
type KeyInfo struct {
	KeyRef
	Fingerprint []byte
	StatusCode  int32
	Headers     []byte // JSON
	Body        []byte
	CreatedAt   time.Time
	ExpiresAt   time.Time
	// Expired: the key is no longer replayed; the next request with it runs
	// anew.
	Expired bool
	// StoredPrincipal is the principal as idem_keys holds it: Principal
	// itself, or its hashed form.
	StoredPrincipal string
}

// Key returns the key named ref. It returns ErrNotFound if there is no
// stored key (a first request still in flight stores nothing visible until
// it commits) and ErrInFlight if a request is taking over the expired key
// right now.
func (a *Admin) Key(ctx context.Context, ref KeyRef) (KeyInfo, error) {
	var info KeyInfo
	st := ref.stored()
	err := pgx.BeginTxFunc(ctx, a.pool, readCommitted, func(tx pgx.Tx) error {
		r, err := db.New(tx).AdminGetKey(ctx, db.AdminGetKeyParams{Scope: st.Scope, Principal: st.Principal, Key: st.Key})
		if err != nil {
			return err
		}
		info = KeyInfo{KeyRef: ref, Fingerprint: r.Fingerprint, StatusCode: r.StatusCode, Headers: r.Headers, Body: r.Body,
			CreatedAt: r.CreatedAt.Time, ExpiresAt: r.ExpiresAt.Time, Expired: r.Expired, StoredPrincipal: r.Principal}
		return nil
	})
	if err != nil {
		return KeyInfo{}, fmt.Errorf("key %s: %w", ref, keyErr(err))
	}
	return info, nil
}

// ReleaseKey deletes the stored key named ref, so the next request with it
// runs anew. A key a live transaction holds (a request in flight on it) is
// refused with ErrInFlight: the row is locked with NOWAIT, never waited on.
// A missing key is ErrNotFound, so releasing twice is harmless.
func (a *Admin) ReleaseKey(ctx context.Context, ref KeyRef) error {
	err := pgx.BeginTxFunc(ctx, a.pool, readCommitted, func(tx pgx.Tx) error {
		q := db.New(tx)
		st := ref.stored()
		p := db.LockKeyNowaitParams{Scope: st.Scope, Principal: st.Principal, Key: st.Key}
		if _, err := q.LockKeyNowait(ctx, p); err != nil {
			return err
		}
		_, err := q.DeleteKey(ctx, db.DeleteKeyParams(p))
		return err
	})
	if err != nil {
		return fmt.Errorf("release key %s: %w", ref, keyErr(err))
	}
	return nil
}

// keyErr maps "no row" and "row locked" to ErrNotFound and ErrInFlight.
func keyErr(err error) error {
	var pgErr *pgconn.PgError
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return ErrNotFound
	case errors.As(err, &pgErr) && pgErr.Code == "55P03": // lock_not_available
		return ErrInFlight
	}
	return err
}

func ts(t time.Time) pgtype.Timestamptz { return pgtype.Timestamptz{Time: t, Valid: true} }

// rollback ends tx if it did not commit, even when ctx is cancelled.
func rollback(ctx context.Context, tx pgx.Tx) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = tx.Rollback(ctx)
}
