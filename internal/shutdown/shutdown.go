// Package shutdown gives the repository's commands two-step handling of
// SIGINT and SIGTERM: the first cancels a context (a graceful stop: what is
// in flight finishes or rolls back), the second ends the process at once.
// The second step is the way out when the graceful one cannot finish: a
// child process that never exits (go/packages waits on a GOPACKAGESDRIVER
// whose own child keeps its stdout open), a drain longer than the operator
// wants to wait.
package shutdown

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"
)

// signals are the signals Context handles.
var signals = []os.Signal{os.Interrupt, syscall.SIGTERM}

// Context returns a context cancelled by the first SIGINT or SIGTERM. A
// second one writes "prog: second <signal>: exiting at once" to stderr and
// ends the process by the signal's default action (a shell reports 130 for
// SIGINT, 143 for SIGTERM): what is in flight rolls back, as after a crash.
// stop cancels the context and restores the default handling.
//
// Both signals stay caught from the start until the second (a channel of
// 2: neither is lost when they come together), so there is no moment in
// which a second signal is swallowed. signal.NotifyContext, with stop
// called only when the command returns, kept catching and discarding every
// later signal: a command stuck after the first could not be interrupted.
func Context(prog string) (ctx context.Context, stop func()) {
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, signals...)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		select {
		case <-sigs:
		case <-done:
			return
		}
		cancel()
		var sig os.Signal
		select {
		case sig = <-sigs:
		case <-done:
			return
		}
		fmt.Fprintf(os.Stderr, "%s: second signal (%v): exiting at once\n", prog, sig)
		code := 128 + 2 // SIGINT's, as a shell reports a process it killed
		if s, ok := sig.(syscall.Signal); ok {
			code = 128 + int(s)
		}
		// As PID 1 (a container without an init) a signal's default action
		// does not apply, and a SIGINT ignored at start stays ignored after
		// Reset: the exit below ends the process then.
		if os.Getpid() != 1 {
			signal.Reset(signals...)
			if p, err := os.FindProcess(os.Getpid()); err == nil {
				_ = p.Signal(sig)
			}
			time.Sleep(50 * time.Millisecond) // the default action ends the process before this returns
		}
		os.Exit(code)
	}()
	return ctx, sync.OnceFunc(func() {
		signal.Stop(sigs)
		close(done)
		cancel()
	})
}
