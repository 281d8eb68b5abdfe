//go:build unix

package pgtest

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// clusterPrefix names PrivateCluster's directories in os.TempDir().
const clusterPrefix = "pgtest-cluster-"

// postmaster is a running postgres server, the test process's child.
type postmaster struct {
	cmd    *exec.Cmd
	exited chan struct{} // closed once it exited and was reaped; err is then set
	err    error
}

// startPostmaster starts cmd from a goroutine locked to its OS thread for
// as long as the postmaster runs. The parent-death signal (Pdeathsig) is
// sent when the thread that forked the child ends, not the process
// (go.dev/issue/27505): started from an ordinary goroutine, whose thread
// the runtime may end when it has too many idle ones, the postmaster could
// be sent SIGQUIT in the middle of a test.
func startPostmaster(cmd *exec.Cmd) (*postmaster, error) {
	p := &postmaster{cmd: cmd, exited: make(chan struct{})}
	started := make(chan error, 1)
	go func() {
		// Never unlocked: the thread ends with this goroutine, once the
		// postmaster has exited.
		runtime.LockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		p.err = cmd.Wait()
		close(p.exited)
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return p, nil
}

// lockOwner takes the flock on dir/owner.lock that marks the cluster in
// dir as alive; unlock releases it. The file is locked under another name
// and renamed into place, so that a reaper never finds an owner.lock it
// could take while the cluster is being made. The lock is on the open file
// (not inherited by the server: Go opens files close-on-exec), so the
// kernel releases it when the test process dies, however it dies.
func lockOwner(dir string) (unlock func(), err error) {
	tmp := filepath.Join(dir, "owner.lock.new")
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", tmp, err)
	}
	fmt.Fprintf(f, "%d\n", os.Getpid())
	if err := os.Rename(tmp, filepath.Join(dir, "owner.lock")); err != nil {
		f.Close()
		return nil, err
	}
	return func() { f.Close() }, nil
}

// reapStale removes the private clusters left by test processes that died
// without their cleanup (SIGKILL, a test binary's timeout panic): the
// directories whose owner.lock nobody holds. A postmaster still running
// from one (where the parent-death signal is not available) is stopped
// first (SIGQUIT, then SIGKILL), found by its postmaster.pid. Directories
// without owner.lock (one being made; or made by an older pgtest) are left
// alone.
func reapStale(t testing.TB) {
	t.Helper()
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), clusterPrefix+"*"))
	for _, dir := range dirs {
		f, err := os.Open(filepath.Join(dir, "owner.lock"))
		if err != nil {
			continue
		}
		if syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) != nil {
			f.Close() // alive
			continue
		}
		if err := stopStale(filepath.Join(dir, "data")); err != nil {
			t.Logf("pgtest: stale private cluster %s: %v", dir, err)
		} else if err := os.RemoveAll(dir); err != nil {
			t.Logf("pgtest: remove stale private cluster %s: %v", dir, err)
		} else {
			t.Logf("pgtest: removed stale private cluster %s (its test process died)", dir)
		}
		f.Close()
	}
}

// stopStale stops the postmaster that postmaster.pid in data names, if it
// still runs and still is that data directory's postmaster.
func stopStale(data string) error {
	b, err := os.ReadFile(filepath.Join(data, "postmaster.pid"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	first, _, _ := bytes.Cut(b, []byte("\n"))
	pid, err := strconv.Atoi(string(bytes.TrimSpace(first)))
	if err != nil || pid <= 0 {
		return nil // not written out yet when the test died: nothing ran
	}
	if !running(pid) || !servesData(pid, data) {
		return nil
	}
	_ = syscall.Kill(pid, syscall.SIGQUIT)
	for range 100 {
		if !running(pid) {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	_ = syscall.Kill(pid, syscall.SIGKILL)
	for range 50 {
		if !running(pid) {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("its postmaster (pid %d) survives SIGKILL", pid)
}

// running reports whether the process pid exists and is not a zombie (a
// postmaster whose parent died is reparented, and an init that does not
// reap leaves it a zombie: gone for every purpose here).
func running(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true // no procfs: trust kill(0)
	}
	// "pid (comm) S ...": the state follows the last ')'.
	if i := bytes.LastIndexByte(stat, ')'); i >= 0 && i+2 < len(stat) {
		return stat[i+2] != 'Z' && stat[i+2] != 'X'
	}
	return true
}

// servesData reports whether pid's command line is a server's for data:
// the arguments "-D" and data, as Start passes them (a pid in a stale
// postmaster.pid may since belong to another process, and one merely
// naming a file in data, such as "tail -f data/postgresql.conf", is not
// the server). Without procfs it cannot tell and says yes.
func servesData(pid int, data string) bool {
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		_, noProcfs := os.Stat("/proc/self")
		return noProcfs != nil
	}
	args := bytes.Split(bytes.TrimSuffix(cmdline, []byte{0}), []byte{0})
	for i := 1; i+1 < len(args); i++ {
		if string(args[i]) == "-D" && string(args[i+1]) == data {
			return true
		}
	}
	return false
}
