package idem

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/crash"
	"github.com/idemgen/idemgen/runtime/internal/db"
)

// Enqueue inserts an event into the outbox inside tx, the caller's business
// transaction: the relay sees it only after tx commits, and never if tx rolls
// back. key is the partition key (events with one key keep their order);
// payload is encoded as JSON. Generated Enqueue<Type> functions call it.
func Enqueue(ctx context.Context, tx pgx.Tx, topic, key string, payload any) error {
	body, err := json.Marshal(payload)
	if err != nil {
		return fmt.Errorf("enqueue %s: encode: %w", topic, err)
	}
	var k []byte
	if key != "" {
		k = []byte(key)
	}
	if err := db.New(tx).EnqueueOutbox(ctx, db.EnqueueOutboxParams{Topic: topic, RecordKey: k, Payload: body, Headers: []byte("{}")}); err != nil {
		return fmt.Errorf("enqueue %s: %w", topic, err)
	}
	return nil
}

// Message is one outbox event on its way to the broker.
type Message struct {
	ID      int64 // outbox row id; ascending in enqueue order
	EventID string
	Topic   string
	Key     []byte
	Value   []byte
	Headers map[string]string // includes EventIDHeader
}

// Publisher sends a batch of messages and waits for the broker's acks. It
// returns one error per message (nil: acked). Messages with the same key must
// reach the broker in slice order, and a failed message must fail every later
// message of its key in the batch (franz-go's idempotent producer does both
// per partition). Wrap an error that retrying cannot fix (a record too large)
// with Permanent so the relay parks the row at once.
type Publisher interface {
	Publish(ctx context.Context, msgs []Message) []error
}

type permanentError struct{ error }

func (e permanentError) Unwrap() error { return e.error }

// Permanent marks err as not worth retrying.
func Permanent(err error) error { return permanentError{err} }

// IsPermanent reports whether err was marked with Permanent.
func IsPermanent(err error) bool { return errors.As(err, new(permanentError)) }

// Relay publishes the outbox: PENDING → PUBLISHING → PUBLISHED.
//
// One relay per database is active at a time, elected with a session-level
// PostgreSQL advisory lock held on a dedicated connection; the others wait as
// standbys and take over when that connection ends (however its process
// died). On taking over, the new leader returns every PUBLISHING row to
// PENDING, then publishes in id order, so per-key order survives crashes: the
// first delivery of each event is in order, and a crash can only repeat a
// suffix, which consumers deduplicate by event id.
type Relay struct {
	Pool      *pgxpool.Pool
	Publisher Publisher
	// BatchSize is the most rows claimed and produced at once (default 500).
	BatchSize int
	// Lease is how long a claimed batch may stay PUBLISHING before the reaper
	// returns it to PENDING (default 30s).
	Lease time.Duration
	// MaxAttempts parks a row (status PARKED, last_error set) after this many
	// failed publishes (default 10).
	MaxAttempts int
	// PollInterval is the fallback when no NOTIFY arrives (default 1s); a
	// commit normally wakes the relay at once.
	PollInterval time.Duration
	// DisableNotify turns LISTEN/NOTIFY off, leaving only polling (for
	// measuring what NOTIFY buys; there is no other reason to).
	DisableNotify bool
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// OnLeader, if set, is called when this relay becomes the active one.
	OnLeader func()
}

func (r *Relay) defaults() {
	if r.BatchSize <= 0 {
		r.BatchSize = 500
	}
	if r.Lease <= 0 {
		r.Lease = 30 * time.Second
	}
	if r.MaxAttempts <= 0 {
		r.MaxAttempts = 10
	}
	if r.PollInterval <= 0 {
		r.PollInterval = time.Second
	}
	if r.Logger == nil {
		r.Logger = slog.Default()
	}
}

// Run relays until ctx is cancelled. A standby waits for leadership; the
// leader finishes the batch in hand (bounded by Lease) and returns nil.
func (r *Relay) Run(ctx context.Context) error {
	r.defaults()
	for {
		err := r.lead(ctx)
		if ctx.Err() != nil {
			return nil
		}
		r.Logger.Warn("relay lost its leader connection; standing by", "err", err)
		if err := sleep(ctx, r.PollInterval); err != nil {
			return nil
		}
	}
}

// lead waits to become the active relay, then relays until ctx is cancelled
// or the leader connection fails.
func (r *Relay) lead(ctx context.Context) error {
	conn, err := r.Pool.Acquire(ctx)
	if err != nil {
		return err
	}
	// The lock lives as long as this session: never return the connection to
	// the pool, where another user could inherit the lock.
	lockConn := conn.Hijack()
	defer lockConn.Close(context.Background())
	q := db.New(lockConn)
	for {
		got, err := q.TryRelayLock(ctx)
		if err != nil {
			return err
		}
		if got {
			break
		}
		if err := sleep(ctx, r.PollInterval); err != nil {
			return err
		}
	}
	if !r.DisableNotify {
		if err := q.ListenOutbox(ctx); err != nil {
			return err
		}
	}
	n, err := db.New(r.Pool).ResetOutboxPublishing(ctx)
	if err != nil {
		return err
	}
	r.Logger.Info("relay is the active relay", "reset_publishing", n)
	if r.OnLeader != nil {
		r.OnLeader()
	}

	token := newToken()
	lastReap := time.Now()
	for ctx.Err() == nil {
		sent, err := r.relayBatch(ctx, token)
		if err != nil && ctx.Err() == nil {
			r.Logger.Warn("relay batch failed", "err", err)
		}
		if time.Since(lastReap) > r.Lease {
			// Leadership makes lost leases rare (takeover resets them), but a
			// batch abandoned by this very process is returned here.
			if _, err := db.New(r.Pool).ReapOutbox(ctx); err != nil && ctx.Err() == nil {
				r.Logger.Warn("reap failed", "err", err)
			}
			lastReap = time.Now()
		}
		if sent == r.BatchSize {
			continue // more is waiting
		}
		// Sleep until a commit notifies us or the poll interval passes. The
		// wait also tells us if the leader connection died.
		wctx, cancel := context.WithTimeout(ctx, r.PollInterval)
		_, err = lockConn.WaitForNotification(wctx)
		cancel()
		if err != nil && ctx.Err() == nil && !pgconn.Timeout(err) {
			return fmt.Errorf("leader connection: %w", err)
		}
	}
	return ctx.Err()
}

