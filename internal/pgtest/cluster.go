package pgtest

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// BinDir finds the PostgreSQL server binaries PrivateCluster runs (initdb,
// postgres): $PGBIN if set, else the newest Debian-style
// /usr/lib/postgresql/<major>/bin holding initdb, else the directory of the
// initdb on $PATH. "" when none is found.
func BinDir() string {
	if b := os.Getenv("PGBIN"); b != "" {
		return b
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	best, bestMajor := "", -1
	for _, d := range dirs {
		major, err := strconv.Atoi(filepath.Base(filepath.Dir(d)))
		if err != nil || major <= bestMajor {
			continue
		}
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			best, bestMajor = d, major
		}
	}
	if best != "" {
		return best
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		return filepath.Dir(p)
	}
	return ""
}

// Cluster is a PostgreSQL server of the test's own (initdb'd into a
// temporary directory), which the test may stop, crash and restart without
// disturbing any other test. Create it with PrivateCluster.
//
// The postmaster is the test process's own child, not a daemon started by
// pg_ctl: on Linux the kernel sends it SIGQUIT (an immediate shutdown) when
// the test process dies, even by SIGKILL, where a daemonized server ran on
// for ever. The directory holds owner.lock, flocked while the cluster
// lives; the next PrivateCluster, in any test process, removes directories
// whose lock is free (see reapStale).
type Cluster struct {
	// URL connects to the cluster's database "postgres" over TCP on
	// 127.0.0.1 as the superuser postgres (trust).
	URL string
	// Port is the TCP port the cluster listens on.
	Port int

	t    testing.TB
	bin  string
	dir  string // the temporary directory: owner.lock, data/, sock/, server.log
	data string
	log  string
	cred *syscall.Credential // the postgres user's when we run as root

	mu   sync.Mutex  // serializes Start and Stop
	proc *postmaster // nil while stopped
}

