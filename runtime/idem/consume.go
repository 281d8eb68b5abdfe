package idem

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"runtime/debug"
	"runtime/pprof"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemgen/idemgen/internal/crash"
	"github.com/idemgen/idemgen/runtime/internal/db"
	"github.com/idemgen/idemgen/runtime/internal/dbx"
	"github.com/idemgen/idemgen/runtime/internal/guardlane"
	"github.com/idemgen/idemgen/runtime/internal/telemetry"
)

// EventIDHeader is the record header that carries an event's id. The outbox
// relay sets it; consumers without an id= field read it.
const EventIDHeader = "idem-event-id"

// Record is one broker message, as a consumer engine (runtime/kafka) hands
// it to a Processor.
type Record struct {
	Topic     string
	Partition int32
	Offset    int64
	// Key and Value are nil for a null key or value, and empty (not nil) for
	// an empty one; dead letters keep the difference.
	Key   []byte
	Value []byte
	// Headers in the order the broker gave them; a name may repeat.
	Headers []RecordHeader
}

// RecordHeader is one record header.
type RecordHeader struct {
	Key   string
	Value []byte
}

// Header returns the value of the first header named key.
func (r *Record) Header(key string) ([]byte, bool) {
	for _, h := range r.Headers {
		if h.Key == key {
			return h.Value, true
		}
	}
	return nil, false
}

// EventSpec describes one //idem:consume handler of events of type T.
type EventSpec[T any] struct {
	// Topic is consumed; Context names the consumer in idem_processed_events:
	// each context applies each event once.
	Topic   string
	Context string
	// EventID returns the event's id from the decoded payload. Nil reads the
	// EventIDHeader record header instead. A panic in it (a nil pointer id
	// field) makes the record a dead letter at once, like an empty id or
	// one PostgreSQL cannot store (a NUL byte, invalid UTF-8, too large for
	// the processed-event index).
	EventID func(T) string
	// Decode decodes a record value. Nil decodes JSON.
	Decode func([]byte) (T, error)
}

// EventHandler is a type-erased //idem:consume handler; generated code builds
// it with Consume.
type EventHandler struct {
	Topic   string
	Context string
	decode  func(*Record) (event any, id string, err error)
	call    func(context.Context, pgx.Tx, any) error
}

// Consume returns the EventHandler that decodes records into T and applies
// them with fn, once per (spec.Context, event id).
func Consume[T any](spec EventSpec[T], fn func(context.Context, pgx.Tx, T) error) EventHandler {
	decode := spec.Decode
	if decode == nil {
		decode = func(b []byte) (T, error) {
			var v T
			err := json.Unmarshal(b, &v)
			return v, err
		}
	}
	return EventHandler{
		Topic:   spec.Topic,
		Context: spec.Context,
		decode: func(rec *Record) (any, string, error) {
			ev, err := decode(rec.Value)
			if err != nil {
				return nil, "", fmt.Errorf("decode %s: %w", rec.Topic, err)
			}
			var id string
			if spec.EventID != nil {
				id = spec.EventID(ev)
			} else if h, ok := rec.Header(EventIDHeader); ok {
				id = string(h)
			}
			if id == "" {
				return nil, "", fmt.Errorf("record has no event id (no %s header, or an empty id field)", EventIDHeader)
			}
			if i := strings.IndexByte(id, 0); i >= 0 {
				// PostgreSQL text never holds a NUL, whatever the pool's
				// exec mode; refused here, before any SQL, because with
				// QueryExecModeSimpleProtocol the id is inlined in the
				// query string, where a NUL breaks the protocol message
				// (08P01, an outage) instead of failing the insert (22021).
				return nil, "", fmt.Errorf("event id holds a NUL byte (byte %d of %d), which PostgreSQL text cannot store", i, len(id))
			}
			return ev, id, nil
		},
		call: func(ctx context.Context, tx pgx.Tx, ev any) error { return fn(ctx, tx, ev.(T)) },
	}
}

// Outcome is what became of a record.
type Outcome int

const (
	// Applied: the handler ran and its transaction committed.
	Applied Outcome = iota + 1
	// Duplicate: the context had applied this event id before; the handler
	// did not run.
	Duplicate
	// DeadLettered: the record could not be decoded, had no event id or one
	// PostgreSQL cannot store, or failed past the retry budget; it is stored
	// in idem_dead_letters.
	DeadLettered
)

func (o Outcome) String() string {
	switch o {
	case Applied:
		return "applied"
	case Duplicate:
		return "duplicate"
	case DeadLettered:
		return "dead-lettered"
	}
	return "unknown"
}

// RetryPolicy is how a failing handler is retried before its record is
// dead-lettered. Only the record's own failures count against it; see
// ProcessorConfig.Outage for storage failures.
type RetryPolicy struct {
	// MaxAttempts is how many times the handler runs before the record is
	// dead-lettered (default 5).
	MaxAttempts int
	// Initial and Max bound the exponential backoff between attempts
	// (defaults 100ms and 5s), with jitter.
	Initial, Max time.Duration
}

