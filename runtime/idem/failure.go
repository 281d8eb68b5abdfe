package idem

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"runtime/pprof"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/runtime/internal/db"
	"github.com/idemgen/idemgen/runtime/internal/guardlane"
)

// A consumer sees two kinds of failure and never mixes them (DESIGN.md,
// "Failure paths"):
//
//   - the record's: it cannot be decoded, has no event id, its handler
//     returns an error or panics. These use the record's retry budget and
//     end as a dead letter.
//   - the infrastructure's: PostgreSQL is unreachable, blackholed, restarting,
//     or aborts the transaction for concurrency reasons. These use no budget:
//     the processor waits until the database answers or the context ends.
//
// The database ending an attempt because of the handler itself (its
// statement hits statement_timeout, it idles past
// idle_in_transaction_session_timeout), or a context of the handler's own
// ending its statement by closing the connection while the database
// answers, is the record's: see handlerCulprit and ownCtxError.
//
// Mixing them either dead-letters good records during a database blip, or
// retries a poison record forever.

// storageError is a failure of one of the processor's own statements (BEGIN,
// the dedupe insert, COMMIT, a dead-letter write).
type storageError struct {
	op  string
	err error
}

func (e *storageError) Error() string { return e.op + ": " + e.err.Error() }
func (e *storageError) Unwrap() error { return e.err }

// outageError marks a handler error that is really the database failing
// under the handler (its connection died, a serialization failure): waited
// out like a storageError, never charged to the record.
type outageError struct{ err error }

func (e *outageError) Error() string { return e.err.Error() }
func (e *outageError) Unwrap() error { return e.err }

// panicError is a panic recovered from user code: the handler, Decode, or
// the event-id accessor. It is the record's failure.
type panicError struct {
	where string
	value any
	stack []byte
}

func (e *panicError) Error() string { return fmt.Sprintf("panic in %s: %v", e.where, e.value) }

// handlerFailure classifies the error a handler returned on tx; ctx is the
// runtime's. A session the server ended (25P03 included) is an outage
// here, on a closed connection, and so is a connection the handler's own
// context closed; whether the handler idled it away, or its context ended
// a statement the database would have answered, is decided after
// (handlerSuspect, handlerCulprit).
func handlerFailure(ctx context.Context, tx pgx.Tx, err error) error {
	var pe *panicError
	if errors.As(err, &pe) {
		return err
	}
	// A dead connection means the database went away under the handler
	// (pgconn closes the connection on any network failure); whatever the
	// handler made of that error, the record is not at fault. Unless the
	// handler's own context closed it (pgconn's default context watcher):
	// the caller asks ownCtxCause.
	if tx.Conn().IsClosed() {
		return &outageError{err: err}
	}
	if connLeftBusy(tx) {
		// Checked before isOutageError: the handler's own next statement
		// fails with "conn busy", which pgconn calls safe to retry.
		return fmt.Errorf("%w: %w", errConnLeftBusy, err)
	}
	if pgCode(err) == "57014" && ctx.Err() == nil {
		// Checked before isOutageError, which counts 57014 as the
		// database's: the connection is open and the runtime did not
		// cancel, so the server cancelled the handler's own statement, and
		// will again on the next attempt.
		return fmt.Errorf("%w: %w", errStatementCancelled, err)
	}
	if isOutageError(err) {
		return &outageError{err: err}
	}
	return err
}

// errConnLeftBusy is a handler returning with its transaction's connection
// still busy: every statement after that, COMMIT included, fails with
// pgconn's "conn busy" (safe to retry, nothing was sent), so it looked like
// an outage and was waited out forever. It is the handler's doing and
// recurs on every attempt: the record's failure.
var errConnLeftBusy = errors.New("the handler left its transaction's connection busy (a Rows not closed, a QueryRow not scanned)")

// connLeftBusy reports whether tx's connection is open and still reading a
// result the handler started and did not finish.
func connLeftBusy(tx pgx.Tx) bool {
	c := tx.Conn()
	return !c.IsClosed() && c.PgConn().IsBusy()
}

// errTxEndedByHandler is a handler returning nil after ending its
// transaction itself: tx.Commit or tx.Rollback, or a COMMIT, ROLLBACK,
// ABORT or END statement. After a ROLLBACK statement nothing was left to
// commit — not the effect, not the processed-event row — yet the COMMIT
// that followed "succeeded" (PostgreSQL only warns that no transaction is
// in progress), so the record was reported applied and its offset marked:
// lost. Statements run after it (the next records of a batch) were
// autocommitted without their processed-event rows, applied again on
// redelivery. It is the record's failure, whichever way the transaction
// ended (a COMMIT statement made it durable: the retry is a duplicate).
var errTxEndedByHandler = errors.New("the handler ended its transaction itself (Commit, Rollback, or a COMMIT/ROLLBACK statement)")

// handlerLeftTx checks the transaction a handler returned nil on, before
// anything else runs on it: left busy, or ended by the handler, it is the
// record's failure. A closed connection is left to COMMIT to report (an
// outage).
func handlerLeftTx(tx pgx.Tx) error {
	c := tx.Conn()
	switch {
	case c.IsClosed():
		return nil
	case c.PgConn().IsBusy():
		return errConnLeftBusy
	case c.PgConn().TxStatus() == 'I':
		return errTxEndedByHandler
	}
	return nil
}

