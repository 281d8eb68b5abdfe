package db

// This file is written by hand; the rest of the package is sqlc's. It pipelines
// sqlc's own query constants so the claim costs one round trip, and so that no
// SQL text lives outside templates/.

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ClaimKeyBounded runs SetLockTimeout, ClaimKey and RestoreLockTimeout in one
// pipelined batch inside tx: the wait for a concurrent in-flight duplicate is
// bounded by lockTimeout (a PostgreSQL interval such as "5000ms"), and the
// handler's own statements run with the session's lock_timeout again.
// It returns the number of rows ClaimKey inserted or took over (0 or 1).
func ClaimKeyBounded(ctx context.Context, tx pgx.Tx, lockTimeout string, arg ClaimKeyParams) (int64, error) {
	b := &pgx.Batch{}
	b.Queue(setLockTimeout, lockTimeout)
	claim := b.Queue(claimKey, arg.Scope, arg.Principal, arg.Key, arg.Fingerprint, arg.TtlSeconds)
	b.Queue(restoreLockTimeout)
	var rows int64
	claim.Exec(func(ct pgconn.CommandTag) error {
		rows = ct.RowsAffected()
		return nil
	})
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return 0, err
	}
	return rows, nil
}
