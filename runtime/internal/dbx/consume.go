package dbx

import (
	"context"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/runtime/internal/db"
)

// StepError is the failure of one statement of a pipelined batch. Op names
// the statement ("begin", "record processed event", ...) so that the caller
// can report what failed as if the statements had been sent one by one; a
// failure that no single statement's answer carried (the connection failing
// after every answer was read) names them all, joined by " and ".
type StepError struct {
	Op  string
	Err error
}

func (e *StepError) Error() string { return e.Op + ": " + e.Err.Error() }
func (e *StepError) Unwrap() error { return e.Err }

// RecordedEvent is what BeginRecordEvent read.
type RecordedEvent struct {
	// Tx is the transaction begun, never nil. It is closed (every method
	// returns pgx.ErrTxClosed) if BEGIN itself failed; otherwise it is to
	// be committed or rolled back as usual, also after an error (the
	// transaction is then aborted).
	Tx pgx.Tx
	// Marked is MarkDeadLetterReplayed's row count: -1 when it was not
	// queued (no replay) or its answer was not read (an earlier statement
	// failed).
	Marked int64
	// Inserted is InsertProcessedEvent's row count: 0 for a duplicate, or
	// when its answer was not read.
	Inserted int64
}

// BeginRecordEvent begins a transaction on conn and, in the same pipelined
// round trip, runs MarkDeadLetterReplayed (when replayID is not 0) and
// InsertProcessedEvent, which also makes the transaction's settings: the
// mark CheckedCommit checks, and idle_in_transaction_session_timeout when
// idle is positive. These are the consumer's per-record statements before
// its handler, which sent one by one cost a round trip each. The server
// runs them in order and skips the rest at the first failure, so a failure
// leaves the transaction aborted (or, if BEGIN failed, not begun); the
// error is a *StepError naming the statement that failed. idle, not
// arg.Idle, is sent, rendered as PostgreSQL reads it (msArg: rendered and
// boxed once per value, not per record).
//
// The settings ride on the dedupe insert (they were a statement of their
// own, SetTxSettings, queued after BEGIN): one statement less per record.
// They are still made before the handler runs, and for a duplicate too.
// The mark is made after MarkDeadLetterReplayed now, which changes
// nothing: neither statement waits under a setting made here (no
// lock_timeout is set for the consumer; see InsertProcessedEvent).
func BeginRecordEvent(ctx context.Context, conn *pgx.Conn, idle time.Duration, replayID int64, arg db.InsertProcessedEventParams) (RecordedEvent, error) {
	res := RecordedEvent{Marked: -1}
	steps := make([]step, 0, 2)
	if replayID != 0 {
		steps = append(steps, step{op: "mark dead letter replayed", sql: db.MarkDeadLetterReplayed, args: []any{replayID},
			read: func(br pgx.BatchResults) error {
				ct, err := br.Exec()
				if err == nil {
					res.Marked = ct.RowsAffected()
				}
				return err
			}})
	}
	steps = append(steps, step{op: "record processed event", sql: db.InsertProcessedEvent,
		args: []any{arg.Context, arg.EventID, arg.Topic, arg.Kpartition, arg.Koffset, msArg(idle)},
		read: func(br pgx.BatchResults) error {
			ct, err := br.Exec()
			if err == nil {
				res.Inserted = ct.RowsAffected()
			}
			return err
		}})
	tx, err := beginPipelined(ctx, conn, steps)
	res.Tx = tx
	return res, err
}

// BeginRecordEvents is BeginRecordEvent for a batch of records of one
// partition: it begins a transaction on conn and, in the same round trip,
// runs InsertProcessedEvents (which makes the settings, as
// InsertProcessedEvent does), returning the event ids that were new. tx
// and the error are as in BeginRecordEvent, and so is idle.
func BeginRecordEvents(ctx context.Context, conn *pgx.Conn, idle time.Duration, arg db.InsertProcessedEventsParams) (tx pgx.Tx, fresh []string, err error) {
	tx, err = beginPipelined(ctx, conn, []step{{op: "record processed events", sql: db.InsertProcessedEvents,
		args: []any{arg.Context, arg.EventIds, arg.Topic, arg.Kpartition, arg.Koffsets, msArg(idle)},
		read: func(br pgx.BatchResults) error {
			rows, err := br.Query()
			if err != nil {
				rows.Close()
				return err
			}
			fresh, err = pgx.CollectRows(rows, pgx.RowTo[string])
			return err
		}}})
	return tx, fresh, err
}

// step is one statement queued after BEGIN, and how its answer is read.
type step struct {
	op   string
	sql  string
	args []any
	read func(pgx.BatchResults) error
}

// beginPipelined sends BEGIN and steps as one batch and reads their answers
// in order; the last step must make the transaction's settings (the mark
// CheckedCommit checks). The transaction is returned whatever happened
// (closed if BEGIN failed or was never sent); the batch is always closed,
// so conn is usable again unless pgx closed it.
func beginPipelined(ctx context.Context, conn *pgx.Conn, steps []step) (pgx.Tx, error) {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	for _, s := range steps {
		b.Queue(s.sql, s.args...)
	}
	br := conn.SendBatch(ctx, b)
	tx := br.Tx()
	if err := execOnly(br); err != nil {
		_ = br.Close() // reports err again; the transaction was not begun
		return tx, &StepError{Op: "begin", Err: err}
	}
	for _, s := range steps {
		if err := s.read(br); err != nil {
			_ = br.Close() // reports err again; the transaction is now aborted or closed
			return tx, &StepError{Op: s.op, Err: err}
		}
	}
	if err := br.Close(); err != nil {
		ops := []string{"begin"}
		for _, s := range steps {
			ops = append(ops, s.op)
		}
		return tx, &StepError{Op: strings.Join(ops, " and "), Err: err}
	}
	return tx, nil
}

func execOnly(br pgx.BatchResults) error {
	_, err := br.Exec()
	return err
}

// CheckedCommit commits tx, begun by BeginRecordEvent or
// BeginRecordEvents, in one round trip with CheckOwnTransaction before the
// COMMIT: a handler that ended the transaction and chained another one (its
// work and the processed-event rows already committed or rolled back,
// apart) fails the check, and the COMMIT is skipped. The COMMIT's own
// failure wraps ErrCommit (see commitAfter); after a successful call the connection is out of the
// transaction although tx does not know it (see StoreKeyCommit).
func CheckedCommit(ctx context.Context, tx pgx.Tx) error {
	return commitAfter(ctx, tx, db.CheckOwnTransaction)
}

// SessionCommit commits tx, a transaction of a request without a key, in
// one round trip with RestoreSession before the COMMIT: what the function
// changed in the session's settings is put back, so that it does not
// outlive its transaction on the pooled connection, and a temporary table
// hiding one of the runtime's fails the statement and skips the COMMIT.
// Errors are as CheckedCommit's.
func SessionCommit(ctx context.Context, tx pgx.Tx) error {
	return commitAfter(ctx, tx, db.RestoreSession)
}