// isOutage reports whether err, from one attempt, is an infrastructure
// failure (wait, use no attempt) rather than the record's.
func (p *Processor) isOutage(err error) bool {
	var oe *outageError
	if errors.As(err, &oe) {
		return true
	}
	var se *storageError
	if errors.As(err, &se) {
		// Our own statements fail because of the record only when the
		// record's data cannot be stored (an event id with a NUL byte: 22021;
		// too long for an index: 54000). Anything else is the database.
		return !isDataError(se.err)
	}
	return false
}

// unstorableIDError is the record's pipeline (BEGIN and the dedupe insert,
// whose only value from the record is its event id) refused by PostgreSQL
// for the id itself: invalid UTF-8 (22021; with the simple protocol the id
// is inlined, and the whole pipeline, BEGIN first, is refused), a character
// the server encoding lacks (22P05), or an id too large for the
// processed-event index (54000). The record's failure, and one that recurs
// on every attempt: it is dead-lettered at once, its raw bytes kept, rather
// than retried through its budget.
type unstorableIDError struct{ err error }

func (e *unstorableIDError) Error() string { return e.err.Error() }
func (e *unstorableIDError) Unwrap() error { return e.err }

// unstorableID returns err, the failure of the record's pipeline, as an
// *unstorableIDError when PostgreSQL refused the event id: the SQLSTATE is
// one an id can cause, and this id can cause it. The SQLSTATE alone does not
// say the id was refused: a trigger on idem_processed_events raises what it
// likes, and the server raises 54000 for its own limits too (the wraparound
// stop, "not accepting commands that assign new transaction IDs"); a valid
// record was then dead-lettered on its first attempt. An id that cannot be
// the cause leaves err as it was (a data error: the retry budget).
func unstorableID(err error, id, ctxName, clientEncoding string) error {
	if idRefusable(pgCode(err), id, ctxName, clientEncoding) {
		return &unstorableIDError{err: err}
	}
	return err
}

// maxIndexableID is a length of context and event id together below which
// the processed-event index cannot refuse them (54000): the smallest btree
// item limit, for 1 KiB pages, is above it (2704 bytes for the default 8
// KiB); compression only makes the index row smaller.
const maxIndexableID = 256

// idRefusable reports whether PostgreSQL can refuse id with code: invalid
// byte sequences (22021) and untranslatable characters (22P05) need a byte
// outside ASCII, which every client and server encoding holds (and with a
// UTF8 client encoding, 22021 needs invalid UTF-8); an index row too large
// (54000) needs a long id.
func idRefusable(code, id, ctxName, clientEncoding string) bool {
	switch code {
	case "22021":
		if clientEncoding == "UTF8" {
			return !utf8.ValidString(id)
		}
		return !isASCII(id)
	case "22P05":
		return !isASCII(id)
	case "54000":
		return len(ctxName)+len(id) > maxIndexableID
	}
	return false
}

func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= utf8.RuneSelf {
			return false
		}
	}
	return true
}

// isDataError reports whether PostgreSQL refused the values themselves:
// SQLSTATE class 22 (data exception: invalid byte sequence 22021, untranslatable
// character 22P05, ...) and class 54 (program limit exceeded, e.g. an index
// row too large).
func isDataError(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	return strings.HasPrefix(pgErr.Code, "22") || strings.HasPrefix(pgErr.Code, "54")
}

// commitRefusedByWrites reports whether a COMMIT failed because of what the
// handler did in the transaction, while the database answered normally:
//   - pgx.ErrTxCommitRollback: the transaction was aborted by a statement
//     whose error the handler swallowed, so COMMIT answered ROLLBACK;
//   - pgx.ErrTxClosed: the handler committed or rolled back the transaction
//     itself;
//   - any PgError that is not an outage (isOutageError): a deferred
//     constraint or a deferred trigger refusing the handler's writes (class
//     23, P0001, ...).
//
// Each recurs on every attempt with the database healthy, so it is the
// record's failure: it uses the budget and ends as a dead letter. A network
// error, a timeout or an outage SQLSTATE (40001 at COMMIT of a serializable
// transaction, 57P01, 53100 disk full, ...) stays an outage, and so does a
// session the server ended (FATAL: 25P03 the idle-in-transaction timeout,
// ...) or a connection that died: no verdict on the writes, and the COMMIT
// may or may not have taken effect (a 25P03 the handler caused by idling is
// charged to it afterwards, by handlerCulprit).
func commitRefusedByWrites(tx pgx.Tx, err error) bool {
	if sessionEnded(err) || tx.Conn().IsClosed() {
		return false
	}
	if errors.Is(err, pgx.ErrTxCommitRollback) || errors.Is(err, pgx.ErrTxClosed) {
		return true
	}
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && !isOutageError(err)
}

