package dbx

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/runtime/internal/db"
)

// Settings are the transaction-scoped settings sent with BEGIN. A zero field
// leaves that setting as the session has it.
type Settings struct {
	// LockTimeout bounds the claim's lock waits; RestoreLockTimeout puts the
	// session's value back before the function runs.
	LockTimeout time.Duration
	// ConnCheck is client_connection_check_interval.
	ConnCheck time.Duration
	// Idle is idle_in_transaction_session_timeout.
	Idle time.Duration
}

// Pipelined reports whether a transaction begun with opts can be begun in
// the same round trip as the queries that follow it: a custom BeginQuery
// may hold several statements, which the extended protocol a batch uses
// cannot run, so such a transaction is begun on its own (BoundedBegin).
func Pipelined(opts pgx.TxOptions) bool {
	return opts.BeginQuery == ""
}

// queueBegin makes BEGIN (with opts) and the settings s the first queries
// of b. The settings are one prepared statement with their values as
// parameters, so nothing is parsed again on a connection that has run it
// before.
func queueBegin(b *pgx.Batch, opts pgx.TxOptions, s Settings) {
	b.BeginTx(opts)
	if s != (Settings{}) {
		b.Queue(db.SetTxSettings, ms(s.LockTimeout), ms(s.ConnCheck), ms(s.Idle))
	}
}

// ms renders d as a PostgreSQL duration in whole milliseconds, at least 1
// (0 would mean "no limit"), or "" for 0: leave the setting alone.
func ms(d time.Duration) string {
	if d <= 0 {
		return ""
	}
	return strconv.FormatInt(max(d.Milliseconds(), 1), 10) + "ms"
}

// Begin begins a transaction on conn with the settings s, all in one round
// trip, as Conn.BeginTx with BoundedBegin does but with prepared statements.
// opts must be Pipelined. On error the returned transaction, when not nil,
// must still be rolled back (a setting the server refused leaves it
// aborted); it is closed already when BEGIN itself failed.
func Begin(ctx context.Context, conn *pgx.Conn, opts pgx.TxOptions, s Settings) (pgx.Tx, error) {
	b := &pgx.Batch{}
	queueBegin(b, opts, s)
	br := conn.SendBatch(ctx, b)
	err := br.Close()
	return br.Tx(), err
}

// BeginClaim begins a transaction on conn with the settings s and runs the
// claim of ClaimKeyRestore in the same round trip: BEGIN, the settings,
// ClaimKey, LockExpiredKey, GetKey and RestoreLockTimeout are pipelined, so a replay is
// answered after one round trip and a first request's function runs after
// one. opts must be Pipelined. The results are as ClaimKeyRestore's; on
// error the returned transaction, when not nil, must still be rolled back,
// as Begin's.
func BeginClaim(ctx context.Context, conn *pgx.Conn, opts pgx.TxOptions, s Settings, arg db.ClaimKeyParams) (tx pgx.Tx, claimed, found bool, row db.GetKeyRow, err error) {
	b := &pgx.Batch{}
	queueBegin(b, opts, s)
	queueClaim(b, arg, SnapshotBeforeClaim(opts), &claimed, &found, &row)
	br := conn.SendBatch(ctx, b)
	if err := br.Close(); err != nil {
		return br.Tx(), false, false, db.GetKeyRow{}, err
	}
	return br.Tx(), claimed && !(found && row.Live), found, row, nil
}

// SnapshotBeforeClaim reports whether a transaction begun with opts reads
// from a snapshot taken before the claim's lock (repeatable read,
// serializable, or a custom BeginQuery, which may set either), so that the
// claim must also check the unique index (ClaimKeyRow).
func SnapshotBeforeClaim(opts pgx.TxOptions) bool {
	switch opts.IsoLevel {
	case "", pgx.ReadCommitted, pgx.ReadUncommitted:
		return opts.BeginQuery != ""
	}
	return true
}

// queueClaim queues the claim's statements (see ClaimKeyRestore), which set
// locked (ClaimKey took the key's lock), found and row as their results are
// read. The caller's claim is locked && !(found && row.Live): a live row
// GetKey sees is the key's answer even when the lock was free (it was
// completed between ClaimKey's snapshot and the lock). With rowCheck
// (SnapshotBeforeClaim), ClaimKeyRow follows GetKey.
func queueClaim(b *pgx.Batch, arg db.ClaimKeyParams, rowCheck bool, locked, found *bool, row *db.GetKeyRow) {
	b.Queue(db.ClaimKey, arg.Scope, arg.Principal, arg.Key, arg.LockID).QueryRow(func(r pgx.Row) error {
		return r.Scan(locked)
	})
	b.Queue(db.LockExpiredKey, arg.Scope, arg.Principal, arg.Key, arg.LockID)
	b.Queue(db.GetKey, arg.Scope, arg.Principal, arg.Key).QueryRow(func(r pgx.Row) error {
		err := r.Scan(&row.Fingerprint, &row.StatusCode, &row.Headers, &row.Body, &row.ExpiresAt, &row.Live)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		*found = err == nil
		return err
	})
	if rowCheck {
		b.Queue(db.ClaimKeyRow, arg.Scope, arg.Principal, arg.Key, arg.LockID)
	}
	b.Queue(db.RestoreLockTimeout)
}
