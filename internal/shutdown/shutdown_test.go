//go:build unix

package shutdown_test

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/idemgen/idemgen/internal/shutdown"
)

// TestMain makes the test binary, with SHUTDOWN_TEST_CHILD=1, a command
// that takes its context from shutdown.Context, says "ready", says
// "cancelled" when the context is done and then never finishes its
// graceful stop: only the second signal can end it.
func TestMain(m *testing.M) {
	if os.Getenv("SHUTDOWN_TEST_CHILD") == "1" {
		ctx, stop := shutdown.Context("child")
		defer stop()
		fmt.Println("ready")
		<-ctx.Done()
		fmt.Println("cancelled")
		time.Sleep(time.Hour) // a graceful stop that hangs
		os.Exit(0)
	}
	os.Exit(m.Run())
}

type child struct {
	cmd    *exec.Cmd
	lines  chan string
	stderr *bytes.Buffer
	exited chan struct{} // closed when the child has ended, with err set
	err    error
}

func startChild(t *testing.T) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "SHUTDOWN_TEST_CHILD=1")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	c := &child{cmd: cmd, lines: make(chan string, 10), stderr: new(bytes.Buffer), exited: make(chan struct{})}
	cmd.Stderr = c.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		for sc := bufio.NewScanner(stdout); sc.Scan(); {
			c.lines <- sc.Text()
		}
		close(c.lines)
		c.err = cmd.Wait()
		close(c.exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-c.exited
	})
	c.expect(t, "ready")
	return c
}

func (c *child) expect(t *testing.T, want string) {
	t.Helper()
	select {
	case got := <-c.lines:
		if got != want {
			t.Fatalf("child said %q, want %q (stderr: %s)", got, want, c.stderr)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("child did not say %q within 10s", want)
	}
}

func (c *child) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := c.cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
}

// wantKilledBy waits for the child to end by the default action of sig (or
// of one of alts), with the one-line message on stderr.
func (c *child) wantKilledBy(t *testing.T, sig syscall.Signal, alts ...syscall.Signal) {
	t.Helper()
	select {
	case <-c.exited:
		err := c.err
		var ee *exec.ExitError
		if !errors.As(err, &ee) {
			t.Fatalf("child exited with %v, want death by %v", err, sig)
		}
		ws := ee.Sys().(syscall.WaitStatus)
		if !ws.Signaled() || ws.Signal() != sig && !slices.Contains(alts, ws.Signal()) {
			t.Fatalf("child ended with %v, want death by %v", err, sig)
		}
		sig = ws.Signal()
	case <-time.After(10 * time.Second):
		t.Fatalf("child still running 10s after the second signal (its graceful stop never ends)")
	}
	if want := fmt.Sprintf("child: second signal (%v): exiting at once\n", sig); c.stderr.String() != want {
		t.Errorf("stderr = %q, want %q", c.stderr, want)
	}
}

// The first signal cancels the context and leaves the process running (its
// graceful stop); the second, of either kind, ends it at once.
func TestSecondSignalEndsAtOnce(t *testing.T) {
	for _, sigs := range [][2]syscall.Signal{{syscall.SIGINT, syscall.SIGINT}, {syscall.SIGTERM, syscall.SIGINT}, {syscall.SIGINT, syscall.SIGTERM}} {
		t.Run(fmt.Sprintf("%v then %v", sigs[0], sigs[1]), func(t *testing.T) {
			c := startChild(t)
			c.signal(t, sigs[0])
			c.expect(t, "cancelled")
			select {
			case <-c.exited:
				t.Fatalf("the first signal ended the process (%v); it should only cancel the context", c.err)
			case <-time.After(200 * time.Millisecond):
			}
			c.signal(t, sigs[1])
			c.wantKilledBy(t, sigs[1])
		})
	}
}

// Two signals sent together are two signals: the second is not swallowed
// while the first is being taken.
func TestTwoSignalsTogether(t *testing.T) {
	c := startChild(t)
	c.signal(t, syscall.SIGTERM)
	c.signal(t, syscall.SIGINT)
	// Which of the two is taken second is the kernel's choice (it delivers
	// pending signals lowest number first).
	c.wantKilledBy(t, syscall.SIGINT, syscall.SIGTERM)
}

// stop cancels the context, and may be called again.
func TestStopCancels(t *testing.T) {
	ctx, stop := shutdown.Context("test")
	stop()
	if ctx.Err() == nil {
		t.Fatal("stop did not cancel the context")
	}
	stop() // twice is harmless
}