// isOutageError reports whether an error returned by a handler is
// PostgreSQL failing rather than the handler: connection exceptions (08),
// shutdown and cancellation (57P01-03, 57014; a 57014 of the handler's own
// statement with the runtime's context alive is the handler's, and
// handlerFailure sees it first),
// insufficient resources (53), serialization failures and deadlocks (40001,
// 40P01), lock timeouts (55P03), and pgconn's own "nothing was sent, safe to
// retry" and connect errors. Plain network errors are deliberately not on
// the list: a handler's downstream HTTP call failing is the record's failure
// and uses its budget; only the database's connection dying (seen through
// the transaction's closed connection) is an outage. Nor is a statement run
// on a context the handler itself cancelled or let expire (pgconn calls that
// "safe to retry" because nothing was sent, but it fails again on every
// attempt while the database is healthy); the processor's own cancellation
// is seen before any error is classified. System errors (58, XX) are the
// server's.
func isOutageError(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch c := pgErr.Code; {
		case strings.HasPrefix(c, "08"), strings.HasPrefix(c, "53"), strings.HasPrefix(c, "58"), strings.HasPrefix(c, "XX"):
			return true
		case c == "57P01", c == "57P02", c == "57P03", c == "57014", c == "40001", c == "40P01", c == "55P03":
			return true
		}
		return false
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var ce *pgconn.ConnectError
	return errors.As(err, &ce) || pgconn.SafeToRetry(err)
}

// safeDecode decodes rec and reads its event id; a panic in user code (a
// Decode function, an id accessor dereferencing a nil pointer) is the
// record's failure, never the consumer's end.
// w, when not nil, is the record's inline guard (see processOnLane): the
// call is made on this goroutine.
func safeDecode(ctx context.Context, w *inlineGuard, h *EventHandler, rec *Record) (ev any, id string, err error) {
	guardErr := w.guarded(ctx, whereDecode, func() error {
		var derr error
		ev, id, derr = h.decode(rec)
		return derr
	})
	if guardErr != nil {
		return nil, "", guardErr
	}
	return ev, id, nil
}

// safeCall runs the handler; a panic is the record's failure. w is as in
// safeDecode.
func safeCall(ctx context.Context, w *inlineGuard, h *EventHandler, tx pgx.Tx, ev any) error {
	return w.guarded(ctx, whereHandler, func() error { return h.call(ctx, tx, ev) })
}

// The places user code runs, as a panicError names them.
const (
	whereDecode  = "decoding the record or reading its event id"
	whereHandler = "handler"
	whereHooks   = "the consumer's hooks (a logger, meter or tracer) while applying the record"
)

// inlineGuard is guarded for a goroutine that may end: the lane worker
// that runs a whole record (processOnLane) calls the record's user code
// (decode, handler) directly instead of handing each call to another
// goroutine, which cost the Kafka consumer two goroutine hand-offs per
// record (one now: its own CPU per record 193–213 µs before, 170–189
// after, BenchmarkProcessRecord; BENCHMARKS.md). A panic is
// recovered as guarded recovers it. runtime.Goexit cannot be: it ends the
// worker, the runtime's deferred calls on the way out (the transaction's
// rollback, the connection's release) run, and the caller, still waiting
// on its own goroutine, reads here where it happened and goes on from
// there (processOnLane). It is used by one goroutine at a time.
type inlineGuard struct {
	where   string // the user code running or last run
	decoded bool   // ev and id hold the record's decoded event
	ev      any
	id      string
	attempt int // attempts used before the one running
	index   int // in a batch: the record whose handler runs or ran last
	// committing: the record's COMMIT is being sent or answered (its
	// outcome unknown if the worker ends there); processOnLane.
	committing bool
	verifying  bool            // a check that the record is committed runs (resume.verify)
	dead       *deadLetterCall // the record's dead letter, decided (processFrom)
	// ended is the failure of the user code that ended the worker (set as
	// the worker unwinds, cleared when the call returns): runtime.Goexit,
	// or a panic a deferred call raised during the Goexit, which the guard
	// recovers but which does not stop the Goexit.
	ended error
}

// guarded runs fn as the package-level guarded does: on this goroutine
// when w is not nil, on another one otherwise.
func (w *inlineGuard) guarded(ctx context.Context, where string, fn func() error) error {
	if w == nil {
		return guarded(ctx, where, fn)
	}
	err := w.call(ctx, where, fn)
	w.ended = nil // returned: the worker goes on
	return err
}

func (w *inlineGuard) call(ctx context.Context, where string, fn func() error) (err error) {
	w.where = where
	returned := false
	defer func() {
		if r := recover(); r != nil {
			err = &panicError{where: where, value: r, stack: debug.Stack()}
		} else if !returned {
			// runtime.Goexit (the worker is ending), or a panic(nil) that
			// recover reports as nil (GODEBUG panicnil=1): guarded takes
			// both for a Goexit, and so does this. Taken for a return, the
			// handler's half-done writes were committed.
			err = &panicError{where: where, value: errGoexit}
		}
		w.ended = err
		debug.SetPanicOnFault(false) // as guarded: not left to the runtime's code or the next call
		pprof.SetGoroutineLabels(ctx)
	}()
	err = fn()
	returned = true
	return err
}

// errGoexit is user code that ended its goroutine with runtime.Goexit
// (t.FailNow in a test handler, a library calling it).
var errGoexit = errors.New("called runtime.Goexit")

