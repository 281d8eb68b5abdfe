//go:build !unix

package generator

import "os/exec"

func setProcessGroup(cmd *exec.Cmd) {}