// PrivateCluster initdb's and starts a private PostgreSQL server (fsync off)
// on a free port of 127.0.0.1, with its unix socket in its own directory.
// When the test ends it is stopped (immediate) and its directory removed,
// whether the test passed or not; if the test failed, the tail of the
// server's log is logged first; if the test process dies without its
// cleanup, the server ends with it (on Linux) and a later PrivateCluster
// removes the directory. Missing binaries fail the test (they are never a
// reason to skip). As root (initdb refuses to run as root) the
// server runs as the user postgres.
func PrivateCluster(t testing.TB) *Cluster {
	t.Helper()
	bin := BinDir()
	if bin == "" {
		t.Fatal("pgtest.PrivateCluster needs the PostgreSQL server binaries (initdb, postgres): none in /usr/lib/postgresql/*/bin or on $PATH; set PGBIN")
	}
	for _, name := range []string{"initdb", "postgres"} {
		if _, err := os.Stat(filepath.Join(bin, name)); err != nil {
			t.Fatalf("pgtest.PrivateCluster needs the PostgreSQL server binaries in %s (set PGBIN): %v", bin, err)
		}
	}
	reapStale(t)
	dir, err := os.MkdirTemp("", clusterPrefix)
	if err != nil {
		t.Fatal(err)
	}
	unlock, err := lockOwner(dir)
	if err != nil {
		os.RemoveAll(dir)
		t.Fatal(err)
	}
	c := &Cluster{t: t, bin: bin, dir: dir, data: filepath.Join(dir, "data"), log: filepath.Join(dir, "server.log")}
	t.Cleanup(func() {
		if t.Failed() {
			c.logTail()
		}
		_ = c.stop(syscall.SIGQUIT)
		_ = os.RemoveAll(dir)
		unlock()
	})
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Fatalf("pgtest.PrivateCluster runs as root, so the server must run as the user postgres (initdb refuses root): %v", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		c.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		if err := os.Chown(dir, uid, gid); err != nil {
			t.Fatal(err)
		}
	}
	sock := filepath.Join(dir, "sock")
	for _, d := range []string{sock} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
		if c.cred != nil {
			if err := os.Chown(d, int(c.cred.Uid), int(c.cred.Gid)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if out, err := c.run(2*time.Minute, filepath.Join(bin, "initdb"), "-D", c.data, "-U", "postgres",
		"-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	c.Port = freePort(t)
	conf := fmt.Sprintf("\nlisten_addresses = '127.0.0.1'\nport = %d\nunix_socket_directories = '%s'\n"+
		"fsync = off\nsynchronous_commit = on\nfull_page_writes = off\nmax_connections = 100\n"+
		"shared_buffers = 32MB\nlog_min_messages = warning\nlog_line_prefix = '%%m [%%p] '\n", c.Port, sock)
	f, err := os.OpenFile(filepath.Join(c.data, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString(conf); err != nil {
		t.Fatal(err)
	}
	f.Close()
	c.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", c.Port)
	c.Start()
	return c
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// run runs a server binary as the cluster's user, bounded by limit.
func (c *Cluster) run(limit time.Duration, name string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = c.dir
	cmd.Env = append(os.Environ(), "LC_ALL=C", "LANG=C")
	if c.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred}
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.Bytes(), err
}

// Start starts the server and waits until it accepts connections (after
// crash recovery, if it was crashed).
func (c *Cluster) Start() {
	c.t.Helper()
	c.mu.Lock()
	if c.proc != nil {
		c.mu.Unlock()
		c.t.Fatal("pgtest: Start of a private cluster that is running")
	}
	logf, err := os.OpenFile(c.log, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		c.mu.Unlock()
		c.t.Fatal(err)
	}
	cmd := exec.Command(filepath.Join(c.bin, "postgres"), "-D", c.data)
	cmd.Dir = c.dir
	cmd.Env = append(os.Environ(), "LC_ALL=C", "LANG=C")
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred}
	setParentDeathSignal(cmd.SysProcAttr)
	p, err := startPostmaster(cmd)
	logf.Close() // the postmaster has its own copy
	if err != nil {
		c.mu.Unlock()
		c.t.Fatalf("start postgres: %v", err)
	}
	c.proc = p
	c.mu.Unlock()
	c.waitReady()
}

// Stop stops the server with the shutdown mode: "smart", "fast" (every
// session ends with 57P01 admin_shutdown, open transactions roll back) or
// "immediate" (a crash: no checkpoint, the next start runs crash recovery).
func (c *Cluster) Stop(mode string) {
	c.t.Helper()
	sig, ok := map[string]syscall.Signal{"smart": syscall.SIGTERM, "fast": syscall.SIGINT, "immediate": syscall.SIGQUIT}[mode]
	if !ok {
		c.t.Fatalf("pgtest: unknown shutdown mode %q (smart, fast, immediate)", mode)
	}
	if err := c.stop(sig); err != nil {
		c.logTail()
		c.t.Fatalf("stop -m %s: %v", mode, err)
	}
}

// stop sends the postmaster sig (its shutdown modes: SIGTERM smart, SIGINT
// fast, SIGQUIT immediate) and waits for it to exit, killing it after 60s.
func (c *Cluster) stop(sig syscall.Signal) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	p := c.proc
	if p == nil {
		return nil
	}
	c.proc = nil
	_ = p.cmd.Process.Signal(sig)
	select {
	case <-p.exited:
		return nil
	case <-time.After(60 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.exited
		return fmt.Errorf("the postmaster did not exit within 60s of %v (killed)", sig)
	}
}

// Restart stops the server with the shutdown mode (see Stop) and starts it.
func (c *Cluster) Restart(mode string) {
	c.t.Helper()
	c.Stop(mode)
	c.Start()
}

// CrashBackend kills (SIGKILL) the backend of a new session: the postmaster
// then ends every other session (57P02 crash_shutdown), runs crash recovery
// and accepts connections again by itself (restart_after_crash), refusing
// them with 57P03 meanwhile. It returns once the server answers again.
func (c *Cluster) CrashBackend() {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, c.URL)
	if err != nil {
		c.t.Fatalf("connect to crash a backend: %v", err)
	}
	defer conn.Close(context.Background())
	var pid int
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		c.t.Fatalf("backend pid: %v", err)
	}
	before := strings.Count(c.Log(), "reinitializing")
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		c.t.Fatalf("kill backend %d: %v", pid, err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for strings.Count(c.Log(), "reinitializing") == before {
		if time.Now().After(deadline) {
			c.logTail()
			c.t.Fatalf("the postmaster did not reinitialize within 30s of backend %d's crash", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
	c.waitReady()
}

// Disruptions runs, one after the other, the four ways the tests take the
// server away: a fast restart, an immediate stop and a start (crash
// recovery), a crashed backend (the postmaster's own restart), and a fast
// stop with 3s down before the start. After each, recovered(name) checks
// that the work under test goes on (it fails the test otherwise). It
// returns each disruption's time, the check included, for the test's log.
func (c *Cluster) Disruptions(recovered func(name string)) []string {
	c.t.Helper()
	var timings []string
	for _, d := range []struct {
		name string
		do   func()
	}{
		{"restart -m fast", func() { c.Restart("fast") }},
		{"stop -m immediate, start (crash recovery)", func() { c.Stop("immediate"); c.Start() }},
		{"a backend killed (crash restart by the postmaster)", c.CrashBackend},
		{"stop -m fast, 3s down, start", func() {
			c.Stop("fast")
			time.Sleep(3 * time.Second)
			c.Start()
		}},
	} {
		start := time.Now()
		d.do()
		recovered(d.name)
		timings = append(timings, fmt.Sprintf("%s: %v", d.name, time.Since(start).Round(time.Millisecond)))
	}
	return timings
}

// waitReady polls until a connection runs a query (after start-up and any
// crash recovery), failing the test if the postmaster exits meanwhile.
func (c *Cluster) waitReady() {
	c.t.Helper()
	c.mu.Lock()
	p := c.proc
	c.mu.Unlock()
	deadline := time.Now().Add(60 * time.Second)
	for {
		if p != nil {
			select {
			case <-p.exited:
				c.logTail()
				c.t.Fatalf("the private cluster's postmaster exited while starting: %v", p.err)
			default:
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		conn, err := pgx.Connect(ctx, c.URL)
		if err == nil {
			_, err = conn.Exec(ctx, "SELECT 1")
			conn.Close(ctx)
		}
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			c.logTail()
			c.t.Fatalf("private cluster not ready after 60s: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Log returns the server's log so far.
func (c *Cluster) Log() string {
	b, _ := os.ReadFile(c.log)
	return string(b)
}

func (c *Cluster) logTail() {
	b := []byte(c.Log())
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	c.t.Logf("private cluster log (tail):\n%s", b)
}

// SyncStandbyNamed sets synchronous_standby_names (ALTER SYSTEM, reload) on
// the server at url and waits until it is in force for COMMITs. Naming a
// standby that never connects makes every COMMIT (synchronous_commit on)
// commit locally and then wait: a commit that went through but has no
// answer yet, for tests of what a restart or crash does to it. "" resets
// it, and COMMITs no longer wait.
//
// A new session's SHOW is not enough to know that: a COMMIT waits only
// while the shared flag sync_standbys_defined is set, and the checkpointer,
// not the postmaster, sets and clears it when it gets to the reload. On a
// loaded machine a COMMIT right after SHOW reports the name could still
// commit without waiting (the test's commit answered at once). So it ends
// with probe commits (a WAL record, no data) until one waits for the
// standby when a name is set (that probe is cancelled: committed locally,
// no harm) or until one does not wait when it is reset.
func SyncStandbyNamed(t testing.TB, url, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	stmt := "ALTER SYSTEM RESET synchronous_standby_names"
	if name != "" {
		stmt = "ALTER SYSTEM SET synchronous_standby_names = " + pgx.Identifier{name}.Sanitize()
	}
	if _, err := conn.Exec(ctx, stmt); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
		t.Fatal(err)
	}
	for {
		c, err := pgx.Connect(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		var v string
		err = c.QueryRow(ctx, "SHOW synchronous_standby_names").Scan(&v)
		c.Close(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if strings.Trim(v, `"`) == name {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("synchronous_standby_names is %q 30s after setting it to %q", v, name)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for {
		waited, err := commitWaits(ctx, url)
		if err != nil {
			t.Fatalf("synchronous_standby_names = %q: a probe commit: %v", name, err)
		}
		if waited == (name != "") {
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("synchronous_standby_names = %q: COMMITs still waited=%v for a standby 30s after the reload", name, waited)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// commitWaits commits a probe transaction (a WAL record, no data) on a new
// session to the server at url and reports whether its COMMIT waited for a
// synchronous standby; a probe that waits is cancelled (pg_cancel_backend:
// committed locally, the COMMIT returns with a warning).
func commitWaits(ctx context.Context, url string) (bool, error) {
	probe, err := pgx.Connect(ctx, url)
	if err != nil {
		return false, err
	}
	defer probe.Close(context.Background())
	watch, err := pgx.Connect(ctx, url)
	if err != nil {
		return false, err
	}
	defer watch.Close(context.Background())
	pid := probe.PgConn().PID()
	done := make(chan error, 1)
	go func() {
		// A transactional WAL record (an xid, no table): a COMMIT that wrote
		// no WAL before it (txid_current() alone) never waits for a standby.
		_, err := probe.Exec(ctx, "SELECT pg_logical_emit_message(true, 'pgtest', 'sync standby probe')")
		done <- err
	}()
	for {
		select {
		case err := <-done:
			return false, err
		default:
		}
		var waiting bool
		if err := watch.QueryRow(ctx, "SELECT count(*) > 0 FROM pg_stat_activity WHERE pid = $1 AND wait_event = 'SyncRep'", pid).Scan(&waiting); err != nil {
			<-done // ctx is done (the probe's Exec ends with it), or the server went away
			return false, err
		}
		if waiting {
			if _, err := watch.Exec(ctx, "SELECT pg_cancel_backend($1)", pid); err != nil {
				<-done
				return false, err
			}
			return true, <-done
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// WaitSyncRep waits until a session of the server at url waits for its
// synchronous standby (a COMMIT done locally, not yet answered) and returns
// true. It returns false at once if finished (the work under test, which
// should be the session waiting) is closed first: that work ended without
// its COMMIT waiting (it failed early, or it committed with no standby
// named), which the caller reports with what it got; nil waits for a
// session alone. It fails the test if no session waits within 30s.
func WaitSyncRep(t testing.TB, url string, finished <-chan struct{}) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	for {
		var n int
		if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'").Scan(&n); err != nil {
			t.Fatalf("no session waiting for its synchronous standby within 30s: %v", err)
		}
		if n > 0 {
			return true
		}
		select {
		case <-finished:
			return false
		case <-time.After(10 * time.Millisecond):
		}
	}
}