// guarded runs user code fn and turns a panic, or runtime.Goexit, into the
// record's failure. fn runs on a goroutine other than the caller's because
// Goexit cannot be recovered: run on the partition's goroutine it ended that
// goroutine silently, so neither the record nor the rest of the poll was
// done or rewound, and the next marks committed past them (records lost).
//
// The Kafka consumer's records do not come here one call at a time: when
// ctx carries a guardlane.Lane (the per-partition loop makes one per poll),
// the whole record or batch runs on the lane's worker and its user code is
// called there directly (inlineGuard, processOnLane, applyBatchGuarded).
// A call that does come here with a free lane runs on the lane's worker,
// reused from one call to the next: a goroutine started per call began with
// a small stack and grew it (a copy) in every handler that runs pgx, and
// its start and end cost scheduler work. Otherwise (a direct Processor
// call, or a lane held by another call, such as a call made from inside a
// record's user code) fn runs on a goroutine of its own. A lane is never
// shared across loops, and its worker ends with the loop: nothing outlives
// the caller, and a consumer run inside a testing/synctest bubble keeps its
// goroutines and channels inside it (a process-wide pool of workers broke
// both). A worker
// whose fn called Goexit ends there (its deferred calls run, so the caller
// is answered), and the lane's next call starts a new one.
//
// fn runs under ctx's profiler labels (pprof.Do around a consumer's Run
// labels its handlers' samples), and a reused worker leaves neither labels
// nor debug.SetPanicOnFault to the next call. Code that locks the worker to
// its OS thread (runtime.LockOSThread) and returns without unlocking is not
// detected: the worker, still locked, runs the lane's later calls on that
// thread, as net/http runs the next request of a keep-alive connection on
// the goroutine that ran the one before. Handlers must not leave their
// thread locked.
func guarded(ctx context.Context, where string, fn func() error) error {
	job := &guardJob{ctx: ctx, where: where, fn: fn, done: make(chan struct{})}
	if l := guardlane.From(ctx); l != nil && l.Acquire() {
		l.Run(job.run)
		<-job.done
		l.Release()
	} else {
		go job.run()
		<-job.done
	}
	if !job.returned {
		return &panicError{where: where, value: errGoexit, stack: nil}
	}
	return job.err
}

// guardJob is one guarded call: fn's result, and whether fn returned (or
// panicked) rather than called Goexit.
type guardJob struct {
	ctx      context.Context // its profiler labels are fn's
	where    string
	fn       func() error
	err      error
	returned bool
	done     chan struct{}
}

func (j *guardJob) run() {
	defer close(j.done)
	pprof.SetGoroutineLabels(j.ctx)
	defer pprof.SetGoroutineLabels(context.Background()) // none left to the next job
	defer debug.SetPanicOnFault(false)                   // per goroutine too: not left to the next job
	defer func() {
		if r := recover(); r != nil {
			j.err = &panicError{where: j.where, value: r, stack: debug.Stack()}
			j.returned = true
		}
	}()
	j.err = j.fn()
	j.returned = true
}

// maxErrorText bounds the error text stored in a dead letter.
const maxErrorText = 4096

// sanitizeText makes s storable in a text column whatever bytes it holds: a
// NUL byte (which PostgreSQL text cannot hold: 22021) becomes the visible
// escape \x00, invalid UTF-8 becomes U+FFFD, and the result is cut to at most
// max bytes on a rune boundary. It exists because the failure path must not
// fail on data: a handler error quoting the record's bytes used to make the
// dead-letter insert fail forever.
func sanitizeText(s string, max int) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = strings.ReplaceAll(s, "\x00", `\x00`)
	if len(s) <= max {
		return s
	}
	const more = "…(truncated)"
	cut := max - len(more)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + more
}

// A session the server ends with 25P03 (idle_in_transaction_session_timeout)
// or a statement it cancels with 57014 is usually no verdict on a record: a
// process frozen in the runtime's own code (SIGSTOP, a paused VM, a GC
// pause) between the handler's return and the COMMIT is ended the same way,
// and that must never use up a good record's budget. But when the runtime
// can tell the handler caused it, the failure recurs on every attempt while
// the database is healthy, and waiting it out as an outage blocked the
// partition forever under a misleading "storage unavailable". So:
//
//   - 25P03 is the handler's when the handler itself held the transaction
//     idle (monotonic clock, no database call of its own in flight: see
//     idleClock) for at least the session's
//     idle_in_transaction_session_timeout in one stretch, and the runtime's
//     own time after it (until the failed COMMIT answered) was shorter
//     than that: no idle stretch of the runtime's could have reached the
//     timeout alone. A handler whose time went into its own statements
//     (a slow or stalled network leaves the server idle while an answer or
//     the next statement is on its way) is not charged. Otherwise it stays
//     an outage.
//   - 57014 (query_canceled) from one of the handler's own statements, on
//     a connection still open and with the runtime's context alive, is the
//     handler's: statement_timeout, a context of the handler's own with a
//     cancel-request watcher, or an operator's pg_cancel_backend. The
//     runtime's cancellation is seen first; the runtime's own statements
//     (BEGIN, the dedupe insert, COMMIT) keep 57014 an outage.
//
// A process frozen while the handler itself runs between its statements
// cannot be told apart from a handler that idles: it costs the record one
// attempt.

