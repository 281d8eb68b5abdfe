package idem

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/runtime/internal/db"
)

// ErrDeadLetterReplayed is returned by ReplayDeadLetter for a dead letter
// that was replayed already (by an earlier call or a concurrent one).
var ErrDeadLetterReplayed = errors.New("dead letter already replayed")

// ErrDeadLetterNotFound is returned for a dead-letter id that does not exist.
var ErrDeadLetterNotFound = errors.New("dead letter not found")

// DeadLetter is a stored record a consumer could not apply, with its raw
// bytes as the broker delivered them.
type DeadLetter struct {
	ID int64
	// Context is the event handler's context that gave up on the record.
	Context string
	// Record is the record as delivered: key, value and headers byte for
	// byte (nil key or value for a null one), repeated headers in order.
	Record Record
	// Attempts is how many times the handler ran (1 for a record that could
	// not be decoded or had no id), replays included.
	Attempts int
	// LastError is the last failure, sanitized (NUL escaped, valid UTF-8,
	// at most 4 KiB).
	LastError string
	CreatedAt time.Time
	// ReplayedAt is when a replay applied it (or found it already applied);
	// zero while it is still a dead letter.
	ReplayedAt time.Time
}

// DeadLetter returns the dead letter id, raw. It returns an error wrapping
// ErrDeadLetterNotFound if there is none.
func (s *Store) DeadLetter(ctx context.Context, id int64) (*DeadLetter, error) {
	row, err := s.q.GetDeadLetter(ctx, id)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("dead letter %d: %w", id, ErrDeadLetterNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("read dead letter %d: %w", id, err)
	}
	if len(row.HeaderKeys) != len(row.HeaderValues) {
		return nil, fmt.Errorf("read dead letter %d: %d header names for %d values", id, len(row.HeaderKeys), len(row.HeaderValues))
	}
	dl := &DeadLetter{
		ID: row.ID, Context: row.Context, Attempts: int(row.Attempts), LastError: row.LastError,
		CreatedAt: row.CreatedAt.Time,
		Record:    Record{Topic: row.Topic, Partition: row.Kpartition, Offset: row.Koffset, Key: row.RecordKey, Value: row.Value},
	}
	if row.ReplayedAt.Valid {
		dl.ReplayedAt = row.ReplayedAt.Time
	}
	for i := range row.HeaderKeys {
		dl.Record.Headers = append(dl.Record.Headers, RecordHeader{Key: string(row.HeaderKeys[i]), Value: row.HeaderValues[i]})
	}
	return dl, nil
}

// ReplayDeadLetter applies the dead letter id to h again, through the same
// exactly-once path as a delivered record: one transaction marks the dead
// letter replayed, inserts the processed-event row and runs the handler, so
// the effect happens at most once however often (or concurrently) the replay
// is requested, and the dead letter is marked if and only if the effect (or an
// earlier one, for a duplicate) committed. If the record fails again past the
// retry budget, the dead letter stays in place with its attempts and error
// updated, and the outcome is DeadLettered. h must be the handler of the dead
// letter's context. A dead letter that was replayed already returns
// ErrDeadLetterReplayed.
func (p *Processor) ReplayDeadLetter(ctx context.Context, h *EventHandler, id int64) (Outcome, error) {
	dl, err := p.store.DeadLetter(ctx, id)
	if err != nil {
		return 0, err
	}
	if dl.Context != h.Context {
		return 0, fmt.Errorf("replay dead letter %d: it belongs to context %q, not the handler's %q", id, dl.Context, h.Context)
	}
	if !dl.ReplayedAt.IsZero() {
		return 0, fmt.Errorf("replay dead letter %d: %w", id, ErrDeadLetterReplayed)
	}
	return p.process(ctx, h, &dl.Record, id, nil)
}

// deadLetter stores rec in idem_dead_letters (or, for a replay, updates the
// dead letter replayID). Every byte that came from the broker is stored as
// bytea and the error text is sanitized, so no record can make this write
// fail; a failure is therefore the database's, and is waited out like any
// outage until the write succeeds or ctx ends. A record is never dropped,
// and the caller marks the offset only after this returned nil.
func (p *Processor) deadLetter(ctx context.Context, h *EventHandler, rec *Record, replayID int64, attempts int, cause error) (Outcome, error) {
	lastError := sanitizeText(cause.Error(), maxErrorText)
	var pe *panicError
	if errors.As(cause, &pe) {
		p.log.ErrorContext(ctx, "recovered panic", logRecord(h, rec, "err", lastError, "stack", string(pe.stack))...)
	}
	p.log.ErrorContext(ctx, "dead-lettering record", logRecord(h, rec, "attempts", attempts, "replay_of", replayID, "err", lastError)...)
	keys := make([][]byte, len(rec.Headers))
	values := make([][]byte, len(rec.Headers))
	for i, hd := range rec.Headers {
		keys[i] = []byte(hd.Key)
		values[i] = hd.Value // nil (a null header value) is a NULL element
	}
	for n := 1; ; n++ {
		sctx, cancel := p.storageCtx(ctx)
		var err error
		if replayID != 0 {
			err = db.New(p.pool).RecordDeadLetterFailure(sctx, db.RecordDeadLetterFailureParams{
				ID: replayID, Attempts: int32(attempts), LastError: lastError,
			})
		} else {
			err = db.New(p.pool).InsertDeadLetter(sctx, db.InsertDeadLetterParams{
				Context: sanitizeText(h.Context, 1<<20), Topic: sanitizeText(rec.Topic, 1<<20),
				Kpartition: rec.Partition, Koffset: rec.Offset,
				RecordKey: rec.Key, Value: rec.Value, HeaderKeys: keys, HeaderValues: values,
				RecordDigest: recordDigest(rec), Attempts: int32(attempts), LastError: lastError,
			})
		}
		cancel()
		if err == nil {
			return DeadLettered, nil
		}
		if ctxErr := ctx.Err(); ctxErr != nil {
			return 0, ctxErr
		}
		wait := p.cfg.Outage.wait(n)
		p.log.ErrorContext(ctx, "storing dead letter failed; waiting for the database, the offset stays uncommitted",
			logRecord(h, rec, "tries", n, "wait", wait, "err", err)...)
		if err := sleep(ctx, wait); err != nil {
			return 0, err
		}
	}
}

// recordDigest identifies a record's bytes: key, value (each with its
// null-ness) and headers in order. With the position, it recognizes a
// redelivery of a record that is already a dead letter (a crash between the
// dead-letter commit and the offset commit), while a different record at a
// reused offset gets its own row.
func recordDigest(rec *Record) []byte {
	h := sha256.New()
	field := func(b []byte, null bool) {
		var hdr [9]byte
		if null {
			hdr[0] = 1
		}
		binary.BigEndian.PutUint64(hdr[1:], uint64(len(b)))
		h.Write(hdr[:])
		h.Write(b)
	}
	field(rec.Key, rec.Key == nil)
	field(rec.Value, rec.Value == nil)
	for _, hd := range rec.Headers {
		field([]byte(hd.Key), false)
		field(hd.Value, hd.Value == nil)
	}
	return h.Sum(nil)
}
