//go:build idemcrash

package crash

import (
	"context"
	"os"
	"runtime"
	"strconv"
	"sync/atomic"
	"syscall"
)

// hits counts how often this process reached the point named by
// IDEM_CRASH_AT or IDEM_STOP_AT, so a test can let the first k-1 pass and
// act on the k-th (IDEM_CRASH_HIT, default 1): kills then land at varied
// moments of a run, not always on its first request or record.
var hits atomic.Int64

// Point is compiled only into the crash tests' binaries (-tags idemcrash).
// When IDEM_CRASH_AT names this point it SIGKILLs the process on the
// IDEM_CRASH_HIT-th time it gets here; when IDEM_STOP_AT names it, it
// SIGSTOPs the process there instead (frozen with everything it holds — an
// open transaction, a lease, a group membership — until someone sends
// SIGCONT); when IDEM_STALL_AT names it, it blocks until ctx is cancelled,
// like a downstream call that hangs through a shutdown's drain deadline.
func Point(ctx context.Context, name string) {
	if os.Getenv("IDEM_CRASH_AT") == name && nth() {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // the signal is asynchronous; never run past the point
	}
	if os.Getenv("IDEM_STOP_AT") == name && nth() {
		// Signal this very thread: a SIGSTOP sent to the process is taken
		// by whichever thread the kernel picks, and until that one runs
		// (milliseconds on a loaded machine) this thread goes on past the
		// point — the matrix saw marks land that should have been frozen.
		// A thread-directed stop is acted on before the syscall returns.
		runtime.LockOSThread()
		_ = syscall.Tgkill(os.Getpid(), syscall.Gettid(), syscall.SIGSTOP)
		runtime.UnlockOSThread()
		// After SIGCONT the process goes on from here, late, as a frozen
		// process does.
	}
	if os.Getenv("IDEM_STALL_AT") == name {
		<-ctx.Done()
	}
}

// nth reports whether this hit is the IDEM_CRASH_HIT-th (default 1).
func nth() bool {
	k, err := strconv.ParseInt(os.Getenv("IDEM_CRASH_HIT"), 10, 64)
	if err != nil || k < 1 {
		k = 1
	}
	return hits.Add(1) == k
}
