package pgtest

import (
	"bytes"
	"os"
	"path/filepath"
	"strconv"
)

// DirAndPID returns the cluster's directory and its postmaster's pid, read
// from postmaster.pid.
func DirAndPID(c *Cluster) (string, int) {
	b, _ := os.ReadFile(filepath.Join(c.data, "postmaster.pid"))
	first, _, _ := bytes.Cut(b, []byte("\n"))
	pid, _ := strconv.Atoi(string(bytes.TrimSpace(first)))
	return c.dir, pid
}