// idleTimeoutError is a session the server ended because the handler held
// its transaction idle past idle_in_transaction_session_timeout; idle is
// the handler's longest idle stretch.
type idleTimeoutError struct {
	idle, timeout time.Duration
	err           error // the server's error, never a *storageError
}

func (e *idleTimeoutError) Error() string {
	return fmt.Sprintf("the handler held its transaction idle (no statement of its own running) for %v, longer than idle_in_transaction_session_timeout (%v) lets it sit idle: "+
		"the server ended the session and rolled the attempt back (keep slow work outside the transaction, or raise the timeout): %v",
		e.idle.Round(time.Millisecond), e.timeout, e.err)
}
func (e *idleTimeoutError) Unwrap() error { return e.err }

// errStatementCancelled is a statement of the handler the server cancelled
// (57014) while the runtime's context was alive.
var errStatementCancelled = errors.New("a statement of the handler was cancelled by the server (statement_timeout, the handler's own context, or pg_cancel_backend)")

// idleEnded is the SQLSTATE of a session ended by
// idle_in_transaction_session_timeout.
const idleEnded = "25P03"

// idleCulprit returns err as an *idleTimeoutError when it is a session
// ended by idle_in_transaction_session_timeout that the handler caused: its
// longest idle stretch, idle (idleClock), was at least timeout, and the
// runtime's own time after it, after, was shorter. timeout is what idleTimeout returns; 0 (unknown or off) never
// blames the handler.
func idleCulprit(err error, idle, after, timeout time.Duration) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != idleEnded || timeout <= 0 || idle < timeout || after >= timeout {
		return nil
	}
	return &idleTimeoutError{idle: idle, timeout: timeout, err: pgErr}
}

// idleTimeout returns the idle_in_transaction_session_timeout of the
// runtime's transactions: configured (set with BEGIN), or, when left to the
// session (configured <= 0), read from a connection of pool, asked only
// when a session ended with 25P03 after a handler that idled long enough
// to be the cause. 0 when off or when it cannot be read (the database down:
// then it stays an outage).
func idleTimeout(ctx context.Context, pool *pgxpool.Pool, configured, bound time.Duration) time.Duration {
	d, _ := idleTimeoutKnown(ctx, pool, configured, bound)
	return d
}

// idleTimeoutKnown is idleTimeout, and whether the timeout is known: false
// when the session's could not be read. A known 0 is off.
func idleTimeoutKnown(ctx context.Context, pool *pgxpool.Pool, configured, bound time.Duration) (time.Duration, bool) {
	if configured > 0 {
		return configured, true
	}
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	ms, err := db.New(pool).SessionIdleInTransactionTimeout(ctx)
	if err != nil {
		return 0, false
	}
	return time.Duration(max(ms, 0)) * time.Millisecond, true
}

// handlerSuspect is an attempt's failure that reads as an outage but that
// the handler may have caused:
//
//   - a session the server ended with 25P03, at the handler's statement or
//     at the COMMIT, with the handler's longest idle stretch (see
//     idleClock) and the runtime's own time after it;
//   - a connection closed under the handler while a context of the
//     handler's own ended one of its statements (ownCtx: see ownCtxCause).
//
// process decides whose failure it is (handlerCulprit) once applyOnce has
// returned the attempt's connection to the pool: reading the session's
// timeout, or checking that the database answers, must not wait for the
// very connection the attempt holds (a pool of one would wait
// StorageTimeout and call it an outage).
type handlerSuspect struct {
	err         error // as classified without the rules: an outage
	idle, after time.Duration
	// ownCtx, when not nil, is what the handler returned after its own
	// context ended one of its statements and closed the connection
	// (errOwnCtxSwallowed when it returned nil).
	ownCtx error
	// ran is how long the database was given to answer before that
	// context ended the statement (see dbAnswers).
	ran time.Duration
	// window, when not nil, is the idle window the 25P03 ended (see
	// idleWindow).
	window *idleWindow
	// closedNil: the handler returned nil on a transaction whose
	// connection is closed, with no failed call of its own to say why.
	closedNil bool
}

func (e *handlerSuspect) Error() string { return e.err.Error() }
func (e *handlerSuspect) Unwrap() error { return e.err }

// suspectIdle returns err as a *handlerSuspect when it is a session ended
// with 25P03 after a handler whose longest idle stretch was idle, the
// runtime's time after it being after.
func suspectIdle(err error, idle, after time.Duration) error {
	return suspect(err, idle, after, nil, 0)
}

// suspect returns err as a *handlerSuspect when it is a session ended with
// 25P03 (idle and after as in suspectIdle) or when ownCtx is not nil (see
// ownCtxCause; ran as in handlerSuspect); otherwise err.
func suspect(err error, idle, after time.Duration, ownCtx error, ran time.Duration) error {
	if ownCtx == nil && pgCode(err) != idleEnded {
		return err
	}
	return &handlerSuspect{err: err, idle: idle, after: after, ownCtx: ownCtx, ran: ran}
}

// withWindow adds w, the idle window the failure ended, to err when it is
// a *handlerSuspect of a 25P03.
func withWindow(err error, w idleWindow) error {
	if s, ok := err.(*handlerSuspect); ok && pgCode(s.err) == idleEnded {
		s.window = &w
	}
	return err
}