// relayBatch claims one batch, publishes it and records the outcome. Once
// claimed, the batch is finished even if ctx is cancelled meanwhile (bounded
// by the lease), so shutdown does not strand rows in PUBLISHING.
func (r *Relay) relayBatch(ctx context.Context, token string) (int, error) {
	rows, err := db.New(r.Pool).ClaimOutboxBatch(ctx, db.ClaimOutboxBatchParams{
		BatchSize: int32(r.BatchSize), ClaimToken: pgtype.Text{String: token, Valid: true}, LeaseSeconds: r.Lease.Seconds(),
	})
	if err != nil || len(rows) == 0 {
		return 0, err
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i].ID < rows[j].ID })
	msgs := make([]Message, len(rows))
	for i, row := range rows {
		headers := map[string]string{}
		_ = json.Unmarshal(row.Headers, &headers)
		headers[EventIDHeader] = row.EventID
		msgs[i] = Message{ID: row.ID, EventID: row.EventID, Topic: row.Topic, Key: row.RecordKey, Value: row.Payload, Headers: headers}
	}

	bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.Lease)
	defer cancel()
	errs := r.Publisher.Publish(bctx, msgs)
	if len(errs) != len(msgs) {
		// A Publisher that breaks its contract cannot tell us what was acked:
		// count nothing as published (the rows go out again, and consumers
		// dedupe) rather than guess.
		err := fmt.Errorf("publisher returned %d results for %d messages", len(errs), len(msgs))
		errs = make([]error, len(msgs))
		for i := range errs {
			errs[i] = err
		}
	}
	crash.Point(bctx, "relay.after-publish")
	return len(rows), r.record(bctx, token, msgs, errs)
}

// record marks acked rows PUBLISHED and failed ones PENDING or PARKED, each
// in one statement, and only while this relay still holds their claim token.
func (r *Relay) record(ctx context.Context, token string, msgs []Message, errs []error) error {
	var ok, failed []int64
	var reasons []string
	var permanent []bool
	for i, m := range msgs {
		if errs[i] == nil {
			ok = append(ok, m.ID)
			continue
		}
		failed = append(failed, m.ID)
		reasons = append(reasons, errs[i].Error())
		permanent = append(permanent, IsPermanent(errs[i]))
	}
	tok := pgtype.Text{String: token, Valid: true}
	q := db.New(r.Pool)
	if len(ok) > 0 {
		n, err := q.MarkOutboxPublished(ctx, db.MarkOutboxPublishedParams{Ids: ok, ClaimToken: tok})
		if err != nil {
			return fmt.Errorf("mark published: %w", err)
		}
		if int(n) != len(ok) {
			r.Logger.Warn("lease lost: rows were taken over before they could be marked; they will be published again",
				"marked", n, "acked", len(ok))
		}
	}
	if len(failed) > 0 {
		r.Logger.Warn("publish failed", "rows", len(failed), "first_error", reasons[0])
		if _, err := q.MarkOutboxFailed(ctx, db.MarkOutboxFailedParams{
			MaxAttempts: int32(r.MaxAttempts), ClaimToken: tok, Ids: failed, Errors: reasons, Permanent: permanent,
		}); err != nil {
			return fmt.Errorf("mark failed: %w", err)
		}
	}
	return nil
}

// DeletePublished deletes up to batchSize PUBLISHED rows older than age,
// oldest first, and returns how many it deleted. Run it in a loop (or from a
// ticker) for retention.
func (s *Store) DeletePublished(ctx context.Context, age time.Duration, batchSize int) (int64, error) {
	n, err := db.New(s.pool).DeletePublishedOutbox(ctx, db.DeletePublishedOutboxParams{
		Before: pgtype.Timestamptz{Time: time.Now().Add(-age), Valid: true}, BatchSize: int32(batchSize),
	})
	if err != nil {
		return 0, fmt.Errorf("delete published outbox rows: %w", err)
	}
	return n, nil
}

// DeleteProcessedEvents deletes up to batchSize processed-event rows older
// than age. Keep them longer than any redelivery can take (the topic's
// retention): a deleted row no longer deduplicates its event.
func (s *Store) DeleteProcessedEvents(ctx context.Context, age time.Duration, batchSize int) (int64, error) {
	n, err := db.New(s.pool).DeleteProcessedEventsBefore(ctx, db.DeleteProcessedEventsBeforeParams{
		Before: pgtype.Timestamptz{Time: time.Now().Add(-age), Valid: true}, BatchSize: int32(batchSize),
	})
	if err != nil {
		return 0, fmt.Errorf("delete processed events: %w", err)
	}
	return n, nil
}

// OutboxCounts returns the number of outbox rows per status.
func (s *Store) OutboxCounts(ctx context.Context) (map[string]int64, error) {
	rows, err := db.New(s.pool).OutboxCounts(ctx)
	if err != nil {
		return nil, err
	}
	out := map[string]int64{}
	for _, r := range rows {
		out[r.Status] = r.N
	}
	return out, nil
}

func newToken() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
