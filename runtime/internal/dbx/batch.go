// Package dbx is the hand-written companion of runtime/internal/db, which is
// sqlc's output only. It packs sqlc's exported query text (sqlc.yaml sets
// emit_exported_queries) into fewer round trips, so that no SQL text lives
// outside templates/ and the claim costs as little as possible.
package dbx

import (
	"context"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemgen/idemgen/runtime/internal/db"
)

// BoundedBegin returns opts changed so that beginning the transaction also
// runs SetLockTimeout, in the same round trip: the claim that follows waits
// at most lockTimeout for a concurrent in-flight duplicate. The begin
// statement and SetLockTimeout go as one simple-protocol query (BEGIN keeps
// the transaction open past it); the timeout is inlined as a literal of
// digits, the only value it can hold.
func BoundedBegin(opts pgx.TxOptions, lockTimeout time.Duration) pgx.TxOptions {
	ms := lockTimeout.Milliseconds()
	if ms < 1 {
		ms = 1 // lock_timeout 0 would mean "wait forever"
	}
	set := strings.Replace(db.SetLockTimeout, "$1", "'"+strconv.FormatInt(ms, 10)+"ms'", 1)
	opts.BeginQuery = beginSQL(opts) + ";\n" + set
	return opts
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
// returns the live row (for a replay or a 422) without another round trip:
// under read committed, GetKey's fresh snapshot sees the row that made the
// claim conflict.
func ClaimKeyRestore(ctx context.Context, tx pgx.Tx, arg db.ClaimKeyParams) (claimed bool, row db.GetKeyRow, err error) {
	b := &pgx.Batch{}
	b.Queue(db.ClaimKey, arg.Scope, arg.Principal, arg.Key, arg.Fingerprint, arg.TtlSeconds).Exec(func(ct pgconn.CommandTag) error {
		claimed = ct.RowsAffected() == 1
		return nil
	})
	b.Queue(db.GetKey, arg.Scope, arg.Principal, arg.Key).QueryRow(func(r pgx.Row) error {
		return r.Scan(&row.Fingerprint, &row.StatusCode, &row.Headers, &row.Body, &row.ExpiresAt)
	})
	b.Queue(db.RestoreLockTimeout)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return false, db.GetKeyRow{}, err
	}
	return claimed, row, nil
}
