package dbx

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
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
		b.Queue(db.SetTxSettings, ms(s.LockTimeout), msArg(s.ConnCheck), msArg(s.Idle))
	}
}

// msArgs caches msArg's values: the settings a process sends with every
// transaction (client_connection_check_interval,
// idle_in_transaction_session_timeout) come from its configuration, so a
// handful of values, rendered once each. Keyed by the duration itself, an
// entry is never stale.
var (
	msArgs    sync.Map // time.Duration → any (a string)
	msArgsLen atomic.Int32
)

// maxMSArgs bounds msArgs: past it, values are rendered per call.
const maxMSArgs = 64

// msArg is ms(d) as a query argument, boxed once per value of d (a string
// boxed into an interface is allocated each time it is converted).
func msArg(d time.Duration) any {
	if v, ok := msArgs.Load(d); ok {
		return v
	}
	v := any(ms(d))
	if msArgsLen.Load() < maxMSArgs {
		if _, loaded := msArgs.LoadOrStore(d, v); !loaded {
			msArgsLen.Add(1)
		}
	}
	return v
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
// ClaimKey, GetKey, [ClaimKeyRow] and RestoreLockTimeout are pipelined, so a
// replay is answered after one round trip and a first request's function
// runs after one. Only two rare claims cost a second round trip
// (afterClaim), bounded by what is left of s.LockTimeout: one that takes
// over an expired row, and one in a transaction whose isolation level is
// the session's default (opts name none) when that default turns out to be
// repeatable read or serializable, which checks the unique index then
// (ClaimKeyRow). opts must be Pipelined. The results are as
// ClaimKeyRestore's, and rowChecked reports that ClaimKeyRow ran: the key
// may have a claim row this transaction wrote, which StoreKey (not
// StoreNewKey) replaces. On error the returned transaction, when not nil,
// must still be rolled back, as Begin's.
func BeginClaim(ctx context.Context, conn *pgx.Conn, opts pgx.TxOptions, s Settings, arg db.ClaimKeyParams) (tx pgx.Tx, claimed, found, rowChecked bool, row db.GetKeyRow, err error) {
	start := time.Now()
	b := &pgx.Batch{}
	queueBegin(b, opts, s)
	var locked, snapshot bool
	rowChecked = SnapshotBeforeClaim(opts)
	levelUnknown := opts.IsoLevel == "" // (and no BeginQuery: Pipelined)
	queueClaim(b, arg, rowChecked, levelUnknown, &locked, &found, &snapshot, &row)
	br := conn.SendBatch(ctx, b)
	if err := br.Close(); err != nil {
		return br.Tx(), false, false, false, db.GetKeyRow{}, err
	}
	tx = br.Tx()
	claimed = locked && !(found && row.Live)
	checkRow := claimed && snapshot && !rowChecked
	if claimed && (found || checkRow) {
		if err := afterClaim(ctx, tx, left(s.LockTimeout, start), arg, found, checkRow); err != nil {
			return tx, false, false, false, db.GetKeyRow{}, err
		}
	}
	return tx, claimed, found, rowChecked || checkRow, row, nil
}

// left is what remains of the bound d, counted from start, at least 1ms (0
// would mean "no limit"); 0 when d is 0 (no bound: the session's applies).
func left(d time.Duration, start time.Time) time.Duration {
	if d <= 0 {
		return 0
	}
	return max(d-time.Since(start), time.Millisecond)
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
// (SnapshotBeforeClaim), ClaimKeyRow follows GetKey. With levelUnknown (the
// transaction's isolation level is the session's default), the lock
// timeout is put back by RestoreLockTimeoutSnapshot, which sets snapshot
// when that level reads from a snapshot older than the lock: the caller
// then sends ClaimKeyRow itself (afterClaim) before the function runs. No
// statement here locks a row: a claim that takes over an expired row locks
// it next, in a round trip of its own (afterClaim).
func queueClaim(b *pgx.Batch, arg db.ClaimKeyParams, rowCheck, levelUnknown bool, locked, found, snapshot *bool, row *db.GetKeyRow) {
	// Boxed once for the statements that share them.
	scope, principal, key, lockID := any(arg.Scope), any(arg.Principal), any(arg.Key), any(arg.LockID)
	b.Queue(db.ClaimKey, scope, principal, key, lockID).QueryRow(func(r pgx.Row) error {
		return r.Scan(locked)
	})
	b.Queue(db.GetKey, scope, principal, key).QueryRow(func(r pgx.Row) error {
		err := r.Scan(&row.Fingerprint, &row.StatusCode, &row.Headers, &row.Body, &row.ExpiresAt, &row.Live)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		*found = err == nil
		return err
	})
	if rowCheck {
		b.Queue(db.ClaimKeyRow, scope, principal, key, lockID)
	}
	if !levelUnknown {
		b.Queue(db.RestoreLockTimeout)
		return
	}
	b.Queue(db.RestoreLockTimeoutSnapshot).QueryRow(func(r pgx.Row) error {
		var restored string
		return r.Scan(&restored, snapshot)
	})
}

// afterClaim runs what a claim needs before its function may run, in one
// round trip sent only when there is something to do:
//
//   - lockRow: lock the expired row of the key this transaction claimed
//     (LockExpiredKey), the rare reuse of a key after its TTL. The function
//     must not start before the row is locked, or StoreKey, replacing the
//     row at completion, could wait on a row lock held elsewhere (a purge
//     deleting the expired row) with no bound but the session's. A purge
//     that deleted the row in between leaves nothing to lock, and StoreKey
//     inserts.
//   - checkRow: ClaimKeyRow, for a transaction whose snapshot turned out to
//     predate the claim's lock (the session's default isolation level is
//     repeatable read or serializable): a row completed between the two
//     fails it with 40001, as it does in the claim's round trip when
//     TxOptions name such a level, instead of the function running for a
//     completed key.
//
// The waits are bounded by lockTimeout, set with SetLockTimeout before and
// put back with RestoreLockTimeout after, all pipelined; a lock_timeout
// (55P03) fails the claim as one in the claim's own round trip does. With
// lockTimeout 0 the session's lock_timeout applies, as it did to the claim.
func afterClaim(ctx context.Context, tx pgx.Tx, lockTimeout time.Duration, arg db.ClaimKeyParams, lockRow, checkRow bool) error {
	b := &pgx.Batch{}
	if lockTimeout > 0 {
		b.Queue(db.SetLockTimeout, ms(lockTimeout))
	}
	if lockRow {
		b.Queue(db.LockExpiredKey, arg.Scope, arg.Principal, arg.Key, arg.LockID)
	}
	if checkRow {
		b.Queue(db.ClaimKeyRow, arg.Scope, arg.Principal, arg.Key, arg.LockID)
	}
	if lockTimeout > 0 {
		b.Queue(db.RestoreLockTimeout)
	}
	return tx.SendBatch(ctx, b).Close()
}
