package kafka_test

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// consumerChild runs a consumer of "orders" on IDEM_DB_URL and IDEM_BROKERS
// (group "crash", MaxPollRecords 10, BatchSize IDEM_BATCH or 1) until
// SIGTERM. Every record's transaction holds for a few milliseconds
// (pg_sleep) so that a SIGKILL lands mid-transaction; the record
// IDEM_STUCK, the first time, waits for its context (its partition stuck,
// paused behind a backlog) after printing "STUCK <id>".
func consumerChild() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("IDEM_DB_URL"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "pool:", err)
		return 2
	}
	defer pool.Close()
	stuckID := os.Getenv("IDEM_STUCK")
	var once sync.Once
	handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
		if ev.EventID == stuckID {
			stuck := false
			once.Do(func() { stuck = true })
			if stuck {
				fmt.Println("STUCK", ev.EventID)
				<-ctx.Done()
				return ctx.Err()
			}
		}
		if _, err := tx.Exec(ctx, `SELECT pg_sleep(0.003)`); err != nil {
			return err
		}
		return applyOrder(ctx, tx, ev)
	}
	batch := 1
	if os.Getenv("IDEM_BATCH") != "" {
		fmt.Sscan(os.Getenv("IDEM_BATCH"), &batch)
	}
	c, err := kafka.NewConsumer(idem.NewStore(pool), kafka.ConsumerConfig{
		Brokers: strings.Split(os.Getenv("IDEM_BROKERS"), ","), Group: "crash",
		MaxPollRecords: 10, BatchSize: batch, CommitInterval: 100 * time.Millisecond,
		Handlers: []idem.EventHandler{orderConsumer("orders", handler)},
		Logger:   slog.New(slog.NewTextHandler(os.Stderr, nil)),
		// A killed member's partitions wait for its session to expire.
		ClientOpts: []kgo.Opt{kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
			kgo.SessionTimeout(6 * time.Second), kgo.HeartbeatInterval(500 * time.Millisecond)},
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "consumer:", err)
		return 2
	}
	fmt.Println("RUNNING")
	if err := c.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "run:", err)
		return 1
	}
	return 0
}

// A real consumer process is SIGKILLed three times while one partition is
// stuck (paused behind a backlog) and the others are applying records (each
// transaction open for a few milliseconds), with records arriving all the
// while; a fourth process finishes. Every record is applied exactly once, in
// order per partition, and the committed offsets are the log ends. With
// BatchSize 1 and 4.
func TestAttackPWCrashWhilePaused(t *testing.T) {
	for _, batch := range []int{1, 4} {
		t.Run(fmt.Sprint("batch", batch), func(t *testing.T) {
			t.Parallel()
			testCrashWhilePaused(t, batch)
		})
	}
}

func testCrashWhilePaused(t *testing.T, batch int) {
	const parts, per = 4, 200
	addrs := cluster(t, parts, "orders")
	url, direct := effectsSchema(t)
	cl := manualProducer(t, addrs)
	for p := range int32(parts) {
		produceTopic(t, cl, "orders", p, fmt.Sprintf("z%d", p), 0, per/2)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() {
		for i := per / 2; i < per; i += 10 {
			for p := range int32(parts) {
				produceTopicBG(t, cl, "orders", p, fmt.Sprintf("z%d", p), i, 10)
			}
		}
	})
	applied := func() int64 { return count(t, direct, `SELECT count(*) FROM effects`) }
	env := []string{"IDEM_CONSUMER_CHILD=1", "IDEM_BATCH=" + fmt.Sprint(batch)}
	// Round r gets stuck on z<r>-15, z<r>-90, z<r>-130 (r = 0, 1, 2), or
	// on a record not applied yet: a loaded machine lets a round run its
	// other partitions ahead, and with z2-130 applied already the next
	// process was never handed it (done, skipped), never printed STUCK,
	// and the test failed waiting for it. Then the record 10 past the
	// partition's applied ones (more than a killed process's transactions
	// still in the server's hands could commit), on that partition or, if
	// none is left there, on the least applied partition not stuck yet.
	wasStuck := map[int32]bool{}
	nextStuck := func(round int) string {
		target := []int64{15, 90, 130}[round]
		candidates := []int32{int32(round)}
		rest := []int32{}
		for q := range int32(parts) {
			if q != int32(round) {
				rest = append(rest, q)
			}
		}
		n := map[int32]int64{}
		for q := range int32(parts) {
			n[q] = appliedCount(t, direct, fmt.Sprintf("z%d", q))
		}
		slices.SortFunc(rest, func(a, b int32) int { return cmp.Compare(n[a], n[b]) })
		for _, q := range append(candidates, rest...) {
			if off := max(target, n[q]+10); !wasStuck[q] && off < per {
				wasStuck[q] = true
				return fmt.Sprintf("z%d-%d", q, off)
			}
		}
		t.Fatalf("round %d: applied %v of %d per partition: no record left to get stuck on", round, n, per)
		return ""
	}
	for round := range 3 {
		stuck := nextStuck(round)
		p := startRelayProc(t, fmt.Sprintf("consumer%d", round), url, addrs, time.Second, append(env, "IDEM_STUCK="+stuck)...)
		p.waitFor(t, 0, 45*time.Second, "STUCK", stuck)
		before := applied()
		waitBounded(t, 30*time.Second, fmt.Sprintf("round %d: other partitions applying after %s got stuck", round, stuck), func() bool {
			return applied() >= before+20
		})
		if err := p.cmd.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		t.Logf("round %d: killed with %d applied (per partition %d %d %d %d), stuck on %s", round, applied(),
			appliedCount(t, direct, "z0"), appliedCount(t, direct, "z1"), appliedCount(t, direct, "z2"), appliedCount(t, direct, "z3"), stuck)
	}
	wg.Wait()
	p := startRelayProc(t, "final", url, addrs, time.Second, env...)
	want := map[int32]int64{}
	for q := range int32(parts) {
		want[q] = per
	}
	waitCommitted(t, addrs, "crash", parts, want, "every record committed after the crashes", nil)
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	for q := range int32(parts) {
		wantAppliedInOrder(t, direct, fmt.Sprintf("z%d", q), per)
	}
	if n := count(t, direct, `SELECT count(*) FROM idem_processed_events`); n != parts*per {
		t.Fatalf("%d processed-event rows, want %d", n, parts*per)
	}
}

