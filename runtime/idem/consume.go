package idem

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/crash"
	"github.com/idemgen/idemgen/runtime/internal/db"
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
	Key       []byte
	Value     []byte
	Headers   []RecordHeader
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
	// EventIDHeader record header instead.
	EventID func(T) string
	// Decode decodes a record value. Nil decodes JSON.
	Decode func([]byte) (T, error)
}

// Consumer is a type-erased //idem:consume handler; generated code builds it
// with Consume.
type EventHandler struct {
	Topic   string
	Context string
	decode  func(*Record) (event any, id string, err error)
	call    func(context.Context, pgx.Tx, any) error
}

// Consume returns the Consumer that decodes records into T and applies them
// with fn, once per (spec.Context, event id).
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
	// DeadLettered: the record could not be decoded, or failed past the retry
	// budget; it is stored in idem_dead_letters.
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
// dead-lettered.
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
	if p.Initial <= 0 {
		p.Initial = 100 * time.Millisecond
	}
	if p.Max <= 0 {
		p.Max = 5 * time.Second
	}
	return p
}

// backoff returns the wait before attempt n+1 (n >= 1): Initial·2^(n-1),
// capped at Max, between half and all of it.
func (p RetryPolicy) backoff(n int) time.Duration {
	d := p.Initial << min(n-1, 30)
	if d > p.Max || d <= 0 {
		d = p.Max
	}
	return d/2 + rand.N(d/2+1)
}

// Processor applies records to consumers: per record, in one transaction,
// the processed-event row and the handler's writes. It is broker-agnostic;
// an engine such as runtime/kafka commits a record's offset only after
// Process returned nil for it.
type Processor struct {
	Pool   *pgxpool.Pool
	Retry  RetryPolicy
	Logger *slog.Logger
}

func (p *Processor) logger() *slog.Logger {
	if p.Logger != nil {
		return p.Logger
	}
	return slog.Default()
}

// Process applies rec to c. It returns nil once the record is done — applied,
// a duplicate, or dead-lettered — and its offset may be committed. It returns
// the context's error, and commits nothing, when ctx is cancelled: shutdown is
// not a handler failure, and the record will be delivered again.
func (p *Processor) Process(ctx context.Context, c *EventHandler, rec *Record) (Outcome, error) {
	ev, id, err := c.decode(rec)
	if err != nil {
		return p.deadLetter(ctx, c, rec, 1, err)
	}
	retry := p.Retry.withDefaults()
	for attempt := 1; ; attempt++ {
		outcome, err := p.applyOnce(ctx, c, rec, ev, id)
		if err == nil {
			return outcome, nil
		}
		if ctxErr := ctx.Err(); ctxErr != nil {
			return 0, ctxErr
		}
		if attempt >= retry.MaxAttempts {
			return p.deadLetter(ctx, c, rec, attempt, err)
		}
		p.logger().WarnContext(ctx, "handler failed; retrying", "context", c.Context, "topic", rec.Topic,
			"partition", rec.Partition, "offset", rec.Offset, "attempt", attempt, "err", err)
		if err := sleep(ctx, retry.backoff(attempt)); err != nil {
			return 0, err
		}
	}
}

// applyOnce is one attempt: BEGIN; insert the processed-event row (a
// conflict means a duplicate: stop); run the handler; COMMIT.
func (p *Processor) applyOnce(ctx context.Context, c *EventHandler, rec *Record, ev any, id string) (Outcome, error) {
	tx, err := p.Pool.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("begin: %w", err)
	}
	defer rollback(ctx, tx)
	n, err := db.New(tx).InsertProcessedEvent(ctx, db.InsertProcessedEventParams{
		Context: c.Context, EventID: id, Topic: rec.Topic, Kpartition: rec.Partition, Koffset: rec.Offset,
	})
	if err != nil {
		return 0, fmt.Errorf("record processed event: %w", err)
	}
	if n == 0 {
		return Duplicate, nil
	}
	if err := c.call(eventContext(ctx, c, id), tx, ev); err != nil {
		return 0, err
	}
	crash.Point(ctx, "consume.after-call")
	if err := ctx.Err(); err != nil {
		return 0, err // never commit a cancelled operation, even if the handler ignored it
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("commit: %w", err)
	}
	return Applied, nil
}