// handlerCulprit resolves a *handlerSuspect in err: the record's failure
// (*idleTimeoutError, *ownCtxError) when the handler caused it (see above
// and ownCtxError), otherwise the error without the rules (an outage).
// Other errors pass through. slow is how many attempts in a row before this
// one were a *slowProbeError.
func (p *Processor) handlerCulprit(ctx context.Context, err error, slow int) error {
	var s *handlerSuspect
	if !errors.As(err, &s) {
		return err
	}
	// The cheap test first: a handler never idle as long as the configured
	// timeout is never the cause, and no query is needed to say so.
	if pgCode(s.err) == idleEnded && s.idle >= p.cfg.IdleInTransactionTimeout {
		if ie := idleCulprit(s.err, s.idle, s.after, idleTimeout(ctx, p.pool, p.cfg.IdleInTransactionTimeout, p.cfg.StorageTimeout)); ie != nil {
			return ie
		}
	}
	if s.window != nil || s.closedNil {
		if err := p.closedCulprit(ctx, s, slow); err != nil {
			return err
		}
	}
	if s.ownCtx != nil {
		switch dbAnswers(ctx, p.pool, p.cfg.StorageTimeout, s.ran) {
		case answers:
			return &ownCtxError{err: s.ownCtx}
		case slowAnswer:
			if slow+1 >= ownCtxSlowProbes {
				return &ownCtxError{err: s.ownCtx}
			}
			return &slowProbeError{err: s.err}
		}
	}
	return s.err
}

// A handler may bound a statement with a context of its own:
//
//	qctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
//	defer cancel()
//	_, err := tx.Exec(qctx, "...")
//
// or cancel one it made (context.WithCancel). When that context ends
// while the statement runs, pgx's default context watcher
// (pgconn.DeadlineContextWatcherHandler) ends the statement by closing the
// connection, and pgconn returns context.Canceled, or a timeout error
// wrapping context.DeadlineExceeded. A closed connection under a handler
// is otherwise the database going away (an outage: no attempt used), and
// this was waited out forever: the statement is ended the same way on
// every attempt, and the record blocked its partition for good.
//
// But the handler's deadline also fires when the database does not answer
// (blackholed, a network partition): that is an outage and must use no
// attempt. So whose it is is decided after the attempt's connection is
// back in the pool (handlerCulprit), by a round trip on another connection
// of the pool bounded by StorageTimeout, the bound within which the
// runtime's own statements call the database available (dbAnswers): the
// database answering means the handler's context ended its statement, the
// record's failure (*ownCtxError), which uses the budget and ends as a
// dead letter; no answer, an outage as before. A deadline too short for
// the database as it is (slow statements, lock waits, a slow network that
// still answers within StorageTimeout) fails the record, as a
// statement_timeout does (57014, and a pool whose context watcher sends a
// cancel request gets 57014 for the handler's own deadline too): the
// handler chose it, and it would fail again on every attempt.
//
// The suspicion needs the runtime's context alive (its own cancellation is
// seen first), the handler's connection closed, and a context's error
// either in what the handler returned or in a call of the handler's seen
// by idleClock: a handler that loses the error's chain (%v) or drops it
// and returns nil is caught through the latter, a statement sent through
// tx.Conn() through the former only.

// ownCtxError is a statement of the handler ended by a context of the
// handler's own, which closed the connection, while the database answers:
// the record's failure. err is what the handler returned.
type ownCtxError struct{ err error }

func (e *ownCtxError) Error() string {
	return "the handler's own context (a deadline or cancel it set, not the runtime's) ended its statement, and pgx closed the connection to end it, " +
		"which rolled the attempt back; the database answers, so it is not an outage " +
		"(give the statement more time, or bound it with statement_timeout): " + e.err.Error()
}
func (e *ownCtxError) Unwrap() error { return e.err }

// errOwnCtxSwallowed is the cause of an *ownCtxError of a handler that
// returned nil after its own context ended one of its statements.
var errOwnCtxSwallowed = errors.New("the handler returned nil after its own context ended one of its statements (the statement's error was dropped)")

// errConnClosedUnderHandler is a handler returning nil on a transaction
// whose connection is closed: nothing can commit.
var errConnClosedUnderHandler = errors.New("the handler returned on a transaction whose connection is closed")

// ownCtxCause returns what to charge the record with when its handler's
// own context may have closed the connection (see above): err (what the
// handler returned), or errOwnCtxSwallowed when err is nil; nil when not:
// the runtime's context ctx ended, tx's connection is open, or neither err
// nor a call clock saw holds a context's error.
func ownCtxCause(ctx context.Context, tx pgx.Tx, clock *idleClock, err error) error {
	if !ownCtxClosed(ctx, tx, clock, err) {
		return nil
	}
	if err == nil {
		return errOwnCtxSwallowed
	}
	return err
}

// ownCtxClosed reports whether the runtime's context ctx is alive, tx's
// connection closed, and err or a call clock saw holds a context's error.
func ownCtxClosed(ctx context.Context, tx pgx.Tx, clock *idleClock, err error) bool {
	return ctx.Err() == nil && tx.Conn().IsClosed() && ((err != nil && isCtxErr(err)) || clock.ctxEnded())
}