func (p RetryPolicy) withDefaults() RetryPolicy {
	if p.MaxAttempts <= 0 {
		p.MaxAttempts = 5
	}
	p.Initial, p.Max = Backoff{p.Initial, p.Max}.withDefaults().values()
	return p
}

// backoff returns the wait before attempt n+1 (n >= 1).
func (p RetryPolicy) backoff(n int) time.Duration { return Backoff{p.Initial, p.Max}.wait(n) }

// Backoff is a capped exponential backoff with jitter.
type Backoff struct {
	// Initial is the first wait (default 100ms); it doubles up to Max
	// (default 5s). Each wait is drawn between half and all of its value.
	Initial, Max time.Duration
}

func (b Backoff) withDefaults() Backoff {
	if b.Initial <= 0 {
		b.Initial = 100 * time.Millisecond
	}
	if b.Max <= 0 {
		b.Max = 5 * time.Second
	}
	if b.Max < b.Initial {
		b.Max = b.Initial
	}
	return b
}

func (b Backoff) values() (time.Duration, time.Duration) { return b.Initial, b.Max }

// wait returns the n-th wait (n >= 1): Initial·2^(n-1), capped at Max,
// between half and all of it. Jitter keeps replicas that failed together from
// retrying in lockstep against a database that is coming back.
func (b Backoff) wait(n int) time.Duration {
	d := b.Initial << min(max(n-1, 0), 30)
	if d > b.Max || d <= 0 {
		d = b.Max
	}
	return d/2 + rand.N(d/2+1)
}

func (b Backoff) validate(what string) error {
	if b.Initial < 0 || b.Max < 0 {
		return fmt.Errorf("%s: negative backoff", what)
	}
	if b.Initial > 0 && b.Max > 0 && b.Max < b.Initial {
		return fmt.Errorf("%s: Max %v is below Initial %v", what, b.Max, b.Initial)
	}
	return nil
}

// ProcessorConfig configures a Processor.
type ProcessorConfig struct {
	// Retry is the budget of a record's own failures (handler error, panic)
	// before it is dead-lettered.
	Retry RetryPolicy
	// Outage is the wait between tries while PostgreSQL is unavailable
	// (BEGIN, the dedupe insert, COMMIT or a dead-letter write failing, or
	// the handler's own statements failing on a dead connection, a
	// serialization failure or a deadlock). Such failures use no attempt of
	// the record: the processor waits until the database answers or the
	// context ends. Default 100ms doubling to 5s.
	Outage Backoff
	// StorageTimeout bounds each of the processor's own round trips
	// (acquiring a connection and BEGIN with the dedupe insert, sent as one
	// pipeline; COMMIT; dead-letter writes), so a database that
	// keeps the connection open but never answers is noticed and waited out
	// like one that refuses connections. The handler's own statements are
	// bounded by the context (revoke, shutdown). Default 10s.
	StorageTimeout time.Duration
	// IdleInTransactionTimeout is PostgreSQL's
	// idle_in_transaction_session_timeout for the processor's transactions
	// (0: DefaultIdleInTransactionTimeout; negative: leave the session's; at
	// most PostgreSQL's maximum, 2147483647ms, about 24.8 days).
	// A consumer frozen mid-record (SIGSTOP, a paused VM) keeps its
	// connection open and its processed-event row locked; after this the
	// server ends its session, so the member that took its partitions over
	// applies the record instead of waiting for it to wake up. It must be
	// longer than the longest pause between the handler's own statements:
	// a handler that idles past it fails its attempt (the record's
	// failure, see handlerCulprit), every time it does.
	IdleInTransactionTimeout time.Duration
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// MeterProvider and TracerProvider receive the processor's metrics and
	// one span per record (or batch); nil: the global providers. See the
	// README's "Metrics and traces".
	MeterProvider  metric.MeterProvider
	TracerProvider trace.TracerProvider
}

// maxIdleInTransactionTimeout is the largest
// idle_in_transaction_session_timeout PostgreSQL accepts (INT_MAX ms).
const maxIdleInTransactionTimeout = math.MaxInt32 * time.Millisecond

// Processor applies records to event handlers: per record, in one
// transaction, the processed-event row and the handler's writes. It is
// broker-agnostic; an engine such as runtime/kafka commits a record's offset
// only after Process returned nil for it. Build it with NewProcessor.
type Processor struct {
	store *Store
	pool  *pgxpool.Pool
	cfg   ProcessorConfig
	log   *slog.Logger
	tel   *telemetry.Telemetry
}

