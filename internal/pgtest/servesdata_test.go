//go:build linux

package pgtest

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// A stale postmaster.pid whose pid now belongs to a process that only
// reads a file in the data directory (tail -f data/postgresql.conf): the
// reaper must not kill it. The old check, the data path anywhere in the
// command line, sent it SIGQUIT.
func TestStopStaleSparesProcessReadingData(t *testing.T) {
	data := filepath.Join(t.TempDir(), "data")
	if err := os.Mkdir(data, 0o700); err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(data, "postgresql.conf")
	if err := os.WriteFile(conf, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	tail := exec.Command("tail", "-f", conf)
	if err := tail.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = tail.Wait(); close(exited) }()
	t.Cleanup(func() { _ = tail.Process.Kill(); <-exited })
	pid := tail.Process.Pid
	if err := os.WriteFile(filepath.Join(data, "postmaster.pid"), []byte(strconv.Itoa(pid)+"\n"+data+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	waitExec(t, pid, "tail")
	if err := stopStale(data); err != nil {
		t.Fatal(err)
	}
	select {
	case <-exited:
		t.Fatalf("stopStale killed pid %d, %q, which only reads a file in the data directory: %v", pid, tail.Args, tail.ProcessState)
	case <-time.After(200 * time.Millisecond):
	}
}

// servesData recognises a server's command line: "-D" then the data
// directory, exactly (not a longer path that starts with it).
func TestServesDataCommandLine(t *testing.T) {
	data := filepath.Join(t.TempDir(), "data")
	for _, c := range []struct {
		args []string
		want bool
	}{
		{[]string{"-c", "exec sleep 60", "postgres", "-D", data}, true},
		{[]string{"-c", "exec sleep 60", "postgres", "-D", data + "2"}, false},
		{[]string{"-c", "exec sleep 60", "less", data + "/postgresql.conf"}, false},
		{[]string{"-c", "exec sleep 60", "x", data}, false},
	} {
		// bash -c 'sleep 60; :' ...: the arguments stay in bash's cmdline.
		args := append([]string{"-c", "sleep 60; :"}, c.args[2:]...)
		cmd := exec.Command("bash", args...)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		waitExec(t, cmd.Process.Pid, "bash")
		got := servesData(cmd.Process.Pid, data)
		_ = cmd.Process.Signal(syscall.SIGKILL)
		_ = cmd.Wait()
		if got != c.want {
			t.Errorf("servesData(%q) = %v, want %v", cmd.Args, got, c.want)
		}
	}
}

// waitExec waits until pid's command line is name's (the child has run
// exec: until then it is a copy of the test binary).
func waitExec(t *testing.T, pid int, name string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if arg0, _, _ := bytes.Cut(b, []byte{0}); filepath.Base(string(arg0)) == name {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pid %d did not exec %s within 10s", pid, name)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A real private cluster's postmaster is recognised, so the reaper still
// stops one left running.
func TestServesDataRealPostmaster(t *testing.T) {
	c := PrivateCluster(t)
	c.mu.Lock()
	pid := c.proc.cmd.Process.Pid
	c.mu.Unlock()
	if !servesData(pid, filepath.Join(c.dir, "data")) {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		t.Fatalf("servesData does not recognise the postmaster %d (cmdline %q) of %s", pid, b, c.data)
	}
}
