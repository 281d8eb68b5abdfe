//go:build unix

package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemgen/idemgen/internal/faultproxy"
)

// These tests run idemctl as a real child process (the test binary under
// the name idemctl, which testscript.Main puts on $PATH) and signal it as an
// operator's Ctrl-C would, at points of a replay set by the broker (a kfake
// control function on Produce) and the database (a faultproxy in front of
// it).

// output collects a child's stdout or stderr and tells a waiter when it
// holds a string.
type output struct {
	mu      sync.Mutex
	b       bytes.Buffer
	changed chan struct{}
}

func newOutput() *output { return &output{changed: make(chan struct{}, 1)} }

func (o *output) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	select {
	case o.changed <- struct{}{}:
	default:
	}
	return o.b.Write(p)
}

func (o *output) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.b.String()
}

// waitFor waits up to d for the output to hold s and reports whether it did.
func (o *output) waitFor(s string, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	for !strings.Contains(o.String(), s) {
		select {
		case <-o.changed:
		case <-t.C:
			return strings.Contains(o.String(), s)
		}
	}
	return true
}

type idemctlChild struct {
	cmd            *exec.Cmd
	stdout, stderr *output
	exited         chan struct{}
	err            error
}

func startIdemctl(t *testing.T, env []string, args ...string) *idemctlChild {
	t.Helper()
	path, err := exec.LookPath("idemctl")
	if err != nil {
		t.Fatalf("idemctl is not on $PATH (testscript.Main puts it there): %v", err)
	}
	c := &idemctlChild{cmd: exec.Command(path, args...), stdout: newOutput(), stderr: newOutput(), exited: make(chan struct{})}
	c.cmd.Env = append(os.Environ(), env...)
	c.cmd.Stdout, c.cmd.Stderr = c.stdout, c.stderr
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		c.err = c.cmd.Wait()
		close(c.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-c.exited:
		default:
			_ = c.cmd.Process.Kill()
			<-c.exited
		}
	})
	return c
}

func (c *idemctlChild) signal(t *testing.T, sig os.Signal) {
	t.Helper()
	if err := c.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("signal %v: %v", sig, err)
	}
}

// wait waits up to d for the child to exit and returns its exit code, -1
// if a signal ended it, or fails the test.
func (c *idemctlChild) wait(t *testing.T, d time.Duration) int {
	t.Helper()
	select {
	case <-c.exited:
	case <-time.After(d):
		t.Fatalf("idemctl still running %v later\nstdout: %s\nstderr: %s", d, c.stdout, c.stderr)
	}
	var ee *exec.ExitError
	switch {
	case c.err == nil:
		return 0
	case errors.As(c.err, &ee):
		return ee.ExitCode()
	default:
		t.Fatal(c.err)
		return 0
	}
}

// replayFixture is one schema with dead letter 1 (an event id, partition
// key "k"), a proxy in front of its database, and a kfake broker whose
// first Produce request runs onProduce before the broker writes the record
// and acks.
type replayFixture struct {
	conn    *pgx.Conn
	proxy   *faultproxy.Proxy
	brokers []string
	env     []string
}

func newReplayFixture(t *testing.T, onProduce func(db *faultproxy.Proxy)) *replayFixture {
	t.Helper()
	dbURL, conn := testSchemaConn(t)
	insertReplayableDeadLetter(t, conn)
	proxy := faultproxy.New(t, faultproxy.PostgresTarget(dbURL))
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders.confirmed"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	if onProduce != nil {
		cluster.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
			onProduce(proxy)
			return nil, nil, false // the broker writes the record and acks
		})
	}
	return &replayFixture{conn: conn, proxy: proxy, brokers: cluster.ListenAddrs(), env: []string{
		"DATABASE_URL=" + proxy.RewriteURL(dbURL),
		"KAFKA_BROKERS=" + strings.Join(cluster.ListenAddrs(), ","),
		"GORACE=atexit_sleep_ms=0",
	}}
}

// insertReplayableDeadLetter stores dead letter 1 of orders.confirmed, with
// an event id (header idem-event-id "ev-1") and partition key "k".
func insertReplayableDeadLetter(t *testing.T, conn *pgx.Conn) {
	t.Helper()
	if _, err := conn.Exec(context.Background(), `INSERT INTO idem_dead_letters (id, context, topic, kpartition, koffset, record_key, value, header_keys, header_values, attempts, last_error)
		VALUES (1, 'billing', 'orders.confirmed', 0, 7, 'k', 'v', ARRAY['idem-event-id'::bytea], ARRAY['ev-1'::bytea], 3, 'boom')`); err != nil {
		t.Fatal(err)
	}
}

