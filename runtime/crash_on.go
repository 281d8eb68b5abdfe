//go:build idemcrash

package runtime

import (
	"os"
	"syscall"
)

// crashPoint SIGKILLs the process when IDEM_CRASH_AT names this point. Only
// binaries built with -tags idemcrash (the crash tests') contain it.
func crashPoint(name string) {
	if os.Getenv("IDEM_CRASH_AT") == name {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // the signal is asynchronous; never run past the point
	}
}
