//go:build unix && !linux

package pgtest

import "syscall"

// setParentDeathSignal does nothing: only Linux has a parent-death signal.
// A postmaster left running by a killed test is stopped by the next
// PrivateCluster's reapStale instead.
func setParentDeathSignal(*syscall.SysProcAttr) {}
