package kafka_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/internal/relayhook"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// TestMain lets this test binary double as a relay process: with
// IDEM_RELAY_CHILD=1 it runs relayChild instead of the tests, so the
// takeover tests can SIGKILL and SIGSTOP a real process; with
// IDEM_CONSUMER_CHILD=1 it runs consumerChild (attackpw_crash_test.go).
func TestMain(m *testing.M) {
	if os.Getenv("IDEM_CONSUMER_CHILD") == "1" { // before the relay's: startRelayProc sets IDEM_RELAY_CHILD
		os.Exit(consumerChild())
	}
	if os.Getenv("IDEM_RELAY_CHILD") == "1" {
		os.Exit(relayChild())
	}
	os.Exit(m.Run())
}

// taggingPublisher adds the header relay-proc: tag to every message, so a
// test reading the topic knows which relay process produced each record.
type taggingPublisher struct {
	tag   string
	inner idem.Publisher
}

func (p taggingPublisher) Publish(ctx context.Context, msgs []idem.Message) []error {
	for i := range msgs {
		msgs[i].Headers["relay-proc"] = p.tag
	}
	return p.inner.Publish(ctx, msgs)
}

// relayChild runs one relay on IDEM_DB_URL and IDEM_BROKERS with lease
// IDEM_LEASE (and PollInterval IDEM_POLL, default 50ms; with
// IDEM_NO_NOTIFY=1 it polls only, without LISTEN) until SIGTERM. It
// prints LEADING when it becomes the leader; its log goes to stderr. With
// IDEM_TAG its records carry the header relay-proc: IDEM_TAG. It SIGSTOPs
// itself once: with IDEM_STOP_AFTER_CLAIM=1 right after its first non-empty
// claim, with IDEM_STOP_BEFORE_MARK=1 with its first mark about to be sent
// (its context running), with IDEM_STOP_IN_RENEWAL=1 inside its first lease
// renewal's transaction.
func relayChild() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	lease, err := time.ParseDuration(os.Getenv("IDEM_LEASE"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "IDEM_LEASE:", err)
		return 2
	}
	pool, err := pgxpool.New(ctx, os.Getenv("IDEM_DB_URL"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "pool:", err)
		return 2
	}
	defer pool.Close()
	pub, err := kafka.NewPublisher(strings.Split(os.Getenv("IDEM_BROKERS"), ","))
	if err != nil {
		fmt.Fprintln(os.Stderr, "publisher:", err)
		return 2
	}
	defer pub.Close()
	var publish idem.Publisher = pub
	if tag := os.Getenv("IDEM_TAG"); tag != "" {
		publish = taggingPublisher{tag: tag, inner: pub}
	}
	if os.Getenv("IDEM_STOP_AFTER_CLAIM") == "1" {
		relayhook.AfterClaim = stopOnce("CLAIMED; stopping myself")
	}
	if os.Getenv("IDEM_STOP_BEFORE_MARK") == "1" {
		relayhook.BeforeMark = stopOnce("MARKING; stopping myself")
	}
	if os.Getenv("IDEM_STOP_IN_RENEWAL") == "1" {
		relayhook.InRenewal = stopOnce("RENEWING; stopping myself")
	}
	poll := 50 * time.Millisecond
	if s := os.Getenv("IDEM_POLL"); s != "" {
		if poll, err = time.ParseDuration(s); err != nil {
			fmt.Fprintln(os.Stderr, "IDEM_POLL:", err)
			return 2
		}
	}
	r, err := idem.NewRelay(idem.NewStore(pool), publish, idem.RelayConfig{
		Lease: lease, PollInterval: poll, BatchSize: 50,
		Logger:   slog.New(slog.NewTextHandler(os.Stderr, nil)),
		OnLeader: func() { fmt.Println("LEADING") },
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "relay:", err)
		return 2
	}
	if os.Getenv("IDEM_NO_NOTIFY") == "1" {
		relayhook.DisableNotify(r)
	}
	if err := r.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "run:", err)
		return 1
	}
	return 0
}

