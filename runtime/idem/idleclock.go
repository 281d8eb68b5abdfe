package idem

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// idleClock measures, over a handler's run, the longest stretch in which
// none of the handler's own database calls on its transaction was in
// flight: the time the handler itself held the transaction idle.
//
// The server's idle_in_transaction_session_timeout counts the time between
// a statement's answer leaving the server and the next statement arriving.
// Whether a 25P03 is the handler's doing cannot be read from the handler's
// whole run: a handler that is never idle (its time spent in its own
// statements) also runs long when the network is slow or stalls, and the
// server then sits idle while an answer, or the next statement, is on its
// way. Charging that to the record dead-lettered good records during a
// network blip. Only a stretch of the handler's own, outside any database
// call, at least the timeout long, is the handler's (idleCulprit).
//
// The clock sees the calls made through the pgx.Tx the handler is given
// (Exec, Query and its Rows, QueryRow, SendBatch and its results,
// CopyFrom, Prepare, Begin, Commit, Rollback). Statements sent another way
// (tx.Conn(), tx.LargeObjects()) count as idle time.
//
// It also notes whether a call failed with a context's error
// (context.Canceled or context.DeadlineExceeded): with the runtime's own
// context alive, a context of the handler's own ended that call, which
// pgx's default context watcher does by closing the connection (see
// ownCtxClosed).
type idleClock struct {
	mu      sync.Mutex
	calls   int       // database calls in flight
	since   time.Time // the start of the current idle stretch, when calls == 0
	longest time.Duration
	busy    time.Time     // the start of the current busy stretch, when calls > 0
	ctxErr  bool          // a call failed with a context's error
	ctxRan  time.Duration // the longest busy stretch that ended in a context's error
	conn    *pgx.Conn     // the transaction's connection

	// For idleWindow: the start of the busy stretch before the current
	// one (the runtime's BEGIN round trip before the handler's first
	// call), the idle stretch between them, the runtime's own time before
	// the handler was called (answered to the call), whether the handler
	// made a call yet, and the first call that left the connection closed.
	prevBusy time.Time
	lastIdle time.Duration
	answered time.Time
	called   bool
	end      *connEnd
}

// connEnd is the first of the handler's calls that left its connection
// closed: its error, and the idle window it ended.
type connEnd struct {
	err    error
	window idleWindow
}

// clockTx returns tx wrapped, with a new clock whose first idle stretch
// begins at start, in one allocation.
func clockTx(tx pgx.Tx, start time.Time) *clockedTx {
	b := &struct {
		t clockedTx
		c idleClock
	}{c: idleClock{since: start, conn: tx.Conn(), busy: start, answered: start}}
	b.t = clockedTx{Tx: tx, clock: &b.c}
	return &b.t
}

// began notes the runtime's round trip that began the transaction: sent
// at sent, answered at answered (before the clock's start). Without it the
// window of the handler's first call starts when the handler was called.
func (c *idleClock) began(sent, answered time.Time) {
	c.mu.Lock()
	c.busy, c.answered = sent, answered
	c.mu.Unlock()
}

func (c *idleClock) enter() {
	c.enterFrom()
}

// windowFrom is where the idle window of a call's statement begins, noted
// when the call sends it (see enterFrom).
type windowFrom struct {
	start            time.Time
	handler, runtime time.Duration
}

// enterFrom is enter, returning where the window of the statement this
// call sends begins. A call that sends a statement and leaves the reading
// of its answer to another (Query and QueryRow: Rows.Next, Row.Scan;
// SendBatch: its results) may read a FATAL in the first and report it in
// the second: the window the FATAL ended begins before the sending call,
// not before the reporting one (whose busy stretch before is the sending
// call's, after the server's idling began). Measured from there, a
// network slower than the runtime's timeout read as a window shorter than
// it: a timeout "lowered by the handler", charged.
func (c *idleClock) enterFrom() windowFrom {
	now := time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.calls == 0 {
		c.lastIdle = now.Sub(c.since)
		c.longest = max(c.longest, c.lastIdle)
		c.prevBusy = c.busy
		c.busy = now
	}
	c.calls++
	f := windowFrom{start: c.prevBusy, handler: c.lastIdle}
	if !c.called {
		f.runtime = c.since.Sub(c.answered)
	}
	return f
}