// A real consumer process is frozen (SIGSTOP) while one partition is stuck
// and paused and the others are mid-transaction; its session expires and a
// second process takes every partition over (blocked at first on the
// frozen one's open transactions); then the first is continued (SIGCONT):
// it goes on for a moment not knowing it lost its partitions, then learns
// it (onLost). Both run on until every record is committed: each applied
// exactly once, in order per partition.
func TestAttackPWFrozenMemberLosesPartitionsWhilePaused(t *testing.T) {
	t.Parallel()
	const parts, per = 4, 150
	addrs := cluster(t, parts, "orders")
	url, direct := effectsSchema(t)
	cl := manualProducer(t, addrs)
	for p := range int32(parts) {
		produceTopic(t, cl, "orders", p, fmt.Sprintf("f%d", p), 0, per)
	}
	applied := func() int64 { return count(t, direct, `SELECT count(*) FROM effects`) }
	env := []string{"IDEM_CONSUMER_CHILD=1"}
	a := startRelayProc(t, "A", url, addrs, time.Second, append(env, "IDEM_STUCK=f0-10")...)
	a.waitFor(t, 0, 45*time.Second, "STUCK", "f0-10")
	before := applied()
	waitBounded(t, 30*time.Second, "A applying the other partitions", func() bool { return applied() >= before+15 })
	if err := a.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	frozenAt := applied()
	b := startRelayProc(t, "B", url, addrs, time.Second, env...)
	b.waitFor(t, 0, 45*time.Second, "partitions assigned", "orders:[0 1 2 3]")
	t.Logf("A frozen with %d applied; B has every partition", frozenAt)
	if err := a.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	want := map[int32]int64{}
	for q := range int32(parts) {
		want[q] = per
	}
	waitCommitted(t, addrs, "crash", parts, want, "every record committed", nil)
	a.waitFor(t, 0, 30*time.Second, "partitions lost")
	_ = a.cmd.Process.Signal(syscall.SIGTERM)
	_ = b.cmd.Process.Signal(syscall.SIGTERM)
	for q := range int32(parts) {
		wantAppliedInOrder(t, direct, fmt.Sprintf("f%d", q), per)
	}
	if n := count(t, direct, `SELECT count(*) FROM idem_processed_events`); n != parts*per {
		t.Fatalf("%d processed-event rows, want %d", n, parts*per)
	}
}

// effectsSchema is a schema of its own, migrated, with the effects table:
// its URL (for child processes) and a pool on it.
func effectsSchema(t *testing.T) (string, *pgxpool.Pool) {
	t.Helper()
	url := pgtest.Schema(t)
	direct := pgtest.PoolURL(t, url, nil)
	if err := idem.Migrate(context.Background(), direct); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, direct, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
	return url, direct
}