// stopOnce returns a hook that, the first time it runs, prints say and
// SIGSTOPs the process, and returns only after the SIGCONT.
func stopOnce(say string) func() {
	var once sync.Once
	return func() {
		once.Do(func() {
			// SIGSTOP to oneself takes effect asynchronously (another
			// thread may take the stop first), so wait for the SIGCONT:
			// nothing runs past this point before the process was
			// really stopped and continued.
			cont := make(chan os.Signal, 1)
			signal.Notify(cont, syscall.SIGCONT)
			fmt.Println(say)
			_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP)
			<-cont
			signal.Stop(cont)
		})
	}
}

// relayProc is a relay child process and the lines it printed.
type relayProc struct {
	name string
	cmd  *exec.Cmd
	mu   sync.Mutex
	log  []string
	seen *sync.Cond
}

func startRelayProc(t *testing.T, name, dbURL string, brokers []string, lease time.Duration, env ...string) *relayProc {
	t.Helper()
	p := &relayProc{name: name}
	p.seen = sync.NewCond(&p.mu)
	p.cmd = exec.Command(os.Args[0], "-test.run=^$")
	p.cmd.Env = append(os.Environ(), "IDEM_RELAY_CHILD=1", "IDEM_DB_URL="+dbURL,
		"IDEM_BROKERS="+strings.Join(brokers, ","), "IDEM_LEASE="+lease.String())
	p.cmd.Env = append(p.cmd.Env, env...)
	r, w := io.Pipe()
	p.cmd.Stdout, p.cmd.Stderr = w, w
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			p.mu.Lock()
			p.log = append(p.log, sc.Text())
			p.seen.Broadcast()
			p.mu.Unlock()
		}
	}()
	go func() { _ = p.cmd.Wait(); w.Close() }()
	t.Cleanup(func() {
		_ = p.cmd.Process.Signal(syscall.SIGCONT)
		_ = p.cmd.Process.Kill()
		if t.Failed() {
			t.Logf("relay %s log:\n%s", name, p.text())
		}
	})
	return p
}

func (p *relayProc) text() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.Join(p.log, "\n")
}

// waitFor waits until the process has printed a line containing every one
// of parts, at or after line from, and returns the time it saw it and the
// index after that line.
func (p *relayProc) waitFor(t *testing.T, from int, timeout time.Duration, parts ...string) (time.Time, int) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	timer := time.AfterFunc(timeout, func() { p.mu.Lock(); p.seen.Broadcast(); p.mu.Unlock() })
	defer timer.Stop()
	p.mu.Lock()
	defer p.mu.Unlock()
	for {
	lines:
		for i := from; i < len(p.log); i++ {
			for _, s := range parts {
				if !strings.Contains(p.log[i], s) {
					continue lines
				}
			}
			return time.Now(), i + 1
		}
		if time.Now().After(deadline) {
			t.Fatalf("relay %s did not print %q within %v:\n%s", p.name, parts, timeout, strings.Join(p.log, "\n"))
		}
		p.seen.Wait()
	}
}

// line returns the i-th line the process printed.
func (p *relayProc) line(i int) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.log[i]
}

func (p *relayProc) signal(t *testing.T, sig syscall.Signal) time.Time {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("signal %v to relay %s: %v", sig, p.name, err)
	}
	return time.Now()
}