// NewProcessor returns a Processor on store. It validates cfg and keeps a
// copy, so later changes to cfg have no effect.
func NewProcessor(store *Store, cfg ProcessorConfig) (*Processor, error) {
	if store == nil {
		return nil, errors.New("idem: NewProcessor: nil Store")
	}
	if cfg.Retry.MaxAttempts < 0 {
		return nil, fmt.Errorf("idem: NewProcessor: Retry.MaxAttempts %d is negative", cfg.Retry.MaxAttempts)
	}
	if err := (Backoff{cfg.Retry.Initial, cfg.Retry.Max}).validate("idem: NewProcessor: Retry"); err != nil {
		return nil, err
	}
	if err := cfg.Outage.validate("idem: NewProcessor: Outage"); err != nil {
		return nil, err
	}
	if cfg.StorageTimeout < 0 {
		return nil, fmt.Errorf("idem: NewProcessor: StorageTimeout %v is negative", cfg.StorageTimeout)
	}
	if cfg.IdleInTransactionTimeout > maxIdleInTransactionTimeout {
		// PostgreSQL refuses the setting with 22023, a data exception that
		// reads as the record's failure: every record, valid or not, was
		// dead-lettered.
		return nil, fmt.Errorf("idem: NewProcessor: IdleInTransactionTimeout %v is over PostgreSQL's maximum %v",
			cfg.IdleInTransactionTimeout, maxIdleInTransactionTimeout)
	}
	cfg.Retry = cfg.Retry.withDefaults()
	cfg.Outage = cfg.Outage.withDefaults()
	if cfg.StorageTimeout == 0 {
		cfg.StorageTimeout = 10 * time.Second
	}
	if cfg.IdleInTransactionTimeout == 0 {
		cfg.IdleInTransactionTimeout = DefaultIdleInTransactionTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	tel := telemetry.Must(cfg.MeterProvider, cfg.TracerProvider)
	cfg.MeterProvider, cfg.TracerProvider = nil, nil // kept in tel
	return &Processor{store: store, pool: store.pool, cfg: cfg, log: cfg.Logger, tel: tel}, nil
}

// Process applies rec to h. It returns nil once the record is done — applied,
// a duplicate, or dead-lettered — and its offset may be committed. It returns
// the context's error, and commits nothing, when ctx is cancelled: shutdown or
// a rebalance is not a record failure, and the record will be delivered again.
//
// The record's own failures (undecodable, no event id, a handler error, a
// panic in the handler or the id accessor) use its RetryPolicy and end as a
// dead letter. Storage failures use none of it: Process waits them out
// (ProcessorConfig.Outage) for as long as ctx allows.
func (p *Processor) Process(ctx context.Context, h *EventHandler, rec *Record) (Outcome, error) {
	return p.processRecorded(ctx, h, rec, nil)
}

// processRecorded is process with the record's telemetry; failed is as in
// process.
func (p *Processor) processRecorded(ctx context.Context, h *EventHandler, rec *Record, failed error) (Outcome, error) {
	ctx, done := p.tel.RecordStart(ctx, h.Context, rec.Topic, rec.Partition, rec.Offset)
	o, err := p.process(ctx, h, rec, 0, failed)
	done(outcomeName(o, err), err)
	return o, err
}

// outcomeName is the outcome attribute of a finished record: its Outcome, or
// "cancelled" when the context ended first (it will be delivered again).
func outcomeName(o Outcome, err error) string {
	if err != nil {
		return "cancelled"
	}
	return o.String()
}

// process is Process; replayID, when not 0, is the dead letter being replayed
// (see ReplayDeadLetter): it is marked replayed in the applying transaction,
// and a failure updates it instead of adding a new dead letter. failed, when
// not nil, is the record's failure in a batch that was rolled back: that run
// was its first attempt.
//
// When ctx carries the Kafka consumer's lane (guardlane) the record runs on
// the lane's worker in one hand-off (processOnLane); otherwise here, with
// each call of user code on a goroutine of its own (guarded).
func (p *Processor) process(ctx context.Context, h *EventHandler, rec *Record, replayID int64, failed error) (Outcome, error) {
	if l := guardlane.From(ctx); l != nil && l.Acquire() {
		defer l.Release()
		return p.processOnLane(ctx, l, h, rec, replayID, failed)
	}
	return p.processFrom(ctx, nil, h, rec, replayID, resume{failed: failed, inBatch: failed != nil})
}

// resume is where processFrom starts a record: with attempts already used,
// the last of them failed with failed (nil: a fresh record); or, when dead
// is set, at its dead letter (a decoding that failed, or a spent budget).
type resume struct {
	attempts int
	failed   error
	inBatch  bool // failed is the record's failure in a rolled-back batch
	dead     *deadLetterCall
	// verify: the attempt that failed may have committed (its worker
	// ended during its COMMIT): before a dead letter, check it did not.
	verify bool
}

// deadLetterCall is a dead letter decided: the attempts used and the
// record's failure.
type deadLetterCall struct {
	attempts int
	cause    error
}

// processOnLane runs the record on the lane's worker: decoding, every
// attempt and its user code, and the dead letter, in one hand-off from the
// partition's goroutine and back, the user code called directly on the
// worker (inlineGuard). A handler's (or decoder's) runtime.Goexit ends the
// worker: its transaction rolls back on the way out, as the runtime's
// deferred calls run, and the attempt is a failure of the record, as with
// guarded: the record goes on from there on a new worker (l.Run starts one),
// charged one attempt (a Goexit while decoding is a decoding failure: dead
// letter), its budget and backoff as for any handler failure. The
// partition's goroutine only waits, so it survives; labels and
// SetPanicOnFault are reset as guarded resets them.
func (p *Processor) processOnLane(ctx context.Context, l *guardlane.Lane, h *EventHandler, rec *Record, replayID int64, failed error) (Outcome, error) {
	// The guard, the resume point and the call's results in one
	// allocation: the closure handed to the lane captures them, and each
	// captured variable the loop assigns was moved to the heap on its own.
	lr := &struct {
		w       inlineGuard
		r       resume
		outcome Outcome
		err     error
	}{r: resume{failed: failed, inBatch: failed != nil}}
	w := &lr.w
	outside := 0 // Goexits outside the record's user code
	for {
		lr.outcome, lr.err = 0, nil
		if onLane(ctx, l, func() { lr.outcome, lr.err = p.processFrom(ctx, w, h, rec, replayID, lr.r) }) {
			return lr.outcome, lr.err
		}
		if ctxErr := ctx.Err(); ctxErr != nil {
			return 0, ctxErr // commit nothing: the record is delivered again
		}
		gerr := w.ended // what guarded would have returned: Goexit, or the panic recovered during it
		w.ended = nil   // this one is dealt with: a next Goexit outside user code must not be taken for it
		if gerr == nil && w.dead != nil {
			// Ended in a hook on the dead letter's own path (its log
			// lines, the insert's tracer): the record's failure is
			// decided, and it is what the dead letter says, with the
			// attempts it used, not the hook. Tried again after a
			// backoff; a dead letter stored already is not stored twice
			// (InsertDeadLetter's conflict).
			outside++
			if err := sleep(ctx, p.cfg.Retry.backoff(outside)); err != nil {
				return 0, err
			}
			lr.r = resume{dead: w.dead}
			continue
		}
		if gerr == nil {
			// The worker ended in none of the record's user code: in a
			// logger, meter or pgx tracer the application supplied. It
			// is charged to the record as a handler failure, after a
			// backoff: resumed at once, the same hook ended every new
			// worker again in a hot loop (120,000 a second), and it may
			// be the dead letter's own path that ends it.
			outside++
			if err := sleep(ctx, p.cfg.Retry.backoff(outside)); err != nil {
				return 0, err
			}
			gerr = &panicError{where: whereHooks, value: errGoexit}
		}
		if !w.decoded {
			lr.r = resume{dead: &deadLetterCall{attempts: 1, cause: gerr}}
		} else {
			// verify: ended during the attempt's COMMIT (a pgx tracer's
			// TraceBatchEnd runs after the server answered), or while
			// checking one: the record may be applied. Charged, a
			// record on its last attempt was dead-lettered although
			// its COMMIT had taken effect.
			lr.r = resume{attempts: w.attempt, failed: gerr, verify: w.committing || w.verifying}
		}
	}
}

// onLane runs fn on l's worker under ctx's profiler labels, and reports
// whether it returned: false when user code it called inline ended the
// worker with runtime.Goexit (the worker's deferred calls ran; l.Run starts
// a new one for the next call). Neither labels nor SetPanicOnFault are left
// to the next call.
func onLane(ctx context.Context, l *guardlane.Lane, fn func()) (returned bool) {
	done := make(chan struct{})
	l.Run(func() {
		defer close(done)
		pprof.SetGoroutineLabels(ctx)
		defer pprof.SetGoroutineLabels(context.Background())
		defer debug.SetPanicOnFault(false)
		fn()
		returned = true
	})
	<-done
	return returned
}

// processFrom is process from r (see resume); w, when not nil, is the
// record's inline guard (processOnLane).
func (p *Processor) processFrom(ctx context.Context, w *inlineGuard, h *EventHandler, rec *Record, replayID int64, r resume) (Outcome, error) {
	if r.dead != nil {
		return p.deadLetterFrom(ctx, w, h, rec, replayID, r.dead.attempts, r.dead.cause)
	}
	var ev any
	var id string
	if w != nil && w.decoded {
		ev, id = w.ev, w.id
	} else {
		var err error
		ev, id, err = safeDecode(ctx, w, h, rec)
		if err != nil {
			return p.deadLetterFrom(ctx, w, h, rec, replayID, 1, err)
		}
		if w != nil {
			w.ev, w.id, w.decoded = ev, id, true
		}
	}
	attempt, outage := r.attempts, 0
	slow := 0                 // *slowProbeError or *unclearError attempts in a row (handlerCulprit)
	var outageSince time.Time // the first failure of the current run of outage tries
	if r.failed != nil {
		attempt++
		if attempt >= p.cfg.Retry.MaxAttempts {
			if r.verify {
				// Its processed-event row says whether that COMMIT
				// took effect: a duplicate then, never a dead letter.
				// The handler is not run again (budget spent).
				w.verifying = true
				outcome, err := p.applyOnce(ctx, w, h, rec, ev, id, replayID)
				w.verifying = false
				if err == nil {
					return outcome, nil
				}
				if ctxErr := ctx.Err(); ctxErr != nil {
					return 0, ctxErr
				}
				if !errors.Is(err, errNotApplied) {
					// The check itself failed (storage): the dead
					// letter waits for the database in any case.
					p.log.WarnContext(ctx, "checking whether the record was committed failed", logRecord(h, rec, "err", err)...)
				}
			}
			return p.deadLetterFrom(ctx, w, h, rec, replayID, attempt, r.failed)
		}
		wait := p.cfg.Retry.backoff(attempt)
		var err error
		if r.inBatch {
			p.log.WarnContext(ctx, "handler failed in a batch; retrying", logRecord(h, rec, "attempt", attempt, "err", r.failed)...)
			err = sleep(ctx, wait)
		} else { // as the loop below retries a failed attempt
			p.tel.RecordRetried(ctx, h.Context, rec.Topic)
			p.log.WarnContext(ctx, "handler failed; retrying", logRecord(h, rec, "attempt", attempt, "err", r.failed)...)
			p.tel.ConsumerBackoff(ctx, h.Context, wait)
			err = sleep(ctx, wait)
			p.tel.ConsumerBackoff(ctx, h.Context, 0)
		}
		if err != nil {
			return 0, err
		}
	}
	for {
		if w != nil {
			w.attempt = attempt
		}
		outcome, err := p.applyOnce(ctx, w, h, rec, ev, id, replayID)
		if err == nil {
			return outcome, nil
		}
		if ctxErr := ctx.Err(); ctxErr != nil {
			return 0, ctxErr
		}
		err = p.handlerCulprit(ctx, err, slow) // the attempt's connection is released now
		if sp, ue := (*slowProbeError)(nil), (*unclearError)(nil); errors.As(err, &sp) || errors.As(err, &ue) {
			slow++
		} else {
			slow = 0
		}
		if errors.Is(err, ErrDeadLetterReplayed) {
			return 0, err
		}
		var wait time.Duration
		if p.isOutage(err) {
			if outage == 0 {
				outageSince = time.Now()
			}
			outage++
			wait = p.cfg.Outage.wait(outage)
			p.tel.StorageWait(ctx, h.Context)
			// Every try is logged with the record it holds back (topic,
			// partition, offset) and for how long: a partition stuck
			// behind one record is visible as such, not only as a count.
			p.log.WarnContext(ctx, "storage unavailable; waiting, no attempt used", logRecord(h, rec,
				"outage_tries", outage, "outage_for", time.Since(outageSince).Round(time.Millisecond), "wait", wait, "err", err)...)
		} else {
			outage = 0
			attempt++
			var ue *unstorableIDError
			if attempt >= p.cfg.Retry.MaxAttempts || errors.As(err, &ue) {
				return p.deadLetterFrom(ctx, w, h, rec, replayID, attempt, err)
			}
			wait = p.cfg.Retry.backoff(attempt)
			p.tel.RecordRetried(ctx, h.Context, rec.Topic)
			p.log.WarnContext(ctx, "handler failed; retrying", logRecord(h, rec, "attempt", attempt, "err", err)...)
		}
		p.tel.ConsumerBackoff(ctx, h.Context, wait)
		err = sleep(ctx, wait)
		p.tel.ConsumerBackoff(ctx, h.Context, 0)
		if err != nil {
			return 0, err
		}
	}
}

// errNotApplied is a check (see resume.verify) finding no processed-event
// row of the record: the COMMIT it followed had not taken effect.
var errNotApplied = errors.New("the record's processed-event row is absent")

// deadLetterFrom is deadLetter, noting it on w (when not nil) first: a
// worker that ends on the dead letter's path resumes there (processOnLane).
func (p *Processor) deadLetterFrom(ctx context.Context, w *inlineGuard, h *EventHandler, rec *Record, replayID int64, attempts int, cause error) (Outcome, error) {
	if w != nil {
		w.dead = &deadLetterCall{attempts: attempts, cause: cause}
	}
	return p.deadLetter(ctx, h, rec, replayID, attempts, cause)
}

// storageCtx bounds one of the processor's own statements.
func (p *Processor) storageCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, p.cfg.StorageTimeout)
}

