// Package pgconn is a minimal stub of github.com/jackc/pgx/v5/pgconn for the analyzers' tests.
package pgconn

type CommandTag struct{}