// probeVerdict is what dbAnswers found.
type probeVerdict int

const (
	noAnswer   probeVerdict = iota // no answer within the bound: an outage
	answers                        // a prompt answer: the handler's own context
	slowAnswer                     // an answer slower than the statement was given, a second one not: see dbAnswers
)

// dbAnswers reports whether the database answers promptly: a round trip
// (pgx's Ping, an empty statement) on a connection of pool, the connection
// acquired first, in less than ran, the time the handler's statement was
// given before its own context ended it; all within bound.
//
// An answer that is merely eventual proves nothing about the time the
// statement ran: a network stall, or a database that froze for a few
// seconds, fires the handler's deadline, and a probe bounded by bound alone
// waited it out and got its answer, charging the record for the blip.
//
// A probe slower than ran is looked at further. A round trip on its
// connection as slow means the database's usual round trip is longer than
// the handler's deadline, which then ends its statement on every attempt:
// answers, the record's failure. Otherwise the probe waited before its
// round trip: for a stall, or for a connection to be made (a pool whose
// connections the handler's deadline closes makes one for every probe,
// which may take longer than the deadline) or freed by another. So a
// connection is made again, the probe's closed first (a pool of one): the
// first probe no slower than twice that is a connection being made,
// answers; slower, slowAnswer. The caller takes slowAnswer for an outage a
// few times in a row (ownCtxSlowProbes), then for the record's failure: a
// pool always busy must not block the record forever either.
func dbAnswers(ctx context.Context, pool *pgxpool.Pool, bound, ran time.Duration) probeVerdict {
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	first, c := probe(ctx, pool)
	if c == nil {
		return noAnswer
	}
	if first < ran {
		c.Release()
		return answers
	}
	start := time.Now()
	if c.Ping(ctx) != nil {
		c.Release()
		return noAnswer
	}
	if time.Since(start) >= ran {
		c.Release()
		return answers
	}
	_ = c.Hijack().Close(ctx)
	again, c := probe(ctx, pool)
	if c == nil {
		return noAnswer
	}
	c.Release()
	if first <= 2*again {
		return answers
	}
	return slowAnswer
}

// probe acquires a connection of pool and pings on it, returning the time
// both took and the connection (to release), or a nil connection when
// either failed.
func probe(ctx context.Context, pool *pgxpool.Pool) (time.Duration, *pgxpool.Conn) {
	start := time.Now()
	c, err := pool.Acquire(ctx)
	if err != nil {
		return 0, nil
	}
	if c.Ping(ctx) != nil {
		c.Release()
		return 0, nil
	}
	return time.Since(start), c
}

// ownCtxSlowProbes is how many slowAnswer verdicts in a row a record's
// attempts are waited out as an outage before the next is the record's
// failure. A stall must then coincide with the handler's statement on as
// many attempts in a row, each begun on a database that answered.
const ownCtxSlowProbes = 3

// slowProbeError is an attempt the handler's own context ended while a
// probe of the database answered only slowly (slowAnswer): waited out as
// the outage err is.
type slowProbeError struct{ err error }

func (e *slowProbeError) Error() string {
	return "the database answered only slowly after the handler's own context ended its statement: " + e.err.Error()
}
func (e *slowProbeError) Unwrap() error { return e.err }

// A 25P03 after a handler never idle as long as the runtime's timeout
// (IdleInTransactionTimeout, or the session's) was waited out as an
// outage. But a handler can lower the timeout in its own transaction
// (SET LOCAL idle_in_transaction_session_timeout, set_config, a function
// that does) and idle past that: then the server ends the session on
// every attempt, with the database healthy, and the record blocked its
// partition forever. Likewise a handler that got the 25P03 (or any error
// that closed the connection) from one of its statements and returned
// nil: its COMMIT failed on the closed connection, an outage, forever.
//
// Which timeout fired cannot be read from the dead session; when it fired
// can be bounded. The server times an idle stretch from a statement's
// answer leaving it to the next statement arriving; the FATAL is the
// answer to that next statement (or waits for it). So the server's idle
// stretch lies inside the client's window from sending the last statement
// the server answered to reading the FATAL: the runtime's BEGIN or the
// handler's last call, the time between (the handler's idling, the
// runtime's own time before calling it or after it returned), and the
// round trip that read the FATAL (a call of the handler's, or the
// COMMIT). A window shorter than the runtime's timeout proves that the
// timeout in force was lowered inside the transaction: only the
// handler's statements run there. Who then spent the time is what the
// parts of the window say:
//
//   - the handler held the transaction idle for most of it, and the
//     database answers a round trip faster than the handler idled: the
//     record's failure (*loweredIdleError), at once;
//   - the runtime's own time was most of it (a process frozen in the
//     runtime's code): an outage, never charged;
//   - otherwise (a round trip slow for a network stall, a timeout so short
//     that normal round trips reach it, a probe slower than the handler's
//     idling), unclear: waited out as an outage while the database
//     answers, at most ownCtxSlowProbes-1 times in a row; the next is the
//     record's failure. A stall would have to end the session on as many
//     tries in a row, each begun on a database that answered.
//
// A window as long as the runtime's timeout, or a timeout that cannot be
// read, leaves the 25P03 the outage it was (a process frozen, a network
// stalled that long). A handler that returned nil on a closed connection
// with no failed call of its own to show (closed through tx.Conn(), or
// by the handler) is unclear too, when the database answers.