func (c *idleClock) exit() {
	now := time.Now()
	c.mu.Lock()
	c.calls--
	if c.calls == 0 {
		c.since = now
		c.called = true
	}
	c.mu.Unlock()
}

// failed notes err, the error a database call returned (nil: nothing;
// inlined, so a call that succeeds costs a comparison).
func (c *idleClock) failed(err error) {
	if err != nil {
		c.noteFailed(err)
	}
}

func (c *idleClock) noteFailed(err error) {
	c.noteFailedFrom(err, nil)
}

// failedFrom is failed for a call reporting the answer to a statement
// another call sent (see enterFrom): from is where that one's window began.
func (c *idleClock) failedFrom(err error, from *windowFrom) {
	if err != nil {
		c.noteFailedFrom(err, from)
	}
}

func (c *idleClock) noteFailedFrom(err error, from *windowFrom) {
	if c.conn.IsClosed() {
		c.noteEnd(err, from)
	}
	// Only a context's error that left the connection closed: pgconn
	// refuses a statement whose context is done already without sending it
	// and keeps the connection, and a handler may go on from there (an
	// optional statement under a budget of its own, spent). Noted, a later
	// closing by the network read as the handler's own context.
	if !isCtxErr(err) || !c.conn.IsClosed() {
		return
	}
	now := time.Now()
	c.mu.Lock()
	c.ctxErr = true
	c.ctxRan = max(c.ctxRan, now.Sub(c.busy))
	c.mu.Unlock()
}

// noteEnd notes err, the failure of a call that left the connection
// closed, when it is the first: the window it ended runs from the start of
// the busy stretch before this one to now.
func (c *idleClock) noteEnd(err error, from *windowFrom) {
	now := time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.end == nil {
		w := idleWindow{span: now.Sub(c.prevBusy), handler: c.lastIdle}
		if !c.called {
			w.runtime = c.since.Sub(c.answered) // before the handler was called
		}
		if from != nil && from.start.Before(c.prevBusy) {
			// The statement was sent by an earlier call (enterFrom).
			w.span = now.Sub(from.start)
			w.handler = max(w.handler, from.handler)
			w.runtime = max(w.runtime, from.runtime)
		}
		c.end = &connEnd{err: err, window: w}
	}
}

// ended returns the first call that left the connection closed, or nil.
func (c *idleClock) ended() *connEnd {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.end
}

// windowAt returns the idle window that a round trip of the runtime's
// after the handler returned (at returned) ended: sent at sent, its
// failure read at failed. It runs from the start of the handler's last
// call (or of the runtime's BEGIN, when it made none).
func (c *idleClock) windowAt(returned, sent, failed time.Time) idleWindow {
	c.mu.Lock()
	defer c.mu.Unlock()
	w := idleWindow{span: failed.Sub(c.busy), runtime: sent.Sub(returned)}
	if c.calls == 0 {
		w.handler = returned.Sub(c.since)
	}
	if !c.called {
		w.runtime += c.since.Sub(c.answered)
	}
	return w
}

// ctxEnded reports whether a call failed with a context's error.
func (c *idleClock) ctxEnded() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ctxErr
}

// ran returns how long the database was given before a context's error
// ended a call (the longest such busy stretch), or else whole: the
// handler's run (a statement the clock did not see, through tx.Conn()).
func (c *idleClock) ran(whole time.Duration) time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ctxRan > 0 {
		return c.ctxRan
	}
	return whole
}

// isCtxErr reports whether err is, or wraps, a context's error: how
// pgconn reports a statement its context ended (context.Canceled as is, a
// deadline as a timeout error wrapping context.DeadlineExceeded).
func isCtxErr(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

// idle returns the longest idle stretch, the current one counted up to at
// (the handler's return).
func (c *idleClock) idle(at time.Time) time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.calls == 0 {
		return max(c.longest, at.Sub(c.since))
	}
	return c.longest
}

// clockedTx is the pgx.Tx a handler is given: tx, its database calls timed
// by clock.
type clockedTx struct {
	pgx.Tx
	clock *idleClock
}

