package pgtest_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemgen/idemgen/internal/pgtest"
)

// The private cluster survives each kind of restart with its data, and a
// session open across a fast restart ends with 57P01 admin_shutdown (the
// error the runtime tests rely on it to produce).
func TestPrivateClusterRestarts(t *testing.T) {
	t.Parallel()
	c := pgtest.PrivateCluster(t)
	ctx := context.Background()
	exec := func(sql string) error {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		conn, err := pgx.Connect(cctx, c.URL)
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		_, err = conn.Exec(cctx, sql)
		return err
	}
	if err := exec(`CREATE TABLE kept (n int)`); err != nil {
		t.Fatal(err)
	}
	open, err := pgx.Connect(ctx, c.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer open.Close(ctx)
	c.Restart("fast")
	_, err = open.Exec(ctx, "SELECT 1")
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "57P01" {
		t.Fatalf("a session open across a fast restart: %v, want 57P01", err)
	}
	if err := exec(`INSERT INTO kept VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	c.Stop("immediate")
	if err := exec(`SELECT 1`); err == nil {
		t.Fatal("connected to a stopped cluster")
	}
	c.Start()
	if err := exec(`INSERT INTO kept VALUES (2)`); err != nil {
		t.Fatal(err)
	}
	var n int
	conn, err := pgx.Connect(ctx, c.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM kept`).Scan(&n); err != nil || n != 2 {
		t.Fatalf("rows after the restarts: %d, %v", n, err)
	}
}