// applyOnce is one attempt: BEGIN; when replaying, mark the dead letter
// replayed; insert the processed-event row (a conflict means a duplicate),
// which also makes the transaction's settings — all in one pipelined round
// trip — then run the handler and
// COMMIT: 3 round trips for an applied record, as many as a bare handler's
// BEGIN │ INSERT │ COMMIT. Errors of the processor's own statements are
// *storageError; the handler's are returned as they are.
func (p *Processor) applyOnce(ctx context.Context, w *inlineGuard, h *EventHandler, rec *Record, ev any, id string, replayID int64) (Outcome, error) {
	if w != nil {
		w.committing = false // a COMMIT of an earlier attempt, if any, is not this one's
	}
	sctx, cancel := p.storageCtx(ctx)
	defer cancel()
	conn, err := p.pool.Acquire(sctx)
	if err != nil {
		return 0, &storageError{op: "acquire connection", err: err}
	}
	// Released after the rollback below (defers run last first): the
	// connection goes back to the pool outside any transaction, and pgxpool
	// destroys one left in a transaction or broken instead of reusing it.
	defer conn.Release()
	sent := time.Now()
	r, err := dbx.BeginRecordEvent(sctx, conn.Conn(), max(p.cfg.IdleInTransactionTimeout, 0), replayID, db.InsertProcessedEventParams{
		Context: h.Context, EventID: id, Topic: rec.Topic, Kpartition: rec.Partition, Koffset: rec.Offset,
	})
	answered := time.Now()
	cancel()
	tx := r.Tx
	defer endTx(ctx, tx) // after CheckedCommit this sends nothing
	if replayID != 0 && r.Marked == 0 {
		// Replayed already (earlier, or by a concurrent replay whose row
		// lock the mark waited for): the insert pipelined after the mark is
		// rolled back with it.
		return 0, ErrDeadLetterReplayed
	}
	if err != nil {
		return 0, unstorableID(pipelineError(err), id, h.Context, conn.Conn().PgConn().ParameterStatus("client_encoding"))
	}
	n := r.Inserted
	outcome := Duplicate
	var idle time.Duration // the handler's longest idle stretch (idleClock), monotonic
	var returned time.Time
	var clock *idleClock
	if n == 1 && w != nil && w.verifying {
		return 0, errNotApplied // rolled back: the check writes nothing
	}
	if n == 1 {
		called := time.Now()
		htx := clockTx(tx, called)
		clock = htx.clock
		clock.began(sent, answered)
		err := safeCall(eventContext(ctx, h, id), w, h, htx, ev)
		returned = time.Now()
		idle = clock.idle(returned)
		if err != nil {
			ferr := handlerFailure(ctx, tx, err)
			var oe *outageError
			if errors.As(ferr, &oe) {
				// A closed connection: the handler's own context may have
				// closed it (ownCtxCause), or its transaction's lowered
				// idle timeout (idleWindow), decided in handlerCulprit.
				return 0, withWindow(suspect(ferr, idle, 0, ownCtxCause(ctx, tx, clock, err), clock.ran(returned.Sub(called))), handlerWindow(clock, returned))
			}
			return 0, suspectIdle(ferr, idle, 0)
		}
		if cause := ownCtxCause(ctx, tx, clock, nil); cause != nil {
			// Returned nil on a connection its own context closed: no
			// COMMIT can succeed there (sent, it fails as an outage).
			return 0, suspect(&outageError{err: errConnClosedUnderHandler}, idle, 0, cause, clock.ran(returned.Sub(called)))
		}
		if tx.Conn().IsClosed() {
			// Returned nil on a closed connection: no COMMIT can succeed
			// there, and it failed as an outage on every attempt. Judged
			// as the handler's call that closed it failed (the handler
			// swallowed its error: a 25P03 of its idling is its own), or,
			// with no such call, as unclear (closedCulprit).
			if end := clock.ended(); end != nil {
				ferr := &outageError{err: fmt.Errorf("%w: %w", errSwallowedConnEnd, end.err)}
				return 0, withWindow(suspectIdle(ferr, idle, 0), end.window)
			}
			return 0, &handlerSuspect{err: &outageError{err: errConnClosedUnderHandler}, closedNil: true}
		}
		if err := handlerLeftTx(tx); err != nil {
			return 0, err
		}
		outcome = Applied
		crash.Point(ctx, "consume.after-call")
	} else if replayID == 0 {
		return Duplicate, nil // nothing written: no need to commit
	}
	if err := ctx.Err(); err != nil {
		return 0, err // never commit a cancelled operation, even if the handler ignored it
	}
	if w != nil {
		w.committing = true // until commit returns: see processOnLane
	}
	commitAt := time.Now()
	err = p.commit(ctx, tx)
	if w != nil {
		w.committing = false
	}
	if err != nil {
		if n == 1 {
			// The runtime's time since the handler returned counts up to
			// the COMMIT's answer: a process frozen anywhere in it (before
			// the COMMIT was sent included) is not the handler's doing.
			failed := time.Now()
			return 0, withWindow(suspectIdle(err, idle, failed.Sub(returned)), clock.windowAt(returned, commitAt, failed))
		}
		return 0, err
	}
	return outcome, nil
}

