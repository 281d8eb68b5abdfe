package idem

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

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
	if err := db.New(tx).EnqueueOutbox(ctx, db.EnqueueOutboxParams{Topic: topic, RecordKey: k, Payload: body, Headers: "{}"}); err != nil {
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
// with Permanent so the relay parks the row at once, and one that is the
// broker's refusal of this message rather than an outage (its topic does not
// exist) with Rejected, so that it counts toward the row's attempts.
type Publisher interface {
	Publish(ctx context.Context, msgs []Message) []error
}

type permanentError struct{ error }

func (e permanentError) Unwrap() error { return e.error }

// Permanent marks err as not worth retrying.
func Permanent(err error) error { return permanentError{err} }

// IsPermanent reports whether err was marked with Permanent.
func IsPermanent(err error) bool { return errors.As(err, new(permanentError)) }

type rejectedError struct{ error }

func (e rejectedError) Unwrap() error { return e.error }

// Rejected marks err as the broker's answer about this message (for
// example: its topic does not exist), as opposed to the broker being
// unreachable. It may succeed later, so the row is retried, but the failure
// is the row's own: it counts toward MaxAttempts even when no other message
// of the batch was acked. Without this, rows that can never be published
// would be taken for a broker outage and retried forever, and once they fill
// a whole batch, hold back every newer event of every topic.
func Rejected(err error) error { return rejectedError{err} }

// IsRejected reports whether err was marked with Rejected.
func IsRejected(err error) bool { return errors.As(err, new(rejectedError)) }

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

// OutboxCounts returns the number of outbox rows per status (statuses
// with no row are left out). Each count is read from that status's partial
// index (OutboxStatus), never by scanning the whole table: PENDING, PUBLISHING
// and PARKED stay small; PUBLISHED grows with the history until retention.
func (s *Store) OutboxCounts(ctx context.Context) (map[string]int64, error) {
	st, err := db.New(s.pool).OutboxStatus(ctx)
	if err != nil {
		return nil, fmt.Errorf("outbox counts: %w", err)
	}
	out := map[string]int64{}
	for status, n := range map[string]int64{"PENDING": st.Pending, "PUBLISHING": st.Publishing, "PUBLISHED": st.Published, "PARKED": st.Parked} {
		if n > 0 {
			out[status] = n
		}
	}
	return out, nil
}
