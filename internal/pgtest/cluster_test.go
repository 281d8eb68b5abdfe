package pgtest_test

import (
	"context"
	"errors"
	"syscall"
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

// SyncStandbyNamed returns only once the setting is in force for COMMITs,
// not as soon as a new session's SHOW reports it: the checkpointer sets and
// clears the flag COMMITs look at, and on a loaded machine it gets to the
// reload late. Here it is held (SIGSTOP) for a second across each call:
// right after "phantom" a COMMIT must wait for the standby, and right after
// the reset one must not.
func TestSyncStandbyNamedInForceForCommits(t *testing.T) {
	t.Parallel()
	c := pgtest.PrivateCluster(t)
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, c.URL)
	if err != nil {
		t.Fatal(err)
	}
	var ckpt int
	err = conn.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE backend_type = 'checkpointer'`).Scan(&ckpt)
	conn.Close(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Kill(ckpt, syscall.SIGCONT) }) // before the cluster's cleanup stops it
	for _, name := range []string{"phantom", ""} {
		// First the state the call changes is in force (the checkpointer
		// running): COMMITs do not wait before "phantom", and do before the
		// reset.
		for deadline := time.Now().Add(30 * time.Second); commitWaited(t, c.URL) != (name == ""); {
			if time.Now().After(deadline) {
				t.Fatalf("before setting synchronous_standby_names to %q: COMMITs did not change within 30s", name)
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err := syscall.Kill(ckpt, syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		resumed := make(chan struct{})
		time.AfterFunc(time.Second, func() {
			_ = syscall.Kill(ckpt, syscall.SIGCONT)
			close(resumed)
		})
		pgtest.SyncStandbyNamed(t, c.URL, name)
		waited := commitWaited(t, c.URL)
		<-resumed
		if waited != (name != "") {
			t.Errorf("synchronous_standby_names = %q: the next COMMIT waited for a standby: %v", name, waited)
		}
	}
}

// commitWaited commits a transaction (a temporary table) on a new session and
// reports whether its COMMIT waited for a synchronous standby (then it is
// cancelled: committed locally, the COMMIT returns with a warning).
func commitWaited(t *testing.T, url string) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	pid := conn.PgConn().PID()
	finished := make(chan struct{})
	var execErr error
	go func() {
		defer close(finished)
		_, execErr = conn.Exec(ctx, "CREATE TEMP TABLE commit_waited ()")
	}()
	waited := pgtest.WaitSyncRep(t, url, finished)
	if waited {
		other, err := pgx.Connect(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer other.Close(context.Background())
		if _, err := other.Exec(ctx, "SELECT pg_cancel_backend($1)", pid); err != nil {
			t.Fatal(err)
		}
	}
	<-finished
	if execErr != nil {
		t.Fatalf("the COMMIT: %v", execErr)
	}
	return waited
}