// handlerWindow is the idle window a handler's failure on a closed
// connection ended: its call that closed the connection, or, with none
// seen (a statement sent through tx.Conn()), the handler's return.
func handlerWindow(clock *idleClock, returned time.Time) idleWindow {
	if end := clock.ended(); end != nil {
		return end.window
	}
	return clock.windowAt(returned, returned, returned)
}

// pipelineError is the failure of the statements dbx pipelines before the
// handler, as a *storageError naming the one that failed.
func pipelineError(err error) error {
	var se *dbx.StepError
	if errors.As(err, &se) {
		return &storageError{op: se.Op, err: se.Err}
	}
	return &storageError{op: "begin", err: err}
}

// notRuntimeTx is in the message of CheckOwnTransaction's failure.
const notRuntimeTx = "idem: not the transaction the runtime began"

// commitGrace is how long a COMMIT already sent may still take after the
// context is cancelled.
const commitGrace = time.Second

// commit commits tx, after checking in the same round trip that tx is
// still the transaction the processor began (dbx.CheckedCommit). Once the decision to commit is taken, a cancellation
// (shutdown, a rebalance waiting) does not interrupt it at once: cancelling
// a COMMIT in flight leaves its outcome unknown to us (it may have committed
// on the server), which costs a redelivery and reports an applied record as a
// duplicate. A healthy database answers well within commitGrace; one that
// does not (blackholed) must not hold a shutdown for StorageTimeout, so the
// COMMIT is abandoned commitGrace after the cancellation — safe either way,
// the offset is not marked and a redelivery is deduplicated.
func (p *Processor) commit(ctx context.Context, tx pgx.Tx) error {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.cfg.StorageTimeout)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { time.AfterFunc(commitGrace, cancel) })
	defer stop()
	if err := dbx.CheckedCommit(cctx, tx); err != nil {
		if pgCode(err) == "22P02" && strings.Contains(err.Error(), notRuntimeTx) {
			// The handler ended the processor's transaction and began
			// another (ROLLBACK AND CHAIN, ...): TxStatus cannot tell,
			// CheckOwnTransaction can. The record's failure.
			return fmt.Errorf("%w, and began another: %w", errTxEndedByHandler, err)
		}
		if pgCode(err) == "22P02" && strings.Contains(err.Error(), tempShadow) {
			// The handler made a temporary idem_processed_events (or
			// idem_outbox, ...): committed, the next records on this
			// pooled connection would be deduplicated (enqueued) there.
			// Rolled back instead, which drops it. The record's failure.
			return fmt.Errorf("the handler made a temporary table named like one of the runtime's, which would hide it on this pooled connection: %w", err)
		}
		if commitRefusedByWrites(tx, err) {
			// The database answered: it is the handler's writes (or what the
			// handler did to its transaction) it refused, the record's
			// failure. Waiting it out as an outage retried it forever.
			return fmt.Errorf("commit refused the handler's transaction: %w", err)
		}
		// An outage, a session the server ended or a dead connection:
		// retried on another connection, where the processed-event row
		// dedupes a COMMIT that did take effect.
		return &storageError{op: "commit", err: err}
	}
	return nil
}