// ProcessBatch applies records of one partition, in order, in a single
// transaction with one multi-row processed-event insert. If anything in the
// batch fails it rolls back and falls back to Process record by record, so the
// failure policy (retry, dead letter) is the same as in per-record mode. Like
// Process, it returns nil once every record is done, and the context's error
// if cancelled.
func (p *Processor) ProcessBatch(ctx context.Context, c *EventHandler, recs []*Record) ([]Outcome, error) {
	if len(recs) == 1 {
		o, err := p.Process(ctx, c, recs[0])
		return []Outcome{o}, err
	}
	outcomes, err := p.applyBatch(ctx, c, recs)
	if err == nil {
		return outcomes, nil
	}
	if ctxErr := ctx.Err(); ctxErr != nil {
		return nil, ctxErr
	}
	p.logger().WarnContext(ctx, "batch failed; applying its records one by one", "context", c.Context,
		"topic", recs[0].Topic, "partition", recs[0].Partition, "records", len(recs), "err", err)
	outcomes = make([]Outcome, len(recs))
	for i, rec := range recs {
		if outcomes[i], err = p.Process(ctx, c, rec); err != nil {
			return nil, err
		}
	}
	return outcomes, nil
}

var errBatchNeedsFallback = errors.New("batch has an undecodable record")

func (p *Processor) applyBatch(ctx context.Context, c *EventHandler, recs []*Record) ([]Outcome, error) {
	events := make([]any, len(recs))
	ids := make([]string, len(recs))
	offsets := make([]int64, len(recs))
	for i, rec := range recs {
		ev, id, err := c.decode(rec)
		if err != nil {
			return nil, errBatchNeedsFallback
		}
		events[i], ids[i], offsets[i] = ev, id, rec.Offset
	}
	tx, err := p.Pool.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("begin: %w", err)
	}
	defer rollback(ctx, tx)
	fresh, err := db.New(tx).InsertProcessedEvents(ctx, db.InsertProcessedEventsParams{
		Context: c.Context, EventIds: ids, Topic: recs[0].Topic, Kpartition: recs[0].Partition, Koffsets: offsets,
	})
	if err != nil {
		return nil, fmt.Errorf("record processed events: %w", err)
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
		if err := c.call(eventContext(ctx, c, ids[i]), tx, events[i]); err != nil {
			return nil, err
		}
		outcomes[i] = Applied
	}
	crash.Point(ctx, "consume.after-call")
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("commit: %w", err)
	}
	return outcomes, nil
}

// eventContext makes the event's identity available to the handler through
// KeyFromContext, as Key{Scope: context, Key: event id}, so that downstream
// calls derive their idempotency keys from it.
func eventContext(ctx context.Context, c *EventHandler, id string) context.Context {
	return context.WithValue(ctx, keyCtx{}, Key{Scope: c.Context, Key: id})
}

// deadLetter stores rec in idem_dead_letters. The write is retried until it
// succeeds or ctx is cancelled: a record is never dropped, and the offset
// moves on only after the dead letter committed.
func (p *Processor) deadLetter(ctx context.Context, c *EventHandler, rec *Record, attempts int, cause error) (Outcome, error) {
	headers := map[string]string{}
	for _, h := range rec.Headers {
		headers[h.Key] = string(h.Value)
	}
	hdrs, _ := json.Marshal(headers)
	p.logger().ErrorContext(ctx, "dead-lettering record", "context", c.Context, "topic", rec.Topic,
		"partition", rec.Partition, "offset", rec.Offset, "attempts", attempts, "err", cause)
	retry := p.Retry.withDefaults()
	for n := 1; ; n++ {
		err := db.New(p.Pool).InsertDeadLetter(ctx, db.InsertDeadLetterParams{
			Context: c.Context, Topic: rec.Topic, Kpartition: rec.Partition, Koffset: rec.Offset,
			RecordKey: rec.Key, Value: rec.Value, Headers: hdrs, Attempts: int32(attempts), LastError: cause.Error(),
		})
		if err == nil {
			return DeadLettered, nil
		}
		if ctxErr := ctx.Err(); ctxErr != nil {
			return 0, ctxErr
		}
		p.logger().ErrorContext(ctx, "storing dead letter failed; retrying", "err", err)
		if err := sleep(ctx, retry.backoff(n)); err != nil {
			return 0, err
		}
	}
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
