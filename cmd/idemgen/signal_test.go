//go:build unix

package main

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// A load that never finishes (here a GOPACKAGESDRIVER whose own child keeps
// its stdout open: go/packages kills the driver when the context is
// cancelled, then waits for its output forever) is ended by a second
// interrupt. The old signal.NotifyContext kept catching, and dropping,
// every signal after the first until run returned, which it never did:
// Ctrl-C did nothing and only SIGKILL got the user out.
func TestSecondInterruptEndsHungLoad(t *testing.T) {
	dir := t.TempDir()
	mark := filepath.Join(dir, "driver.pids")
	driver := filepath.Join(dir, "driver.sh")
	// The sleep is the driver's child: it inherits the driver's stdout and
	// outlives the driver's SIGKILL.
	script := "#!/bin/sh\necho $$ >> \"$IDEMGEN_TEST_MARK\"\nsleep 600\n"
	if err := os.WriteFile(driver, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	mod := filepath.Join(dir, "m")
	if err := os.MkdirAll(mod, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, content := range map[string]string{
		"go.mod": "module example.com/m\n\ngo 1.26\n",
		"m.go":   "package m\n\nfunc F() {}\n",
	} {
		if err := os.WriteFile(filepath.Join(mod, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}

	cmd := exec.Command(os.Args[0], "check", ".")
	cmd.Dir = mod
	cmd.Env = append(os.Environ(), "IDEMGEN_TEST_MAIN=1", "GOPACKAGESDRIVER="+driver, "IDEMGEN_TEST_MARK="+mark,
		"GOFLAGS=-mod=mod", "GOWORK=off")
	// A process group of its own, so that the cleanup also ends the
	// driver's sleep, which idemgen leaves behind.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	var stderr lockedBuffer // read while idemgen may still write it
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	})

	// The load has started once the driver wrote its pid.
	var driverPid int
	deadline := time.Now().Add(60 * time.Second)
	for driverPid == 0 {
		b, _ := os.ReadFile(mark)
		if first, _, ok := strings.Cut(string(b), "\n"); ok {
			driverPid, _ = strconv.Atoi(first)
		}
		select {
		case err := <-exited:
			t.Fatalf("idemgen ended before its load hung (%v): the driver is not used?\n%s", err, stderr.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("the driver did not start within 60s\n%s", stderr.String())
		}
		time.Sleep(10 * time.Millisecond)
	}

	// The first interrupt cancels the load: go/packages kills the driver
	// (it is gone once reaped), and then waits on the sleep's stdout.
	if err := cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	deadline = time.Now().Add(10 * time.Second)
	for syscall.Kill(driverPid, 0) == nil {
		if time.Now().After(deadline) {
			t.Fatalf("the driver (pid %d) still runs 10s after the first interrupt\n%s", driverPid, stderr.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	select {
	case err := <-exited:
		t.Fatalf("idemgen ended after the first interrupt (%v): the load did not hang, so this test shows nothing\n%s", err, stderr.String())
	case <-time.After(500 * time.Millisecond):
	}

	if err := cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		var ee *exec.ExitError
		if !errors.As(err, &ee) {
			t.Fatalf("idemgen ended with %v after the second interrupt, want death by SIGINT", err)
		}
		if ws := ee.Sys().(syscall.WaitStatus); !ws.Signaled() || ws.Signal() != syscall.SIGINT {
			t.Fatalf("idemgen ended with %v after the second interrupt, want death by SIGINT", err)
		}
		if want := "idemgen: second signal (interrupt): exiting at once\n"; !strings.HasSuffix(stderr.String(), want) {
			t.Errorf("stderr = %q, want it to end with %q", stderr.String(), want)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("idemgen still running 10s after the second interrupt\n%s", stderr.String())
	}
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