// ProcessBatch applies records of one partition, in order, in a single
// transaction with one multi-row processed-event insert. If anything in the
// batch fails it rolls back and falls back to Process record by record, so the
// failure policy (retry budget, dead letter, waiting out storage outages) is
// the same as in per-record mode. Like Process, it returns nil once every
// record is done, and the context's error if cancelled; then the outcomes of
// the records done so far are returned (a prefix), so the caller can mark
// them.
func (p *Processor) ProcessBatch(ctx context.Context, h *EventHandler, recs []*Record) ([]Outcome, error) {
	if len(recs) == 1 {
		o, err := p.Process(ctx, h, recs[0])
		if err != nil {
			return nil, err
		}
		return []Outcome{o}, nil
	}
	bctx, done := p.tel.BatchStart(ctx, h.Context, recs[0].Topic, recs[0].Partition, recs[0].Offset, len(recs))
	outcomes, err := p.applyBatchGuarded(bctx, h, recs)
	if err == nil {
		done(outcomeNames(outcomes), nil)
		return outcomes, nil
	}
	done(nil, err) // the records are counted one by one below
	if ctxErr := ctx.Err(); ctxErr != nil {
		return nil, ctxErr
	}
	p.log.WarnContext(ctx, "batch failed; applying its records one by one", "context", h.Context,
		"topic", recs[0].Topic, "partition", recs[0].Partition, "offset", recs[0].Offset,
		"records", len(recs), "err", err)
	// The record whose handler failed (not the database) has used one
	// attempt in the batch; the budget counts it.
	var rf *batchRecordFailure
	errors.As(err, &rf)
	outcomes = make([]Outcome, 0, len(recs))
	for i, rec := range recs {
		var failed error
		if rf != nil && rf.index == i {
			failed = rf.err
		}
		o, err := p.processRecorded(ctx, h, rec, failed)
		if err != nil {
			return outcomes, err
		}
		outcomes = append(outcomes, o)
	}
	return outcomes, nil
}

