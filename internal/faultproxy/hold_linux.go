package faultproxy

import (
	"syscall"
	"time"
)

// holdFor blocks the calling goroutine's thread for d in the kernel, for
// PreciseLatency: the Go runtime goes on on its other threads meanwhile.
func holdFor(d time.Duration) {
	ts := syscall.NsecToTimespec(int64(d))
	for syscall.Nanosleep(&ts, &ts) == syscall.EINTR {
	}
}
