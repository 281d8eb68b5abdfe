//go:build unix

package generator

import (
	"os/exec"
	"syscall"
)

// setProcessGroup starts cmd in a process group of its own, as go/packages
// starts the go command, so that a terminal's interrupt reaches idemgen,
// which ends the go command itself.
func setProcessGroup(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
}