// Takeover, measured on real processes while events keep being enqueued: the
// leader is SIGKILLed (a standby takes over when the lease expires), then
// the next leader is frozen with SIGSTOP while its connections stay open (the
// case a session advisory lock never noticed: nobody took over). Both
// takeovers come within the lease, plus scheduling slack on a loaded
// machine. The frozen leader, woken with SIGCONT, finds its lease gone and
// stands by without claiming, marking or publishing; in the end every event
// is published, nothing is parked, and per key the first delivery of every
// event is in order.
//
//	go test ./runtime/kafka -run TestRelayTakeoverKilledAndFrozen -v -count=1
func TestRelayTakeoverKilledAndFrozen(t *testing.T) {
	t.Parallel()
	const lease = 2 * time.Second
	const slack = 3 * time.Second // scheduling on 2 shared cores; the design bound is lease + one round trip
	addrs := cluster(t, 4, "events")
	dbURL := pgtest.Schema(t)
	pool, err := pgxpool.New(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}

	// Enqueue events continuously, 8 keys, until stopped.
	var (
		total    int
		stopFeed = make(chan struct{})
		fed      = make(chan int)
	)
	go func() {
		seq := map[string]int{}
		n := 0
		for {
			select {
			case <-stopFeed:
				fed <- n
				return
			case <-time.After(10 * time.Millisecond):
			}
			k := fmt.Sprintf("k%d", n%8)
			tx, err := pool.Begin(context.Background())
			if err == nil {
				err = idem.Enqueue(context.Background(), tx, "events", k, keyed{Key: k, Seq: seq[k]})
				if err == nil {
					err = tx.Commit(context.Background())
				}
				_ = tx.Rollback(context.Background())
			}
			if err != nil {
				t.Errorf("enqueue: %v", err)
				fed <- n
				return
			}
			seq[k]++
			n++
		}
	}()
	published := func() int64 { return statusCounts(t, pool)["PUBLISHED"] }

	a := startRelayProc(t, "A", dbURL, addrs, lease)
	a.waitFor(t, 0, 30*time.Second, "LEADING")
	b := startRelayProc(t, "B", dbURL, addrs, lease)
	b.waitFor(t, 0, 30*time.Second, "standing by")
	waitUntil(t, "A to publish", func() bool { return published() >= 20 })

	killedAt := a.signal(t, syscall.SIGKILL)
	bLed, _ := b.waitFor(t, 0, lease+30*time.Second, "LEADING")
	killed := bLed.Sub(killedAt)
	before := published()
	waitUntil(t, "B to publish", func() bool { return published() >= before+20 })

	c := startRelayProc(t, "C", dbURL, addrs, lease)
	c.waitFor(t, 0, 30*time.Second, "standing by")
	frozenAt := b.signal(t, syscall.SIGSTOP)
	cLed, _ := c.waitFor(t, 0, lease+30*time.Second, "LEADING")
	frozen := cLed.Sub(frozenAt)
	before = published()
	waitUntil(t, "C to publish", func() bool { return published() >= before+20 })

	bLines := len(strings.Split(b.text(), "\n")) // B's lines before the SIGCONT (B has printed some)
	b.signal(t, syscall.SIGCONT)
	b.waitFor(t, bLines, 30*time.Second, "relay stepped down", "relay lease lost")
	time.Sleep(lease) // B runs on for a lease: it must stay a standby
	// Counted from the SIGCONT on: before the freeze B may have led more than
	// one term (a renewal that timed out on a loaded machine makes it step
	// down and start a new term at once, as the lease's holder).
	if woken := strings.Join(strings.Split(b.text(), "\n")[bLines:], "\n"); strings.Contains(woken, "LEADING") {
		t.Fatalf("B led again after waking:\n%s", b.text())
	}

	t.Logf("B after SIGCONT:\n%s", strings.Join(strings.Split(b.text(), "\n")[bLines-1:], "\n"))
	close(stopFeed)
	total = <-fed
	waitUntil(t, "every event to be published", func() bool { return published() == int64(total) })
	if c := statusCounts(t, pool); len(c) != 1 {
		t.Fatalf("statuses %v, want only PUBLISHED", c)
	}
	dups := distinctInKeyOrder(t, addrs, "events", total, 0)
	t.Logf("lease %v: takeover after SIGKILL %v, after SIGSTOP %v; %d events, %d duplicate records",
		lease, killed.Round(time.Millisecond), frozen.Round(time.Millisecond), total, dups)
	if killed > lease+slack || frozen > lease+slack {
		t.Fatalf("takeover took %v (killed) and %v (frozen), lease %v", killed, frozen, lease)
	}
}