func outcomeNames(os []Outcome) []string {
	names := make([]string, len(os))
	for i, o := range os {
		names[i] = o.String()
	}
	return names
}

var errBatchNeedsFallback = errors.New("batch has an undecodable record")

// batchRecordFailure is the handler failing on recs[index] of a batch: the
// record's own failure (not an outage), which used one of its attempts.
type batchRecordFailure struct {
	index int
	err   error
}

func (e *batchRecordFailure) Error() string {
	return fmt.Sprintf("record %d of the batch: %v", e.index, e.err)
}
func (e *batchRecordFailure) Unwrap() error { return e.err }

// applyBatchGuarded is applyBatch, on ctx's lane (the Kafka consumer's) in
// one hand-off when it carries one, the records' decoding and handlers
// called inline (see processOnLane): a hand-off per handler call was about
// a third of the consumer's own CPU per batched record (28–34 µs before,
// 21–24 after; BENCHMARKS.md). A runtime.Goexit in user code
// fails the batch as guarded made it fail: while decoding, as an
// undecodable record; in a handler, as that record's failure (one attempt
// used), its writes rolled back with the batch's transaction.
func (p *Processor) applyBatchGuarded(ctx context.Context, h *EventHandler, recs []*Record) ([]Outcome, error) {
	l := guardlane.From(ctx)
	if l == nil || !l.Acquire() {
		return p.applyBatch(ctx, nil, h, recs)
	}
	defer l.Release()
	w := &inlineGuard{}
	var (
		outcomes []Outcome
		err      error
	)
	if onLane(ctx, l, func() { outcomes, err = p.applyBatch(ctx, w, h, recs) }) {
		return outcomes, err
	}
	if ctxErr := ctx.Err(); ctxErr != nil {
		return nil, ctxErr
	}
	if w.ended == nil {
		// Not in the records' user code (see processOnLane): the batch
		// falls back, no record charged, and the records' own runs meet
		// the hook again (or, if it ended the worker after the batch's
		// COMMIT, find their processed-event rows: duplicates). Named as
		// what it was in the batch's failure line.
		return nil, &panicError{where: whereHooks, value: errGoexit}
	}
	if w.where == whereDecode {
		return nil, errBatchNeedsFallback
	}
	return nil, &batchRecordFailure{index: w.index, err: w.ended}
}

