// Package dbx is the hand-written companion of runtime/internal/db, which is
// sqlc's output only. It packs sqlc's exported query text (sqlc.yaml sets
// emit_exported_queries) into fewer round trips, so that no SQL text lives
// outside templates/ and the claim costs as little as possible.
package dbx

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/runtime/internal/db"
)

// BoundedBegin returns opts changed so that beginning the transaction also
// runs SetLockTimeout (when lockTimeout is positive), SetConnectionCheck
// (when connCheck is positive) and SetIdleInTransactionTimeout (when idle is
// positive) in the same round trip: the claim that follows waits at most
// lockTimeout for a lock, and a process frozen mid-transaction loses its
// session after idle. The begin statement and the settings go as one
// simple-protocol query (BEGIN keeps the transaction open past it); the
// values are inlined as literals of digits, the only values they can hold.
// It is for a transaction that cannot be Pipelined (a custom BeginQuery);
// Begin and BeginClaim send the same settings as prepared statements.
func BoundedBegin(opts pgx.TxOptions, lockTimeout, connCheck, idle time.Duration) pgx.TxOptions {
	q := beginSQL(opts)
	if lockTimeout > 0 {
		q += ";\n" + inline(db.SetLockTimeout, max(lockTimeout.Milliseconds(), 1)) // 0 would mean "wait forever"
	}
	if connCheck > 0 {
		q += ";\n" + inline(db.SetConnectionCheck, max(connCheck.Milliseconds(), 1))
	}
	if idle > 0 {
		q += ";\n" + inline(db.SetIdleInTransactionTimeout, max(idle.Milliseconds(), 1))
	}
	if q != beginSQL(opts) {
		opts.BeginQuery = q
	}
	return opts
}

// inline replaces the single parameter $1 of query by a millisecond literal.
func inline(query string, ms int64) string {
	return strings.Replace(query, "$1", "'"+strconv.FormatInt(ms, 10)+"ms'", 1)
}

// beginSQL renders opts as pgx would.
func beginSQL(opts pgx.TxOptions) string {
	if opts.BeginQuery != "" {
		return opts.BeginQuery
	}
	var b strings.Builder
	b.WriteString("begin")
	if opts.IsoLevel != "" {
		b.WriteString(" isolation level " + string(opts.IsoLevel))
	}
	if opts.AccessMode != "" {
		b.WriteString(" " + string(opts.AccessMode))
	}
	if opts.DeferrableMode != "" {
		b.WriteString(" " + string(opts.DeferrableMode))
	}
	return b.String()
}

// ClaimKeyRestore runs ClaimKey, GetKey, [ClaimKeyRow] and
// RestoreLockTimeout in one pipelined round trip, inside a transaction begun
// with BoundedBegin, so that the handler's own statements run with the
// session's lock_timeout again. claimed reports that this transaction now
// holds the key (its advisory lock) and that no live row answers it: the
// function is to run, and StoreKey writes the row at completion (found then
// tells whether an expired row is being taken over: such a row is locked
// before ClaimKeyRestore returns, in a second round trip,
// afterClaim, whose lock wait is bounded by what is left of lockTimeout, counted from
// since, when the transaction's BEGIN set it). Otherwise found reports
// whether row, the key's row, exists: live, it is the stored response;
// absent or expired, the key is in flight in another transaction. GetKey runs after ClaimKey took the lock, so under
// read committed its fresh snapshot sees a row committed by the lock's
// previous holder; under an older snapshot rowCheck (SnapshotBeforeClaim)
// adds ClaimKeyRow, which fails with 40001 on such a row. For a live row (a
// replay) none of these statements writes or locks anything, and neither
// does a new key's claim before ClaimKeyRow.
func ClaimKeyRestore(ctx context.Context, tx pgx.Tx, rowCheck bool, lockTimeout time.Duration, since time.Time, arg db.ClaimKeyParams) (claimed, found bool, row db.GetKeyRow, err error) {
	b := &pgx.Batch{}
	var locked bool
	queueClaim(b, arg, rowCheck, false, &locked, &found, nil, &row)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return false, false, db.GetKeyRow{}, err
	}
	claimed = locked && !(found && row.Live)
	if claimed && found {
		if err := afterClaim(ctx, tx, left(lockTimeout, since), arg, true, false); err != nil {
			return false, false, db.GetKeyRow{}, err
		}
	}
	return claimed, found, row, nil
}

// ErrCommit wraps the COMMIT's own failure in StoreKeyCommit and CheckedCommit,
// so that the caller can tell it from the failure of the statement before it.
var ErrCommit = errors.New("commit")

// StoreKeyCommit runs StoreKey and COMMIT in one pipelined round trip; with
// fresh, StoreNewKey instead of StoreKey: the caller's claim saw no row of
// the key and wrote none (see StoreNewKey), so a plain INSERT stores it.
// If the statement fails (including when it finds the key completed
// elsewhere: a serialization failure, 40001, from StoreKey; a unique
// violation, 23505, from StoreNewKey) the server skips the COMMIT (the pipeline stops at
// the first error) and the transaction is left aborted, to be rolled back;
// a COMMIT failure is returned wrapping ErrCommit. Either way the caller must
// end tx as usual: after a successful call the connection is no longer in a
// transaction (pgconn.PgConn.TxStatus is 'I') although tx does not know it,
// and a rollback is then not to be sent (see the caller's endTx). A tx begun
// with a custom CommitQuery is committed with tx.Commit instead.
func StoreKeyCommit(ctx context.Context, tx pgx.Tx, commitQuery string, fresh bool, arg db.StoreKeyParams) error {
	sql := db.StoreKey
	if fresh {
		sql = db.StoreNewKey
	}
	if commitQuery != "" {
		if _, err := tx.Exec(ctx, sql, arg.Scope, arg.Principal, arg.Key, arg.Fingerprint, arg.StatusCode, arg.Headers, arg.Body, arg.TtlSeconds); err != nil {
			return err
		}
		if err := tx.Commit(ctx); err != nil {
			return fmt.Errorf("%w: %w", ErrCommit, err)
		}
		return nil
	}
	return commitAfter(ctx, tx, sql, arg.Scope, arg.Principal, arg.Key, arg.Fingerprint, arg.StatusCode, arg.Headers, arg.Body, arg.TtlSeconds)
}

// commitAfter runs sql and COMMIT in one pipelined round trip. A failure of
// sql is returned as is, and the server skips the COMMIT (the pipeline
// stops at the first error), leaving the transaction aborted; the COMMIT's
// own failure, or the server rolling back instead (as pgx's Commit reports
// it, pgx.ErrTxCommitRollback), is returned wrapping ErrCommit.
func commitAfter(ctx context.Context, tx pgx.Tx, sql string, args ...any) error {
	b := &pgx.Batch{}
	b.Queue(sql, args...)
	b.Queue("commit") // as pgx's own Commit sends it (and beginSQL renders begin)
	br := tx.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		_ = br.Close()
		return err
	}
	ct, err := br.Exec()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	switch {
	case err != nil:
		return fmt.Errorf("%w: %w", ErrCommit, err)
	case ct.String() == "ROLLBACK":
		return fmt.Errorf("%w: %w", ErrCommit, pgx.ErrTxCommitRollback)
	}
	return nil
}