// frozenLeaderWakes runs a leader B that SIGSTOPs itself through one of
// relayChild's hooks (stop, e.g. "IDEM_STOP_BEFORE_MARK=1", printing
// stopped), lets a standby C take over and publish the events, wakes B
// once its spent context has run out, and returns the line with which B
// stepped down. With events > 0, C publishes 4 more after taking over.
func frozenLeaderWakes(t *testing.T, stop, stopped string, events int, env ...string) string {
	t.Helper()
	const lease = 2 * time.Second // also the mark's DBTimeout (min(5s, Lease))
	addrs := cluster(t, 2, "events")
	dbURL := pgtest.Schema(t)
	pool := poolOn(t, dbURL)
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	feed := newFeed(t, pool, 4)
	feed.add(events)
	b := startRelayProc(t, "B", dbURL, addrs, lease, append(env, stop)...)
	stoppedAt, _ := b.waitFor(t, 0, 30*time.Second, stopped)
	c := startRelayProc(t, "C", dbURL, addrs, lease)
	c.waitFor(t, 0, lease+30*time.Second, "LEADING")
	if events > 0 {
		feed.add(4)
		events += 4
	}
	waitUntil(t, "C to publish everything", func() bool {
		return statusCounts(t, pool)["PUBLISHED"] == int64(events)
	})
	// B's frozen statement had at most the lease (DBTimeout, and lease/3
	// for a renewal) to run: make sure it ran out while B was stopped.
	time.Sleep(time.Until(stoppedAt.Add(lease + 100*time.Millisecond)))
	from := len(strings.Split(b.text(), "\n"))
	b.signal(t, syscall.SIGCONT)
	_, i := b.waitFor(t, from, 30*time.Second, "relay stepped down")
	return b.line(i - 1)
}

// A leader frozen with a mark in flight (its context already running) past
// its lease, while a standby takes over, fails that mark on waking: its
// context ran out during the freeze. The step-down must name the lost lease,
// not a database that failed to record the batch for a whole lease (a single
// try, stalled by the freeze, is all that failed). Before the fix it said
// "the batch's outcome could not be recorded for 2s; stepping down: mark N
// rows published: timeout: context deadline exceeded", the message with
// which TestRelayTakeoverKilledAndFrozen failed under load.
//
//	go test ./runtime/kafka -run TestLeaderFrozenMidMarkStepsDownForItsLease -v -count=1
func TestLeaderFrozenMidMarkStepsDownForItsLease(t *testing.T) {
	t.Parallel()
	line := frozenLeaderWakes(t, "IDEM_STOP_BEFORE_MARK=1", "MARKING", 20)
	t.Logf("B on waking: %s", line)
	if !strings.Contains(line, "relay lease lost") {
		t.Fatalf("the leader frozen mid-mark stepped down without naming its lost lease: %s", line)
	}
}

// A leader frozen in the middle of a lease renewal (inside its transaction,
// past the lease: the server ends the session, a standby takes over) fails
// that renewal on waking. The step-down must name the lost lease, not only
// the renewal's spent context. B polls once a minute, so it hears of the
// failed renewal from the renewer alone, not from its own lease check: it
// does not LISTEN either (a NOTIFY reaches every schema of the database, and
// the tests running alongside enqueue events).
//
//	go test ./runtime/kafka -run TestLeaderFrozenMidRenewalStepsDownForItsLease -v -count=1
func TestLeaderFrozenMidRenewalStepsDownForItsLease(t *testing.T) {
	t.Parallel()
	line := frozenLeaderWakes(t, "IDEM_STOP_IN_RENEWAL=1", "RENEWING", 0, "IDEM_POLL=1m", "IDEM_NO_NOTIFY=1")
	t.Logf("B on waking: %s", line)
	if !strings.Contains(line, "relay lease lost") {
		t.Fatalf("the leader frozen mid-renewal stepped down without naming its lost lease: %s", line)
	}
}
