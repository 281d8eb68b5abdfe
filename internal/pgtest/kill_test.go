//go:build linux

package pgtest_test

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemgen/idemgen/internal/pgtest"
)

// A test process killed by SIGKILL (a CI job's timeout, an OOM kill) runs
// no cleanup: its private cluster's postmaster gets SIGQUIT from the kernel
// (the parent-death signal) and exits, and the next PrivateCluster removes
// the directory. The old one, daemonized by pg_ctl, ran on for ever with its
// directory, a port and shared memory.
func TestKilledTestLeavesNoCluster(t *testing.T) {
	switch os.Getenv("PGTEST_KILLED_CHILD") {
	case "1":
		c := pgtest.PrivateCluster(t)
		dir, pid := pgtest.DirAndPID(c)
		fmt.Printf("\ncluster %s %d\n", dir, pid)
		time.Sleep(time.Hour) // until killed
		return
	case "reap":
		pgtest.PrivateCluster(t)
		return
	}
	t.Parallel()
	// The children's clusters go in a TMPDIR of this test's own: the
	// PrivateCluster of any other test process running meanwhile (go test
	// with several packages) would reap the killed child's directory
	// before this test looks at it.
	// (Not t.TempDir: its 0700 parent keeps out the postgres user, as whom
	// the server runs when the tests run as root.)
	tmp, err := os.MkdirTemp("", "pgtest-killed-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(tmp) })
	if err := os.Chmod(tmp, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestKilledTestLeavesNoCluster$", "-test.v")
	cmd.Env = append(os.Environ(), "PGTEST_KILLED_CHILD=1", "TMPDIR="+tmp)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	var dir string
	var pid int
	found := make(chan struct{})
	go func() {
		for sc := bufio.NewScanner(stdout); sc.Scan(); {
			if f := strings.Fields(sc.Text()); len(f) == 3 && f[0] == "cluster" {
				dir = f[1]
				pid, _ = strconv.Atoi(f[2])
				close(found)
			}
		}
	}()
	select {
	case <-found:
	case <-time.After(2 * time.Minute):
		t.Fatal("the child test did not start its private cluster within 2 minutes")
	}
	if pid <= 0 || !alive(pid) {
		t.Fatalf("the child's postmaster (pid %d, dir %s) is not running to begin with", pid, dir)
	}
	t.Cleanup(func() { // the old code's leftovers
		if alive(pid) {
			_ = syscall.Kill(pid, syscall.SIGQUIT)
		}
	})

	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	deadline := time.Now().Add(10 * time.Second)
	for alive(pid) {
		if time.Now().After(deadline) {
			t.Fatalf("the postmaster (pid %d) of the SIGKILLed test's cluster still runs 10s later", pid)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if _, err := os.Stat(filepath.Join(dir, "data")); err != nil {
		t.Fatalf("the killed test's cluster directory is gone before any reaping, so this test shows nothing: %v", err)
	}

	reap := exec.Command(os.Args[0], "-test.run=^TestKilledTestLeavesNoCluster$", "-test.v")
	reap.Env = append(os.Environ(), "PGTEST_KILLED_CHILD=reap", "TMPDIR="+tmp)
	if out, err := reap.CombinedOutput(); err != nil {
		t.Fatalf("the next PrivateCluster: %v\n%s", err, out)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("the killed test's cluster directory %s is still there after the next PrivateCluster (stat: %v)", dir, err)
	}
}

// alive reports whether pid runs: not gone, not a zombie (the postmaster,
// orphaned, is reparented to an init that may never reap it).
func alive(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(stat, ')')
	return i < 0 || i+2 >= len(stat) || stat[i+2] != 'Z'
}