// deadLetterReplayedAt reads dead letter 1's replayed_at (nil: not marked)
// through conn.
func deadLetterReplayedAt(conn *pgx.Conn) (*time.Time, error) {
	var at *time.Time
	err := conn.QueryRow(context.Background(), `SELECT replayed_at FROM idem_dead_letters WHERE id = 1`).Scan(&at)
	return at, err
}

// replayedAt reads dead letter 1's replayed_at (nil: not marked) straight
// from the database, around the proxy.
func (f *replayFixture) replayedAt(t *testing.T) *time.Time {
	t.Helper()
	at, err := deadLetterReplayedAt(f.conn)
	if err != nil {
		t.Fatal(err)
	}
	return at
}

// records reads every record of orders.confirmed (waiting up to 5s for the
// first want of them).
func (f *replayFixture) records(t *testing.T, want int) int {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(f.brokers...), kgo.ConsumeTopics("orders.confirmed"),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	n := 0
	for ctx.Err() == nil {
		n += len(cl.PollFetches(ctx).Records())
		if n >= want {
			// One more short poll: nothing beyond want either.
			sctx, scancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			n += len(cl.PollFetches(sctx).Records())
			scancel()
			break
		}
	}
	return n
}

// producedLine is what idemctl prints once the broker acked a replay's
// record, before it commits the mark.
const producedLine = "record produced to"

// TestReplaySecondSignalAfterAck: the broker acked the replayed record and
// the mark's commit does not get through (the database partitioned right
// then); the operator presses Ctrl-C, nothing happens (the mark's commit
// runs on for up to 10s), and presses it again, which ends idemctl at once
// (exit 130). The README said that idemctl then tells the operator that
// the record WAS produced; it ended with only "second signal (interrupt):
// exiting at once", and the operator, who saw no sign that the record had
// gone out, replayed it again. idemctl must have said so by then: it
// prints that the record was produced as soon as the broker acked.
func TestReplaySecondSignalAfterAck(t *testing.T) {
	var once sync.Once
	produced := make(chan struct{})
	f := newReplayFixture(t, func(db *faultproxy.Proxy) {
		once.Do(func() {
			db.Blackhole() // the mark's COMMIT never reaches the database
			close(produced)
		})
	})
	c := startIdemctl(t, f.env, "deadletters", "replay", "--id", "1", "--yes", "--timeout", "20s")
	select {
	case <-produced:
	case <-time.After(20 * time.Second):
		t.Fatalf("no produce request at the broker\nstdout: %s\nstderr: %s", c.stdout, c.stderr)
	}
	// The ack follows at once; the commit then waits on the partition.
	// Without the line (the old code prints nothing) the ack has surely
	// been received 3s later: the signals still come after it.
	c.stdout.waitFor(producedLine, 3*time.Second)
	c.signal(t, syscall.SIGINT)
	time.Sleep(200 * time.Millisecond)
	c.signal(t, syscall.SIGINT)
	code := c.wait(t, 10*time.Second)
	t.Logf("exit %d\nstdout: %s\nstderr: %s", code, c.stdout, c.stderr)
	if code == 0 {
		t.Fatalf("exit 0 although the mark's commit could not reach the database")
	}
	if !strings.Contains(c.stdout.String(), producedLine) {
		t.Errorf("idemctl ended (exit %d) without saying that the record was produced; an operator replays it again\nstdout: %s\nstderr: %s",
			code, c.stdout, c.stderr)
	}
	f.proxy.Restore() // cut the held connection: the server rolls the mark back
	if n := f.records(t, 1); n != 1 {
		t.Errorf("%d records in the topic, want the 1 replayed", n)
	}
}

// TestReplayInterruptedAfterAckMarks: one Ctrl-C (or SIGTERM) after the
// broker acked, while the mark's COMMIT is on its way (a slow network to
// the database): the real process commits the mark all the same and says
// replayed, exit 0.
func TestReplayInterruptedAfterAckMarks(t *testing.T) {
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) { testReplayInterruptedAfterAckMarks(t, sig) })
	}
}

