// Package crash holds the named crash points of idemgen's runtime. The crash
// tests build binaries with -tags idemcrash and choose a point with
// IDEM_CRASH_AT (SIGKILL there), IDEM_STOP_AT (SIGSTOP there; IDEM_CRASH_HIT=k
// acts on the k-th time the point is reached) or IDEM_STALL_AT (block there until the
// operation's context is cancelled). Without the tag, Point is an empty
// function the compiler removes.
package crash
