package main

import (
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemgen/idemgen/internal/pgtest"
)

// A second SIGTERM (or Ctrl-C) during the not-ready delay ends the process
// at once instead of being ignored for the rest of NOT_READY_DELAY and
// DRAIN_TIMEOUT: the operator's way out of a slow graceful shutdown.
func TestSecondSigtermEndsAtOnce(t *testing.T) {
	c := startChild(t, pgtest.Schema(t), "NOT_READY_DELAY=60s")
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	// The first signal was handled once readiness fails (seen from outside).
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := http.Get("http://" + c.addr + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusServiceUnavailable {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("readiness never failed after SIGTERM: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.exited:
	case <-time.After(10 * time.Second):
		t.Fatal("second SIGTERM ignored: still running 10s later (NOT_READY_DELAY is 60s)")
	}
}

// A SIGTERM and an interrupt sent together (an operator's double Ctrl-C,
// an orchestrator's TERM with a supervisor's INT) end the process at once:
// the second is not swallowed while the first is being taken. The old
// signal.NotifyContext (a buffer of 1, reset only after ctx was done)
// dropped the second whenever it came before that reset.
func TestTwoSignalsTogetherEndAtOnce(t *testing.T) {
	c := startChild(t, pgtest.Schema(t), "NOT_READY_DELAY=60s")
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	_ = c.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-c.exited:
	case <-time.After(10 * time.Second):
		t.Fatal("the second signal was swallowed: still running 10s later (NOT_READY_DELAY is 60s)")
	}
}

// STARTUP_TIMEOUT=0 is a configuration error said as such, not a start-up
// that fails at once blaming an unreachable database.
func TestStartupTimeoutZeroIsRejected(t *testing.T) {
	r := runUntilExit(t, 30*time.Second, 0, "DATABASE_URL="+pgtest.Schema(t), "STARTUP_TIMEOUT=0")
	if r.code == 0 || !strings.Contains(r.stderr, "STARTUP_TIMEOUT") || strings.Contains(r.stderr, "reachable") {
		t.Fatalf("exit %d: %s", r.code, r.stderr)
	}
}
