// Package dbx is the hand-written companion of runtime/internal/db, which is
// sqlc's output only. It packs sqlc's exported query text (sqlc.yaml sets
// emit_exported_queries) into fewer round trips, so that no SQL text lives
// outside templates/ and the claim costs as little as possible.
package dbx

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemgen/idemgen/runtime/internal/db"
)

// BoundedBegin returns opts changed so that beginning the transaction also
// runs SetLockTimeout (when lockTimeout is positive) and SetConnectionCheck
// (when connCheck is positive) in the same round trip: the claim that follows
// waits at most lockTimeout for a lock. The begin statement and the settings go as one simple-protocol query
// (BEGIN keeps the transaction open past it); the values are inlined as
// literals of digits, the only values they can hold.
func BoundedBegin(opts pgx.TxOptions, lockTimeout, connCheck time.Duration) pgx.TxOptions {
	q := beginSQL(opts)
	if lockTimeout > 0 {
		q += ";\n" + inline(db.SetLockTimeout, max(lockTimeout.Milliseconds(), 1)) // 0 would mean "wait forever"
	}
	if connCheck > 0 {
		q += ";\n" + inline(db.SetConnectionCheck, max(connCheck.Milliseconds(), 1))
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

// ClaimKeyRestore runs ClaimKey, GetKey and RestoreLockTimeout in one
// pipelined round trip, inside a transaction begun with BoundedBegin, so that
// the handler's own statements run with the session's lock_timeout again.
// It reports whether ClaimKey inserted or took over the row, and otherwise
// the row GetKey read (found false: there is none, so the key is in flight
// elsewhere) without another round trip: under read committed, GetKey's fresh
// snapshot sees a row that made the claim conflict.
func ClaimKeyRestore(ctx context.Context, tx pgx.Tx, arg db.ClaimKeyParams) (claimed, found bool, row db.GetKeyRow, err error) {
	b := &pgx.Batch{}
	b.Queue(db.ClaimKey, arg.Scope, arg.Principal, arg.Key, arg.Fingerprint, arg.TtlSeconds, arg.LockID).Exec(func(ct pgconn.CommandTag) error {
		claimed = ct.RowsAffected() == 1
		return nil
	})
	b.Queue(db.GetKey, arg.Scope, arg.Principal, arg.Key).QueryRow(func(r pgx.Row) error {
		err := r.Scan(&row.Fingerprint, &row.StatusCode, &row.Headers, &row.Body, &row.ExpiresAt, &row.Live)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		found = err == nil
		return err
	})
	b.Queue(db.RestoreLockTimeout)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return false, false, db.GetKeyRow{}, err
	}
	return claimed, found, row, nil
}
