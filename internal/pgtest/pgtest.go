// Package pgtest gives each test its own schema on a real PostgreSQL server,
// so storage tests run in parallel without seeing each other's rows.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultURL is used when DATABASE_URL is not set: the local server.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// BaseURL returns DATABASE_URL or DefaultURL.
func BaseURL() string {
	if u := os.Getenv("DATABASE_URL"); u != "" {
		return u
	}
	return DefaultURL
}

// Schema creates a fresh schema, drops it when the test ends, and returns a
// connection URL whose search_path is that schema. A child process given this
// URL works in the same schema.
func Schema(t testing.TB) string {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, BaseURL())
	if err != nil {
		t.Fatalf("connect to PostgreSQL (set DATABASE_URL): %v", err)
	}
	defer conn.Close(ctx)
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	name := "t_" + hex.EncodeToString(b)
	if _, err := conn.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("create schema: %v", err)
	}
	t.Cleanup(func() {
		conn, err := pgx.Connect(context.Background(), BaseURL())
		if err != nil {
			t.Errorf("drop schema %s: %v", name, err)
			return
		}
		defer conn.Close(context.Background())
		if _, err := conn.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{name}.Sanitize()+" CASCADE"); err != nil {
			t.Errorf("drop schema %s: %v", name, err)
		}
	})
	u, err := url.Parse(BaseURL())
	if err != nil {
		t.Fatalf("parse DATABASE_URL: %v", err)
	}
	q := u.Query()
	q.Set("search_path", name)
	u.RawQuery = q.Encode()
	return u.String()
}

// Pool returns a pool on a fresh schema (see Schema), closed when the test ends.
func Pool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return PoolConfig(t, nil)
}

// PoolConfig is Pool with a hook to adjust the pool's configuration.
func PoolConfig(t testing.TB, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	return PoolURL(t, Schema(t), configure)
}

// PoolURL is a pool on url (a Schema's, a PrivateCluster's), configured by
// configure when not nil, closed when the test ends.
func PoolURL(t testing.TB, url string, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatalf("parse config: %v", err)
	}
	if configure != nil {
		configure(cfg)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// Exec runs sql (possibly several statements) or fails the test.
func Exec(t testing.TB, pool *pgxpool.Pool, sql string) {
	t.Helper()
	conn, err := pool.Acquire(context.Background())
	if err != nil {
		t.Fatalf("acquire: %v", err)
	}
	defer conn.Release()
	if _, err := conn.Conn().PgConn().Exec(context.Background(), sql).ReadAll(); err != nil {
		t.Fatalf("exec %q: %v", sql, err)
	}
}

// Count returns the int64 result of a one-value query, or fails the test.
func Count(t testing.TB, pool *pgxpool.Pool, sql string, args ...any) int64 {
	t.Helper()
	var n int64
	if err := pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("query %q: %v", sql, err)
	}
	return n
}
