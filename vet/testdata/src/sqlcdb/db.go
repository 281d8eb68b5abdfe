// Package sqlcdb has the shape of sqlc output: a DBTX interface and Queries.
package sqlcdb

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

type DBTX interface {
	Exec(context.Context, string, ...interface{}) (pgconn.CommandTag, error)
	Query(context.Context, string, ...interface{}) (pgx.Rows, error)
	QueryRow(context.Context, string, ...interface{}) pgx.Row
}

func New(db DBTX) *Queries { return &Queries{db: db} }

type Queries struct {
	db DBTX
}

func (q *Queries) WithTx(tx pgx.Tx) *Queries { return &Queries{db: tx} }

type Charge struct{ ID int64 }

func (q *Queries) InsertCharge(ctx context.Context, orderID string) (Charge, error) {
	return Charge{}, nil
}
func (q *Queries) GetCharge(ctx context.Context, orderID string) (Charge, error) {
	return Charge{}, nil
}
func (q *Queries) MarkPaid(ctx context.Context, orderID string) error { return nil }
