package idem

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/runtime/internal/db"
)

// readCommittedDB is a db.DBTX on a pool that runs each statement as a
// transaction of its own at read committed, whatever the session's
// default_transaction_isolation: BEGIN ISOLATION LEVEL READ COMMITTED, the
// statement and COMMIT are pipelined, one round trip, as the statement
// alone (autocommit) was. The relay's statements need it: its claim takes
// the lease row FOR SHARE and so waits for a renewal in progress, and its
// marks and resets update rows a requeue may hold; under repeatable read
// or serializable the statement's snapshot predates that wait and
// PostgreSQL refuses it with 40001 once the holder commits
// (TestSessionDefaultIsolationClaimRacingARenewal).
type readCommittedDB struct{ pool *pgxpool.Pool }

var _ db.DBTX = readCommittedDB{}

const beginReadCommitted = "begin isolation level read committed"

// send acquires a connection and sends BEGIN, the statement and COMMIT.
// The caller reads the results, then calls end.
func (d readCommittedDB) send(ctx context.Context, sql string, args []any) (*pgxpool.Conn, pgx.BatchResults, error) {
	conn, err := d.pool.Acquire(ctx)
	if err != nil {
		return nil, nil, err
	}
	b := &pgx.Batch{}
	b.Queue(beginReadCommitted)
	b.Queue(sql, args...)
	b.Queue("commit")
	br := conn.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil { // BEGIN
		return conn, br, err
	}
	return conn, br, nil
}

// end closes br and returns conn to the pool. A statement that failed left
// the connection in an aborted transaction (the server skipped the
// COMMIT): it is rolled back first, so that the pool keeps the connection
// instead of closing it. It returns err, or the first error of closing.
func end(ctx context.Context, conn *pgxpool.Conn, br pgx.BatchResults, err error) error {
	if br != nil {
		if cerr := br.Close(); err == nil {
			err = cerr
		}
	}
	if conn == nil {
		return err
	}
	if pc := conn.Conn().PgConn(); !pc.IsClosed() && pc.TxStatus() != 'I' {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
		_, _ = conn.Exec(rctx, "rollback")
		cancel()
	}
	conn.Release()
	return err
}

func (d readCommittedDB) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	conn, br, err := d.send(ctx, sql, args)
	var tag pgconn.CommandTag
	if err == nil {
		tag, err = br.Exec()
	}
	if err == nil {
		_, err = br.Exec() // COMMIT
	}
	return tag, end(ctx, conn, br, err)
}

func (d readCommittedDB) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	conn, br, err := d.send(ctx, sql, args)
	if err != nil {
		return nil, end(ctx, conn, br, err)
	}
	rows, err := br.Query()
	if err != nil {
		if rows != nil {
			rows.Close()
		}
		return nil, end(ctx, conn, br, err)
	}
	return &readCommittedRows{Rows: rows, ctx: ctx, conn: conn, br: br}, nil
}

func (d readCommittedDB) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	rows, err := d.Query(ctx, sql, args...)
	return readCommittedRow{rows: rows, err: err}
}

// readCommittedRows are the statement's rows; once they are read (Next
// returns false) or closed, the COMMIT's result is read too, and Err
// reports its failure: rows whose transaction did not commit are not the
// statement's result.
type readCommittedRows struct {
	pgx.Rows
	ctx  context.Context
	conn *pgxpool.Conn
	br   pgx.BatchResults
	done bool
	err  error
}

func (r *readCommittedRows) finish() {
	if r.done {
		return
	}
	r.done = true
	r.Rows.Close()
	err := r.Rows.Err()
	if err == nil {
		_, err = r.br.Exec() // COMMIT
	}
	r.err = end(r.ctx, r.conn, r.br, err)
}

func (r *readCommittedRows) Next() bool {
	if r.done {
		return false
	}
	if r.Rows.Next() {
		return true
	}
	r.finish()
	return false
}

func (r *readCommittedRows) Err() error {
	if !r.done {
		return r.Rows.Err()
	}
	return r.err
}

func (r *readCommittedRows) Close() { r.finish() }

// readCommittedRow is QueryRow's row: the first row of the statement's
// rows, as pgx's own.
type readCommittedRow struct {
	rows pgx.Rows
	err  error
}

func (r readCommittedRow) Scan(dest ...any) error {
	if r.err != nil {
		return r.err
	}
	defer r.rows.Close()
	if !r.rows.Next() {
		if err := r.rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := r.rows.Scan(dest...); err != nil {
		return err
	}
	r.rows.Close()
	return r.rows.Err()
}
