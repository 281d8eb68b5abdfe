// Package crash holds the named crash points of idemgen's runtime. The crash
// tests build binaries with -tags idemcrash and choose a point with
// IDEM_CRASH_AT (SIGKILL there) or IDEM_STALL_AT (block there until the
// operation's context is cancelled). Without the tag, Point is an empty
// function the compiler removes.
package crash