func testReplayInterruptedAfterAckMarks(t *testing.T, sig syscall.Signal) {
	f := newReplayFixture(t, func(db *faultproxy.Proxy) { db.Latency(1500 * time.Millisecond) })
	c := startIdemctl(t, f.env, "deadletters", "replay", "--id", "1", "--yes", "--timeout", "20s")
	if !c.stdout.waitFor(producedLine, 20*time.Second) {
		t.Fatalf("idemctl did not say the record was produced\nstdout: %s\nstderr: %s", c.stdout, c.stderr)
	}
	c.signal(t, sig)
	code := c.wait(t, 20*time.Second)
	t.Logf("exit %d\nstdout: %s\nstderr: %s", code, c.stdout, c.stderr)
	if code != 0 || !strings.Contains(c.stdout.String(), "replayed dead letter 1") {
		t.Errorf("exit %d after one %v once acked; want 0 and replayed", code, sig)
	}
	if f.replayedAt(t) == nil {
		t.Error("dead letter 1 is not marked replayed although its record was produced")
	}
	f.proxy.Restore()
	if n := f.records(t, 1); n != 1 {
		t.Errorf("%d records in the topic, want 1", n)
	}
}

// TestReplayDatabaseBlackholedAfterAck: the database partitioned right
// after the broker acked, no signal. idemctl must end on its own, say the
// record WAS produced (exit 2), and stay within its bounds:
// IDEMCTL_TIMEOUT + --timeout, plus the mark's own 10s and 5s to read it
// back. It said so after 10s, then sat 15s more in pgxpool.Close (each
// timed-out connection sends the silent server a cancel request, for up
// to 15s) before it exited.
func TestReplayDatabaseBlackholedAfterAck(t *testing.T) {
	f := newReplayFixture(t, func(db *faultproxy.Proxy) { db.Blackhole() })
	start := time.Now()
	c := startIdemctl(t, append(f.env, "IDEMCTL_TIMEOUT=2s"), "deadletters", "replay", "--id", "1", "--yes", "--timeout", "2s")
	said := make(chan time.Duration, 1)
	go func() {
		c.stderr.waitFor("WAS produced", 40*time.Second)
		said <- time.Since(start)
	}()
	code := c.wait(t, 40*time.Second)
	took := time.Since(start)
	saidAfter := <-said
	t.Logf("said WAS produced after %v", saidAfter)
	if took-saidAfter > 3*time.Second {
		t.Errorf("exited %v after saying the record WAS produced", took-saidAfter)
	}
	t.Logf("exit %d after %v\nstdout: %s\nstderr: %s", code, took, c.stdout, c.stderr)
	if code != exitError {
		t.Errorf("exit %d, want %d", code, exitError)
	}
	for _, w := range []string{"the record WAS produced", "do not replay it again"} {
		if !strings.Contains(c.stderr.String(), w) {
			t.Errorf("stderr lacks %q", w)
		}
	}
	if took > 2*time.Second+2*time.Second+10*time.Second+5*time.Second+3*time.Second {
		t.Errorf("took %v: beyond IDEMCTL_TIMEOUT 2s + --timeout 2s + the mark's 10s and its read-back's 5s", took)
	}
	f.proxy.Restore()
	if at := f.replayedAt(t); at != nil {
		t.Errorf("marked replayed at %v although its COMMIT never reached the database", at)
	}
}

// TestReplayMarkAnswerLost: the mark's COMMIT reaches the database and
// commits, but its answer comes later than the mark's 10s (a slow network:
// COMMIT lands 11s after it was sent, its answer later still).
// idemctl said "the dead letter was NOT marked replayed", exit 2, of a
// dead letter marked replayed: the COMMIT's outcome was unknown, not a
// failure. It reads the mark back, once the replay's transaction has
// ended (a plain read at 10s read it unset: the COMMIT was still on its
// way), and says replayed.
func TestReplayMarkAnswerLost(t *testing.T) {
	f := newReplayFixture(t, func(db *faultproxy.Proxy) {
		db.Latency(11 * time.Second) // what is sent now: the mark's COMMIT
		time.AfterFunc(time.Second, func() { db.Latency(0) })
	})
	start := time.Now()
	c := startIdemctl(t, f.env, "deadletters", "replay", "--id", "1", "--yes", "--timeout", "20s")
	code := c.wait(t, 60*time.Second)
	t.Logf("exit %d after %v\nstdout: %s\nstderr: %s", code, time.Since(start), c.stdout, c.stderr)
	if time.Since(start) < 10*time.Second {
		t.Fatal("the mark's COMMIT was answered within its 10s: the case is not tested (sent after the latency was lifted?)")
	}
	at := f.replayedAt(t)
	t.Logf("replayed_at %v", at)
	if at == nil {
		t.Fatal("the mark did not commit: the test's latency did not let the COMMIT through")
	}
	if strings.Contains(c.stderr.String(), "NOT marked replayed") {
		t.Errorf("idemctl said the dead letter was NOT marked replayed; it is, since %v", at)
	}
	if code != 0 || !strings.Contains(c.stdout.String(), "replayed dead letter 1") {
		t.Errorf("exit %d; want 0 and replayed: the mark read back is set", code)
	}
}