// applyBatch applies recs in one transaction; w is as in safeDecode.
func (p *Processor) applyBatch(ctx context.Context, w *inlineGuard, h *EventHandler, recs []*Record) ([]Outcome, error) {
	events := make([]any, len(recs))
	ids := make([]string, len(recs))
	offsets := make([]int64, len(recs))
	for i, rec := range recs {
		ev, id, err := safeDecode(ctx, w, h, rec)
		if err != nil {
			return nil, errBatchNeedsFallback
		}
		events[i], ids[i], offsets[i] = ev, id, rec.Offset
	}
	sctx, cancel := p.storageCtx(ctx)
	defer cancel()
	conn, err := p.pool.Acquire(sctx)
	if err != nil {
		return nil, &storageError{op: "acquire connection", err: err}
	}
	defer conn.Release() // after the rollback, as in applyOnce
	tx, fresh, err := dbx.BeginRecordEvents(sctx, conn.Conn(), max(p.cfg.IdleInTransactionTimeout, 0), db.InsertProcessedEventsParams{
		Context: h.Context, EventIds: ids, Topic: recs[0].Topic, Kpartition: recs[0].Partition, Koffsets: offsets,
	})
	cancel()
	defer endTx(ctx, tx) // after CheckedCommit this sends nothing
	if err != nil {
		return nil, pipelineError(err)
	}
	isNew := make(map[string]bool, len(fresh))
	for _, id := range fresh {
		isNew[id] = true
	}
	outcomes := make([]Outcome, len(recs))
	for i := range recs {
		// The first record with an id applies it; a repeat inside the same
		// batch is a duplicate like any other.
		if !isNew[ids[i]] {
			outcomes[i] = Duplicate
			continue
		}
		delete(isNew, ids[i])
		if w != nil {
			w.index = i
		}
		if err := safeCall(eventContext(ctx, h, ids[i]), w, h, tx, events[i]); err != nil {
			// A session ended by idle_in_transaction_session_timeout is an
			// outage here, at the handler's statement or the COMMIT: the
			// batch falls back to record by record, where each handler's
			// own run is measured (handlerSuspect). So is a statement the
			// server cancelled (57014): the records' handlers share the
			// transaction, and a statement_timeout an earlier handler set
			// (SET LOCAL lasts until the batch's COMMIT) cancels a later
			// one's statement; record by record, a handler's own
			// statement_timeout is charged to it.
			err = handlerFailure(ctx, tx, err)
			if p.isOutage(err) || ctx.Err() != nil || errors.Is(err, errStatementCancelled) {
				return nil, err
			}
			return nil, &batchRecordFailure{index: i, err: err}
		}
		if err := handlerLeftTx(tx); err != nil {
			// Charged to this record, before the next one's handler runs
			// on a busy connection or outside the transaction.
			return nil, &batchRecordFailure{index: i, err: err}
		}
		outcomes[i] = Applied
	}
	crash.Point(ctx, "consume.after-call")
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := p.commit(ctx, tx); err != nil {
		return nil, err
	}
	return outcomes, nil
}

// eventContext makes the event's identity available to the handler through
// KeyFromContext, as Key{Scope: context, Key: event id}, so that downstream
// calls derive their idempotency keys from it.
func eventContext(ctx context.Context, h *EventHandler, id string) context.Context {
	return context.WithValue(ctx, keyCtx{}, Key{Scope: h.Context, Key: id})
}

// logRecord returns the attributes every consumer log line carries, then
// more.
func logRecord(h *EventHandler, rec *Record, more ...any) []any {
	return append([]any{"context", h.Context, "topic", rec.Topic, "partition", rec.Partition, "offset", rec.Offset}, more...)
}

// sleep waits d or until ctx is done, returning ctx's error then.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