// idleWindow is the client's window in which a session ended with 25P03:
// from sending the last statement the server answered to reading the
// FATAL (span), the handler's own idle stretch in it (handler) and the
// runtime's own time in it outside round trips (runtime).
type idleWindow struct {
	span, handler, runtime time.Duration
}

// windowVerdict is what an idleWindow says.
type windowVerdict int

const (
	windowOutage  windowVerdict = iota // the runtime's timeout may have fired, or the runtime's own time did it
	windowHandler                      // the timeout was lowered, and the handler idled most of the window
	windowUnclear                      // the timeout was lowered, the time went into round trips
)

// verdict judges w against timeout, the runtime's (0: off).
func (w idleWindow) verdict(timeout time.Duration) windowVerdict {
	switch {
	case timeout > 0 && w.span >= timeout:
		return windowOutage
	case 2*w.runtime > w.span:
		return windowOutage
	case 2*w.handler > w.span:
		return windowHandler
	}
	return windowUnclear
}

// loweredIdleError is a session the server ended with 25P03 within a
// window shorter than the runtime's idle_in_transaction_session_timeout:
// the handler's transaction lowered it (see idleWindow).
type loweredIdleError struct {
	window  idleWindow
	timeout time.Duration // the runtime's; 0: off
	tries   int           // unclear tries in a row that ended so; 0: the handler idled most of the window
	// swallowed: the handler got the error from its statement and
	// returned nil.
	swallowed bool
	err       error
}

func (e *loweredIdleError) Error() string {
	limit := "off"
	if e.timeout > 0 {
		limit = e.timeout.String()
	}
	how := fmt.Sprintf("the handler held its transaction idle for %v of it", e.window.handler.Round(time.Millisecond))
	if e.tries > 0 {
		how = fmt.Sprintf("it ended so on %d tries in a row while the database answered (the handler idle for %v of the last)", e.tries, e.window.handler.Round(time.Millisecond))
	}
	if e.swallowed {
		how += " (and it returned nil after a statement of its own failed so)"
	}
	return fmt.Sprintf("the server ended the session for idling in the transaction within %v, although the runtime's idle_in_transaction_session_timeout (%s) was never reached: "+
		"the handler's transaction lowered it (SET LOCAL idle_in_transaction_session_timeout, set_config, a function that sets it), and %s; "+
		"the attempt rolled back (raise that setting, or keep slow work outside the transaction): %v",
		e.window.span.Round(time.Millisecond), limit, how, e.err)
}
func (e *loweredIdleError) Unwrap() error { return e.err }

// unclearError is an attempt that ended on a closed connection the
// handler may have caused (see idleWindow) while the database answers:
// waited out as the outage err is, at most ownCtxSlowProbes-1 times in a
// row.
type unclearError struct{ err error }

func (e *unclearError) Error() string {
	return "the connection closed under the handler, maybe of its own doing, and the database answers: " + e.err.Error()
}
func (e *unclearError) Unwrap() error { return e.err }

// errSwallowedConnEnd is a handler returning nil after one of its calls
// failed and closed the connection.
var errSwallowedConnEnd = errors.New("the handler returned nil after one of its statements failed and closed the connection")

// closedCulprit judges s, a 25P03 with its window or a handler that
// returned nil on a closed connection (see idleWindow): the record's
// failure, an *unclearError, or nil when it is an outage as far as these
// rules go. slow is as in handlerCulprit.
func (p *Processor) closedCulprit(ctx context.Context, s *handlerSuspect, slow int) error {
	unclear := func(charge error) error {
		if dbAnswers(ctx, p.pool, p.cfg.StorageTimeout, p.cfg.StorageTimeout) == noAnswer {
			return nil
		}
		if slow+1 >= ownCtxSlowProbes {
			return charge
		}
		return &unclearError{err: s.err}
	}
	if s.closedNil {
		// The record's failure, not wrapping s.err: an outage by its type.
		return unclear(fmt.Errorf("%w (on %d tries in a row, the database answering): %v", errConnClosedUnderHandler, slow+1, s.err))
	}
	timeout, known := idleTimeoutKnown(ctx, p.pool, p.cfg.IdleInTransactionTimeout, p.cfg.StorageTimeout)
	if !known {
		return nil
	}
	var pgErr *pgconn.PgError
	if !errors.As(s.err, &pgErr) {
		return nil
	}
	// The server's error, never the *outageError or *storageError around
	// it: the record's failure.
	lowered := &loweredIdleError{window: *s.window, timeout: timeout, swallowed: errors.Is(s.err, errSwallowedConnEnd), err: pgErr}
	switch s.window.verdict(timeout) {
	case windowHandler:
		switch dbAnswers(ctx, p.pool, p.cfg.StorageTimeout, s.window.handler) {
		case answers:
			return lowered
		case noAnswer:
			return nil
		}
		fallthrough
	case windowUnclear:
		lowered.tries = slow + 1
		return unclear(lowered)
	}
	return nil
}