// TestReplayConcurrentRealProcesses: two idemctl processes replay dead
// letter 1 at once; the second waits on the first's row lock while the
// broker holds the first's produce, then finds it replayed. One record.
func TestReplayConcurrentRealProcesses(t *testing.T) {
	inProduce := make(chan struct{})
	release := make(chan struct{})
	var once sync.Once
	f := newReplayFixture(t, func(*faultproxy.Proxy) {
		once.Do(func() {
			close(inProduce)
			<-release
		})
	})
	a := startIdemctl(t, f.env, "deadletters", "replay", "--id", "1", "--yes")
	select {
	case <-inProduce:
	case <-time.After(20 * time.Second):
		t.Fatalf("no produce\nstderr: %s", a.stderr)
	}
	app := "revcli-b-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	envB := append([]string{}, f.env...)
	envB[0] += "&application_name=" + app
	b := startIdemctl(t, envB, "deadletters", "replay", "--id", "1", "--yes")
	// b's UPDATE waits on a's row lock.
	for deadline := time.Now().Add(20 * time.Second); ; {
		var waiting int
		if err := f.conn.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND wait_event_type = 'Lock'`, app).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the second replay never waited on the first's lock\nstdout: %s\nstderr: %s", b.stdout, b.stderr)
		}
		time.Sleep(20 * time.Millisecond)
	}
	close(release)
	ca, cb := a.wait(t, 20*time.Second), b.wait(t, 20*time.Second)
	t.Logf("a: exit %d %s %s\nb: exit %d %s %s", ca, a.stdout, a.stderr, cb, b.stdout, b.stderr)
	if ca != 0 || cb != 0 {
		t.Errorf("exits %d, %d; want 0, 0", ca, cb)
	}
	if !strings.Contains(b.stdout.String(), "replayed already; nothing done") {
		t.Errorf("the second replay did not find it replayed")
	}
	if n := f.records(t, 1); n != 1 {
		t.Errorf("%d records in the topic, want 1", n)
	}
}

// TestReplayInterruptedBeforeAck: Ctrl-C while the broker has written the
// record but its ack has not arrived (the network to the broker went
// silent after the request). idemctl said only "produce to ...: context
// canceled", exit 2: neither that the dead letter stays unreplayed nor
// that its record may be out all the same.
func TestReplayInterruptedBeforeAck(t *testing.T) {
	dbURL, conn := testSchemaConn(t)
	insertReplayableDeadLetter(t, conn)
	cluster, proxies := faultproxy.KafkaCluster(t, 1, kfake.SeedTopics(1, "orders.confirmed"))
	written := make(chan struct{})
	var once sync.Once
	cluster.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		once.Do(func() {
			faultproxy.Each(proxies, (*faultproxy.Proxy).Blackhole)
			close(written)
		})
		return nil, nil, false
	})
	c := startIdemctl(t, []string{"DATABASE_URL=" + dbURL, "KAFKA_BROKERS=" + strings.Join(cluster.ListenAddrs(), ","), "GORACE=atexit_sleep_ms=0"},
		"deadletters", "replay", "--id", "1", "--yes", "--timeout", "30s")
	select {
	case <-written:
	case <-time.After(20 * time.Second):
		t.Fatalf("no produce\nstderr: %s", c.stderr)
	}
	time.Sleep(300 * time.Millisecond)
	c.signal(t, syscall.SIGINT)
	code := c.wait(t, 20*time.Second)
	t.Logf("exit %d\nstdout: %s\nstderr: %s", code, c.stdout, c.stderr)
	if code != exitError {
		t.Errorf("exit %d, want %d", code, exitError)
	}
	for _, w := range []string{"dead letter 1 stays unreplayed", "the broker may have written its record"} {
		if !strings.Contains(c.stderr.String(), w) {
			t.Errorf("stderr lacks %q", w)
		}
	}
	if at, err := deadLetterReplayedAt(conn); err != nil || at != nil {
		t.Errorf("replayed_at %v (%v), want NULL", at, err)
	}
	faultproxy.Each(proxies, (*faultproxy.Proxy).Restore)
	if n := (&replayFixture{brokers: cluster.ListenAddrs()}).records(t, 1); n != 1 {
		t.Errorf("%d records in the topic: want the 1 the broker wrote (else the case is not tested)", n)
	}
}
