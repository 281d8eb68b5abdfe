// Package pgx is a minimal stub of github.com/jackc/pgx/v5 for the analyzers' tests.
package pgx

import (
	"context"

	"github.com/jackc/pgx/v5/pgconn"
)

type Rows interface{ Close() }
type Row interface{ Scan(dest ...any) error }
type TxOptions struct{}

type Tx interface {
	Begin(ctx context.Context) (Tx, error)
	Commit(ctx context.Context) error
	Rollback(ctx context.Context) error
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) Row
	Conn() *Conn
}

type Conn struct{}

func (c *Conn) Begin(ctx context.Context) (Tx, error) { return nil, nil }
func (c *Conn) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return pgconn.CommandTag{}, nil
}
func (c *Conn) Query(ctx context.Context, sql string, args ...any) (Rows, error) { return nil, nil }
func (c *Conn) QueryRow(ctx context.Context, sql string, args ...any) Row        { return nil }

type TxBeginner interface {
	Begin(ctx context.Context) (Tx, error)
}

func BeginFunc(ctx context.Context, db TxBeginner, fn func(Tx) error) error { return nil }
