package pgtest

import "syscall"

// setParentDeathSignal has the kernel send the postmaster SIGQUIT (an
// immediate shutdown: its backends end at once, the next start would run
// crash recovery) when the thread that started it ends, which is when the
// test process dies if nothing else ended it first.
func setParentDeathSignal(a *syscall.SysProcAttr) {
	a.Pdeathsig = syscall.SIGQUIT
}
