package main

import (
	"context"
	"net/http"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
)

// A replica frozen in the middle of a request (SIGSTOP after the function
// ran, before the commit: its connection stays open, so neither the kill
// check nor TCP keepalives notice) frees the key after IDLE_TX_TIMEOUT: the
// server ends its session and rolls its work back, and the retry on another
// replica runs and answers 201 within its wait. Before, the key stayed in
// flight until the frozen process woke up, and every retry got 409.
func TestFrozenReplicaFreesItsKey(t *testing.T) {
	dbURL := pgtest.Schema(t)
	frozen := startChild(t, dbURL, "IDEM_STOP_AT=http.after-call", "IDLE_TX_TIMEOUT=1s")
	go func() { _, _, _, _ = charge(frozen.addr, "k-frozen", "o-frozen") }()
	deadline := time.Now().Add(30 * time.Second)
	for !frozen.stoppedNow() {
		if time.Now().After(deadline) {
			t.Fatalf("the replica never froze at http.after-call:\n%s", frozen.log())
		}
		time.Sleep(10 * time.Millisecond)
	}
	defer func() { _ = frozen.cmd.Process.Signal(syscall.SIGCONT) }()

	other := startChild(t, dbURL, "IDLE_TX_TIMEOUT=1s")
	start := time.Now()
	status, body, _, err := charge(other.addr, "k-frozen", "o-frozen") // waits up to the default 5s
	if err != nil {
		t.Fatal(err)
	}
	if status != http.StatusCreated {
		t.Fatalf("retry on another replica while the first is frozen: %d %s (want 201: the frozen session must lose the key)", status, body)
	}
	t.Logf("key freed and charged by the other replica %v after the retry started", time.Since(start).Round(10*time.Millisecond))

	// The frozen replica wakes up to a dead session: its charge is not
	// committed, so the order is charged exactly once.
	if err := frozen.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	time.Sleep(500 * time.Millisecond) // let the woken replica try its commit
	if charges, _ := counts(t, pool, "o-frozen"); charges != 1 {
		t.Fatalf("%d charges for the order, want 1", charges)
	}
	if status, body, hdr, err := charge(other.addr, "k-frozen", "o-frozen"); err != nil || status != http.StatusCreated || hdr.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay: %d %s %v", status, body, err)
	}
}
