//go:build idemcrash

package crash

import (
	"context"
	"os"
	"syscall"
)

// Point is compiled only into the crash tests' binaries (-tags
// idemcrash). When IDEM_CRASH_AT names this point it SIGKILLs the process;
// when IDEM_STALL_AT names it, it blocks until ctx is cancelled, like a
// downstream call that hangs through a shutdown's drain deadline.
func Point(ctx context.Context, name string) {
	if os.Getenv("IDEM_CRASH_AT") == name {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // the signal is asynchronous; never run past the point
	}
	if os.Getenv("IDEM_STALL_AT") == name {
		<-ctx.Done()
	}
}