func (t *clockedTx) Begin(ctx context.Context) (pgx.Tx, error) {
	t.clock.enter()
	defer t.clock.exit()
	tx, err := t.Tx.Begin(ctx)
	t.clock.failed(err)
	if err != nil {
		return tx, err
	}
	return &clockedTx{Tx: tx, clock: t.clock}, nil
}

func (t *clockedTx) Commit(ctx context.Context) error {
	t.clock.enter()
	defer t.clock.exit()
	err := t.Tx.Commit(ctx)
	t.clock.failed(err)
	return err
}

func (t *clockedTx) Rollback(ctx context.Context) error {
	t.clock.enter()
	defer t.clock.exit()
	err := t.Tx.Rollback(ctx)
	t.clock.failed(err)
	return err
}

func (t *clockedTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	t.clock.enter()
	defer t.clock.exit()
	n, err := t.Tx.CopyFrom(ctx, table, columns, src)
	t.clock.failed(err)
	return n, err
}

func (t *clockedTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	from := t.clock.enterFrom()
	defer t.clock.exit()
	return &clockedBatch{BatchResults: t.Tx.SendBatch(ctx, b), clock: t.clock, from: from}
}

func (t *clockedTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	t.clock.enter()
	defer t.clock.exit()
	sd, err := t.Tx.Prepare(ctx, name, sql)
	t.clock.failed(err)
	return sd, err
}

func (t *clockedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	t.clock.enter()
	defer t.clock.exit()
	tag, err := t.Tx.Exec(ctx, sql, args...)
	t.clock.failed(err)
	return tag, err
}

func (t *clockedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	from := t.clock.enterFrom()
	defer t.clock.exit()
	rows, err := t.Tx.Query(ctx, sql, args...)
	t.clock.failed(err)
	if err != nil {
		return rows, err
	}
	return &clockedRows{Rows: rows, clock: t.clock, from: from}, nil
}

func (t *clockedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	from := t.clock.enterFrom()
	defer t.clock.exit()
	return &clockedRow{row: t.Tx.QueryRow(ctx, sql, args...), clock: t.clock, from: from}
}

// clockedRows times the reads of a result: Next and Close wait for the
// server's answer.
type clockedRows struct {
	pgx.Rows
	clock *idleClock
	from  windowFrom // of the call that sent the statement (enterFrom)
}

func (r *clockedRows) Next() bool {
	r.clock.enter()
	defer r.clock.exit()
	if r.Rows.Next() {
		return true
	}
	r.clock.failedFrom(r.Rows.Err(), &r.from)
	return false
}

func (r *clockedRows) Close() {
	r.clock.enter()
	defer r.clock.exit()
	r.Rows.Close()
	r.clock.failedFrom(r.Rows.Err(), &r.from)
}

// clockedRow times QueryRow's Scan, which reads the answer.
type clockedRow struct {
	row   pgx.Row
	clock *idleClock
	from  windowFrom // of the call that sent the statement (enterFrom)
}

func (r *clockedRow) Scan(dest ...any) error {
	r.clock.enter()
	defer r.clock.exit()
	err := r.row.Scan(dest...)
	r.clock.failedFrom(err, &r.from)
	return err
}

// clockedBatch times the reads of a batch's results.
type clockedBatch struct {
	pgx.BatchResults
	clock *idleClock
	from  windowFrom // of SendBatch (enterFrom)
}

func (b *clockedBatch) Exec() (pgconn.CommandTag, error) {
	b.clock.enter()
	defer b.clock.exit()
	tag, err := b.BatchResults.Exec()
	b.clock.failedFrom(err, &b.from)
	return tag, err
}

func (b *clockedBatch) Query() (pgx.Rows, error) {
	b.clock.enter()
	defer b.clock.exit()
	rows, err := b.BatchResults.Query()
	b.clock.failedFrom(err, &b.from)
	if err != nil {
		return rows, err
	}
	return &clockedRows{Rows: rows, clock: b.clock, from: b.from}, nil
}

func (b *clockedBatch) QueryRow() pgx.Row {
	b.clock.enter()
	defer b.clock.exit()
	return &clockedRow{row: b.BatchResults.QueryRow(), clock: b.clock, from: b.from}
}

func (b *clockedBatch) Close() error {
	b.clock.enter()
	defer b.clock.exit()
	err := b.BatchResults.Close()
	b.clock.failedFrom(err, &b.from)
	return err
}
