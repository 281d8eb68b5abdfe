package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// TestCrashMatrix is the statistical crash test: every named crash point in
// the module's source (crash.Point calls, found by parsing it, so a point
// added later fails this test until a row covers it) × N SIGKILL trials
// (IDEM_MATRIX_TRIALS, default 20), plus SIGSTOP of the relay leader and of
// a consumer. Each trial drives a little traffic, lets the point fire on a
// random hit (IDEM_CRASH_HIT=k: the k-th request, record or batch), restarts
// or thaws, lets retries and redelivery finish, then counts every effect:
// our charges, the provider's charges, the outbox events, the receipts.
// Each must exist exactly once; the table prints the duplicates and the
// lost ones per row, and the test fails unless all are zero.
func TestCrashMatrix(t *testing.T) {
	trials := matrixTrials(t)
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("IDEM_MATRIX_SEED"); s != "" {
		var err error
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			t.Fatalf("IDEM_MATRIX_SEED: %v", err)
		}
	}
	t.Logf("IDEM_MATRIX_SEED=%d IDEM_MATRIX_TRIALS=%d", seed, trials)

	type row struct {
		name  string
		point string // the crash point the row fires
		kafka bool
		trial func(t *testing.T, m *matrixEnv, trial int, rng *rand.Rand, extra any) trialResult
		setup func(t *testing.T, m *matrixEnv) any
	}
	httpRow := func(point string) row {
		return row{name: point + " (http)", point: point, trial: func(t *testing.T, m *matrixEnv, i int, rng *rand.Rand, _ any) trialResult {
			return httpTrial(t, m, point, i, rng)
		}}
	}
	consumeRow := func(point string) row {
		return row{name: point + " (consume)", point: point, kafka: true, trial: func(t *testing.T, m *matrixEnv, i int, rng *rand.Rand, _ any) trialResult {
			return consumeKillTrial(t, m, point, i, rng)
		}}
	}
	rows := []row{
		httpRow("http.after-claim"),
		httpRow("http.after-call"),
		httpRow("http.before-commit"),
		httpRow("http.after-commit"),
		httpRow("charge.after-provider-call"),
		{name: "provider.after-apply (http)", point: "provider.after-apply", trial: providerTrial,
			setup: func(*testing.T, *matrixEnv) any { return new(string) }},
		consumeRow("consume.after-call"),
		consumeRow("consume.after-commit"),
		consumeRow("charge.after-provider-call"),
		{name: "relay.after-publish (relay)", point: "relay.after-publish", kafka: true,
			setup: func(t *testing.T, m *matrixEnv) any { return startNotifier(t, m) },
			trial: func(t *testing.T, m *matrixEnv, i int, rng *rand.Rand, n any) trialResult {
				return relayTrial(t, m, i, rng, n.(*notifier), false)
			}},
		{name: "SIGSTOP relay leader @relay.after-publish", kafka: true,
			setup: func(t *testing.T, m *matrixEnv) any { return startNotifier(t, m) },
			trial: func(t *testing.T, m *matrixEnv, i int, rng *rand.Rand, n any) trialResult {
				return relayTrial(t, m, i, rng, n.(*notifier), true)
			}},
		{name: "relay.lease-before-commit (relay)", point: "relay.lease-before-commit", kafka: true,
			setup: func(t *testing.T, m *matrixEnv) any { return startNotifier(t, m) },
			trial: func(t *testing.T, m *matrixEnv, i int, rng *rand.Rand, n any) trialResult {
				return leaseTrial(t, m, i, rng, n.(*notifier), false)
			}},
		{name: "SIGSTOP relay leader @relay.lease-before-commit", kafka: true,
			setup: func(t *testing.T, m *matrixEnv) any { return startNotifier(t, m) },
			trial: func(t *testing.T, m *matrixEnv, i int, rng *rand.Rand, n any) trialResult {
				return leaseTrial(t, m, i, rng, n.(*notifier), true)
			}},
		{name: "SIGSTOP consumer @consume.after-call", kafka: true, trial: func(t *testing.T, m *matrixEnv, i int, rng *rand.Rand, _ any) trialResult {
			return consumeStopTrial(t, m, i, rng)
		}},
	}

	// Every crash point in the source has a SIGKILL row, and every row's
	// point still exists.
	inSource := crashPointsInSource(t)
	covered := map[string]bool{}
	for _, r := range rows {
		if r.point != "" {
			covered[r.point] = true
			if inSource[r.point] == nil {
				t.Errorf("row %q fires %q, which no crash.Point in the source names", r.name, r.point)
			}
		}
	}
	var names []string
	for name, where := range inSource {
		names = append(names, name)
		if !covered[name] {
			t.Errorf("crash point %q (%v) has no row in TestCrashMatrix: add one that drives traffic through it", name, where)
		}
	}
	sort.Strings(names)
	t.Logf("crash points in the source: %v", names)
	if t.Failed() {
		return
	}
	buildCrashBinary(t)

	var mu sync.Mutex
	results := make([]*rowResult, len(rows))
	start := time.Now()
	// Rows run side by side, IDEM_MATRIX_PARALLEL at a time (default 4),
	// whatever -parallel says: a trial mostly waits (for a session timeout,
	// a lease, a restart), so the rows overlap without competing for CPU.
	// Kafka rows, the longest, start first.
	par := 4
	if s := os.Getenv("IDEM_MATRIX_PARALLEL"); s != "" {
		if p, err := strconv.Atoi(s); err == nil && p > 0 {
			par = p
		}
	}
	order := make([]int, len(rows))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool { return rows[order[a]].kafka && !rows[order[b]].kafka })
	for ri, r := range rows {
		results[ri] = &rowResult{row: r.name}
	}
	t.Run("rows", func(t *testing.T) {
		sem := make(chan struct{}, par)
		var wg sync.WaitGroup
		for _, ri := range order {
			r, res := rows[ri], results[ri]
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				t.Run(r.name, func(t *testing.T) { // t.Run from several goroutines at once is allowed
					mu.Lock()
					res.ran = true
					mu.Unlock()
					rowStart := time.Now()
					defer func() { mu.Lock(); res.elapsed = time.Since(rowStart); mu.Unlock() }()
					m := newMatrixEnv(t, r.kafka)
					var extra any
					if r.setup != nil {
						extra = r.setup(t, m)
					}
					rng := rand.New(rand.NewPCG(seed, uint64(ri)))
					failedInARow := 0
					for i := range trials {
						if failedInARow == 3 {
							t.Errorf("3 trials in a row failed: the row's remaining %d trials are not run", trials-i)
							break
						}
						var tr trialResult
						ok := t.Run(fmt.Sprintf("trial-%02d", i), func(t *testing.T) {
							dead := m.deadOrParked(t)
							tr = r.trial(t, m, i, rng, extra)
							tr.dead = m.deadOrParked(t) - dead
							if tr.dup+tr.lost+tr.disorder+tr.dead > 0 {
								t.Errorf("%d duplicates, %d lost, %d keys out of order, %d dead-lettered or parked", tr.dup, tr.lost, tr.disorder, tr.dead)
							}
						})
						mu.Lock()
						res.add(tr)
						if !ok {
							res.failures++
							failedInARow++
						} else {
							failedInARow = 0
						}
						mu.Unlock()
					}
				})
			})
		}
		wg.Wait()
	})
	results = slices.DeleteFunc(results, func(r *rowResult) bool { return !r.ran }) // rows -run left out
	table := formatTable(results)
	fmt.Fprintf(os.Stdout, "\ncrash matrix (%d trials per row, seed %d, %v):\n%s\n", trials, seed, time.Since(start).Round(time.Second), table)
	t.Logf("crash matrix:\n%s", table)
	for _, r := range results {
		if r.dup+r.lost+r.disorder+r.dead+r.failures > 0 || r.trials < trials {
			t.Errorf("%s: %d/%d trials, %d duplicates, %d lost, %d out of order, %d dead/parked, %d failed trials; want all trials and zeros",
				r.row, r.trials, trials, r.dup, r.lost, r.disorder, r.dead, r.failures)
		}
	}
}

// httpTrial sends a few charges at once to a service that SIGKILLs itself
// the k-th time a request reaches point; then the clients retry with their
// keys against a restarted service until each has its receipt.
func httpTrial(t *testing.T, m *matrixEnv, point string, i int, rng *rand.Rand) trialResult {
	const n = 3
	k := 1 + rng.IntN(n)
	c := startChild(t, m.url, append(m.env, "IDEM_CRASH_AT="+point, "IDEM_CRASH_HIT="+strconv.Itoa(k))...)
	orders, keys := make([]string, n), make([]string, n)
	for j := range n {
		orders[j], keys[j] = fmt.Sprintf("%s-%d-%d", point, i, j), fmt.Sprintf("key-%s-%d-%d", point, i, j)
	}
	receipts := make([]string, n)
	attempt := func(addr string, j int) bool {
		status, body, _, err := charge(addr, keys[j], orders[j])
		if err == nil && status == http.StatusCreated {
			receipts[j] = body
			return true
		}
		return false
	}
	var wg sync.WaitGroup
	for j := range n {
		wg.Go(func() { attempt(c.addr, j) })
	}
	wg.Wait()
	return finishHTTPTrial(t, m, c, point, k, orders, keys, receipts, func() string {
		return startChild(t, m.url, m.env...).addr
	})
}

// finishHTTPTrial waits for the kill, restarts, retries every request
// until it has a receipt (acknowledged ones too: the retry must replay
// the same receipt), and scores each order's effects.
func finishHTTPTrial(t *testing.T, m *matrixEnv, killed *child, point string, k int, orders, keys, receipts []string, restart func() string) trialResult {
	var tr trialResult
	select {
	case <-killed.exited:
	case <-time.After(10 * time.Second):
		t.Errorf("%s never fired on hit %d: the process is still running", point, k)
		killed.stop(t)
		return tr
	}
	if !killed.killedBySIGKILL() {
		t.Errorf("process ended %v, want SIGKILL at %s:\n%s", killed.cmd.ProcessState, point, killed.log())
	}
	killedAt := time.Now()
	addr := restart()
	for j := range orders {
		var status int
		var body string
		var err error
		ok := waitFor(20*time.Second, func() bool {
			status, body, _, err = charge(addr, keys[j], orders[j])
			return err == nil && status == http.StatusCreated
		})
		switch {
		case !ok:
			t.Errorf("%s: no receipt after the restart: %d %s %v", orders[j], status, body, err)
			tr.lost++
		case receipts[j] != "" && body != receipts[j]:
			t.Errorf("%s: acknowledged %s, the retry answered %s", orders[j], receipts[j], body)
			tr.dup++
		}
	}
	tr.recovery = time.Since(killedAt)
	for _, o := range orders {
		ours, prov, outbox := m.effects(t, o)
		score(&tr, ours, prov, outbox)
	}
	return tr
}

// providerTrial runs the payment provider as a child that SIGKILLs itself
// the k-th time it has applied a charge and not answered yet; the provider
// comes back on the same address and the clients retry until each has its
// receipt.
func providerTrial(t *testing.T, m *matrixEnv, i int, rng *rand.Rand, extra any) trialResult {
	const n = 3
	k := 1 + rng.IntN(n)
	addr := extra.(*string) // the provider's address, kept across trials
	listen := "127.0.0.1:0"
	if *addr != "" {
		listen = *addr
	}
	penv := []string{"DATABASE_URL=" + m.url, "PROVIDER_ADDR=" + listen}
	prov := startProcess(t, "provider", providerListening, append(penv, "IDEM_CRASH_AT=provider.after-apply", "IDEM_CRASH_HIT="+strconv.Itoa(k))...)
	*addr = prov.addr
	penv[1] = "PROVIDER_ADDR=" + prov.addr
	svc := startChild(t, m.url, append(m.env, "PROVIDER_URL=http://"+prov.addr)...)
	defer svc.stop(t)
	orders, keys := make([]string, n), make([]string, n)
	for j := range n {
		orders[j], keys[j] = fmt.Sprintf("provider-%d-%d", i, j), fmt.Sprintf("key-provider-%d-%d", i, j)
	}
	receipts := make([]string, n)
	var wg sync.WaitGroup
	for j := range n {
		wg.Go(func() {
			if status, body, _, err := charge(svc.addr, keys[j], orders[j]); err == nil && status == http.StatusCreated {
				receipts[j] = body
			}
		})
	}
	wg.Wait()
	var prov2 *child
	tr := finishHTTPTrial(t, m, prov, "provider.after-apply", k, orders, keys, receipts, func() string {
		prov2 = startProcess(t, "provider", providerListening, penv...)
		return svc.addr
	})
	if prov2 != nil {
		prov2.stop(t)
	}
	return tr
}

// consumeKillTrial produces orders one at a time to a consumer that
// SIGKILLs itself the k-th time it reaches point, restarts it, and waits
// until the restarted consumer has processed the last record.
func consumeKillTrial(t *testing.T, m *matrixEnv, point string, i int, rng *rand.Rand) trialResult {
	const n = 4
	k := 1 + rng.IntN(n)
	var tr trialResult
	events := make([]OrderConfirmed, n)
	for j := range n {
		events[j] = OrderConfirmed{EventID: fmt.Sprintf("evt-%s-%d-%d", point, i, j), OrderID: fmt.Sprintf("%s-%d-%d", point, i, j), Total: 100, Currency: "EUR"}
	}
	c := startProcess(t, "consume", consuming, append(m.env, "IDEM_CRASH_AT="+point, "IDEM_CRASH_HIT="+strconv.Itoa(k))...)
	var last int64
	j := 0
	for ; j < n && !c.exitedNow(); j++ {
		last = m.produceOrder(t, events[j])
		order := events[j].OrderID
		if !waitFor(30*time.Second, func() bool { ours, _, _ := m.effects(t, order); return ours > 0 || c.exitedNow() }) {
			t.Errorf("%s: neither applied nor killed in 30s:\n%s", order, c.log())
			c.stop(t)
			return tr
		}
	}
	select {
	case <-c.exited:
	case <-time.After(10 * time.Second):
		t.Errorf("%s never fired on hit %d", point, k)
		c.stop(t)
		return tr
	}
	if !c.killedBySIGKILL() {
		t.Errorf("consumer ended %v, want SIGKILL at %s:\n%s", c.cmd.ProcessState, point, c.log())
	}
	killedAt := time.Now()
	c2 := startProcess(t, "consume", consuming, m.env...)
	for ; j < n; j++ {
		last = m.produceOrder(t, events[j])
	}
	done := regexp.MustCompile(fmt.Sprintf(`record done context=billing topic=orders.confirmed partition=0 offset=%d `, last))
	if !waitFor(30*time.Second, func() bool { return done.MatchString(c2.log()) }) {
		t.Errorf("the restarted consumer never finished offset %d:\n%s", last, c2.log())
	}
	tr.recovery = time.Since(killedAt)
	c2.stop(t)
	for _, ev := range events {
		ours, prov, outbox := m.effects(t, ev.OrderID)
		score(&tr, ours, prov, outbox)
	}
	return tr
}

// consumeStopTrial runs two members of the consumer group, streams orders
// and freezes (SIGSTOP) the member that owns orders.confirmed right after
// the k-th record was produced, so it stops at a random moment: maybe
// mid-transaction holding row locks, maybe between polls with offsets not
// yet committed. The other member must take the partition over once the
// frozen one's session times out (observed: it processes orders.confirmed,
// or it waits on the frozen member's locks); then the frozen one is thawed
// and goes on late. Each order must be applied exactly once.
func consumeStopTrial(t *testing.T, m *matrixEnv, i int, rng *rand.Rand) trialResult {
	const n = 6
	k := 1 + rng.IntN(n-1)
	var tr trialResult
	events := make([]OrderConfirmed, n)
	for j := range n {
		events[j] = OrderConfirmed{EventID: fmt.Sprintf("evt-stop-%d-%d", i, j), OrderID: fmt.Sprintf("stop-%d-%d", i, j), Total: 100, Currency: "EUR"}
	}
	// Both members start (and migrate) before anyone freezes: a process
	// frozen mid-transaction would hold up a later one's migration.
	apps := []string{fmt.Sprintf("matrix_c1_%d", i), fmt.Sprintf("matrix_c2_%d", i)}
	var cs []*child
	for _, app := range apps {
		c := startProcess(t, "consume", consuming, append(m.env, "DATABASE_URL="+withAppName(m.url, app))...)
		defer func() { _ = c.cmd.Process.Signal(syscall.SIGCONT); c.stop(t) }()
		cs = append(cs, c)
	}
	if !waitFor(20*time.Second, func() bool { return m.groupMembers("payments") == 2 }) {
		t.Fatalf("the two consumers never formed a stable group of 2")
	}
	doneAt := func(off int64) *regexp.Regexp {
		return regexp.MustCompile(fmt.Sprintf(`record done context=billing topic=orders.confirmed partition=0 offset=%d `, off))
	}
	owner := -1
	var last int64
	for j := range k {
		last = m.produceOrder(t, events[j])
		re := doneAt(last)
		if !waitFor(30*time.Second, func() bool { return re.MatchString(cs[0].log()) || re.MatchString(cs[1].log()) }) {
			t.Fatalf("%s never processed:\nc1:\n%s\nc2:\n%s", events[j].OrderID, cs[0].log(), cs[1].log())
		}
		if re.MatchString(cs[0].log()) {
			owner = 0
		} else {
			owner = 1
		}
	}
	frozen, other := cs[owner], cs[1-owner]
	last = m.produceOrder(t, events[k])
	time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond) // land anywhere in the record's processing
	_ = frozen.cmd.Process.Signal(syscall.SIGSTOP)
	stoppedAt := time.Now()
	mark := other.logLen()
	for j := k + 1; j < n; j++ {
		last = m.produceOrder(t, events[j])
	}
	// The partition moved: the other member processes orders.confirmed, or
	// waits on the frozen member's row locks.
	took := regexp.MustCompile(`topic=orders.confirmed`)
	blocked := func() bool {
		return pgtest.Count(t, m.pool, `SELECT count(*) FROM pg_stat_activity a WHERE a.application_name = $1
			AND EXISTS (SELECT 1 FROM pg_stat_activity b WHERE b.application_name = $2 AND b.pid = ANY(pg_blocking_pids(a.pid)))`,
			apps[1-owner], apps[owner]) > 0
	}
	if !waitFor(20*time.Second, func() bool { return took.MatchString(other.logSince(mark)) || blocked() }) {
		t.Errorf("the other member never took orders.confirmed over from the frozen one:\n%s", other.log())
	}
	_ = frozen.cmd.Process.Signal(syscall.SIGCONT)
	done := doneAt(last)
	if !waitFor(30*time.Second, func() bool { return done.MatchString(frozen.log()) || done.MatchString(other.log()) }) {
		t.Errorf("nobody finished offset %d after the thaw:\nfrozen:\n%s\nother:\n%s", last, frozen.log(), other.log())
	}
	tr.recovery = time.Since(stoppedAt)
	for _, ev := range events {
		ours, prov, outbox := m.effects(t, ev.OrderID)
		score(&tr, ours, prov, outbox)
	}
	return tr
}

// relayTrial enqueues payment events one at a time (two keys, so per-key
// order means something) to a relay that SIGKILLs itself (or, with stop,
// SIGSTOPs itself) after its k-th publish and before marking it. A second
// relay finishes the outbox: restarted after the kill, or a standby taking
// over once the frozen leader's lease expires, after which the frozen one is
// thawed and its late mark must be refused. The row's notifications
// consumer counts the receipts and checks the order of first deliveries.
func relayTrial(t *testing.T, m *matrixEnv, i int, rng *rand.Rand, notif *notifier, stop bool) trialResult {
	const n = 4
	k := 1 + rng.IntN(n)
	var tr trialResult
	ids := make([]int64, n)
	attempt := 0
	enqueue := func(j int) {
		ctx := context.Background()
		tx, err := m.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		key := fmt.Sprintf("relay-%d-%d-%c", i, attempt, 'a'+j%2)
		if err := EnqueuePaymentCharged(ctx, tx, PaymentCharged{ChargeID: ids[j], OrderID: key, Amount: 100, Currency: "EUR"}); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	published := func(want int64) func() bool {
		return func() bool {
			return pgtest.Count(t, m.pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PUBLISHED'`) == want
		}
	}
	mode := "IDEM_CRASH_AT=relay.after-publish"
	if stop {
		mode = "IDEM_STOP_AT=relay.after-publish"
	}
	var (
		before  int64
		r1      *child
		standby *child
		j       int
	)
	fired := func() bool {
		if stop {
			return r1.stoppedNow()
		}
		return r1.exitedNow()
	}
	// The trial needs the first relay to lead until its k-th publish. With
	// a lease of 1s its lease statements are bounded by 333ms, and on a
	// loaded machine one can time out: the leader then steps down (as it
	// must: it cannot know whether its renewal committed) and, with a
	// standby running, the standby leads and publishes the rest. That
	// attempt tests nothing; it is run again (at most twice) with fresh
	// events, and the crash point must then fire.
	const attempts = 3
	lostLease := regexp.MustCompile(`relay stepped down|another relay holds the lease`)
	for ; ; attempt++ {
		for j := range n {
			ids[j] = int64(i*100 + attempt*10 + j + 1)
		}
		before = pgtest.Count(t, m.pool, `SELECT count(*) FROM idem_outbox`)
		r1 = startProcess(t, "relay", leading, append(m.env, mode, "IDEM_CRASH_HIT="+strconv.Itoa(k))...)
		if stop {
			standby = startUnready(t, "relay", m.env...)
		}
		for j = 0; j < n && !fired(); j++ {
			enqueue(j)
			want := before + int64(j) + 1
			if !waitFor(30*time.Second, func() bool { return published(want)() || fired() }) {
				t.Errorf("event %d: neither published nor stopped in 30s:\n%s", j, r1.log())
				return tr
			}
		}
		if waitFor(10*time.Second, fired) {
			break
		}
		if stop && attempt+1 < attempts && lostLease.MatchString(r1.log()) {
			t.Logf("attempt %d: the first relay lost its lease before its publish %d fired; again with new events:\n%s", attempt, k, r1.log())
			r1.stop(t)
			standby.stop(t)
			continue
		}
		t.Errorf("relay.after-publish never fired on hit %d:\n%s", k, r1.log())
		r1.stop(t)
		if standby != nil {
			standby.stop(t)
		}
		return tr
	}
	firedAt := time.Now()
	// The k-th batch (event k-1 alone) was produced and never marked: the
	// process died or froze between the two, not after.
	if got, want := pgtest.Count(t, m.pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PUBLISHED'`), before+int64(k)-1; got != want {
		t.Errorf("when relay.after-publish fired on hit %d: %d rows PUBLISHED, want %d (the k-th batch unmarked)", k, got-before, want-before)
	}
	var r2 *child
	if stop {
		r2 = standby
	} else {
		if !r1.killedBySIGKILL() {
			t.Errorf("relay ended %v, want SIGKILL at relay.after-publish:\n%s", r1.cmd.ProcessState, r1.log())
		}
		r2 = startUnready(t, "relay", m.env...)
	}
	for ; j < n; j++ {
		enqueue(j)
	}
	// The other relay leads and has published everything, the row the
	// fired relay published but never marked included. Bounded by the
	// lease (1s) many times over.
	if !waitFor(15*time.Second, published(before+n)) {
		t.Errorf("not every event was published 15s after the %s (lease 1s): %d of %d published:\nfired relay:\n%s\nother relay:\n%s",
			map[bool]string{false: "kill", true: "freeze"}[stop],
			pgtest.Count(t, m.pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PUBLISHED'`)-before, n, r1.log(), r2.log())
	}
	tr.recovery = time.Since(firedAt)
	if stop {
		// Thaw the old leader: it goes on from the crash point to mark rows
		// another leader has claimed since. The mark must be refused.
		mark := r1.logLen()
		_ = r1.cmd.Process.Signal(syscall.SIGCONT)
		refused := regexp.MustCompile(`(?i)lease lost|stepped down`)
		if !waitFor(10*time.Second, func() bool { return refused.MatchString(r1.logSince(mark)) }) {
			t.Errorf("the thawed leader never reported its late mark refused; its log (thawed at line %d):\n%s\nthe other relay:\n%s", mark, r1.log(), r2.log())
		}
		if got := pgtest.Count(t, m.pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PUBLISHED'`); got != before+n {
			t.Errorf("after the thaw: %d rows PUBLISHED, want %d", got, before+n)
		}
		r1.stop(t)
	}
	r2.stop(t)
	// A sentinel behind every copy the relays produced: once the consumer
	// has processed it, it has processed them all.
	sentinel := fmt.Sprintf("sentinel-%d", i)
	v, _ := json.Marshal(PaymentCharged{ChargeID: -int64(i + 1), OrderID: "sentinel", Amount: 1, Currency: "EUR"})
	m.produce(t, &kgo.Record{Topic: "billing.charged", Key: []byte("sentinel"), Value: v,
		Headers: []kgo.RecordHeader{{Key: idem.EventIDHeader, Value: []byte(sentinel)}}})
	if !waitFor(30*time.Second, func() bool { return notif.sawEvent(sentinel) }) {
		t.Errorf("the notifications consumer never reached the sentinel")
	}
	disorder, missing := notif.check(ids)
	tr.disorder = disorder
	if len(missing) > 0 {
		t.Errorf("events never delivered: %v", missing)
	}
	for _, id := range ids {
		score(&tr, pgtest.Count(t, m.pool, `SELECT count(*) FROM notifications WHERE charge_id = $1`, id))
	}
	return tr
}

// leaseTrial kills (or freezes) a relay inside its k-th lease transaction
// (the acquisition or a renewal, every lease/3), after the statement and
// before the commit: frozen there it holds the lease row's lock. A second
// relay must take over within a few leases and publish everything enqueued;
// a thawed first relay must step down.
func leaseTrial(t *testing.T, m *matrixEnv, i int, rng *rand.Rand, notif *notifier, stop bool) trialResult {
	const n = 4
	k := 1 + rng.IntN(4)
	var tr trialResult
	mode := "IDEM_CRASH_AT=relay.lease-before-commit"
	if stop {
		mode = "IDEM_STOP_AT=relay.lease-before-commit"
	}
	r1 := startUnready(t, "relay", append(m.env, mode, "IDEM_CRASH_HIT="+strconv.Itoa(k))...)
	fired := func() bool {
		if stop {
			return r1.stoppedNow()
		}
		return r1.exitedNow()
	}
	if !waitFor(30*time.Second, func() bool { return leading.MatchString(r1.log()) || fired() }) {
		t.Fatalf("the first relay neither led nor fired:\n%s", r1.log())
	}
	r2 := startUnready(t, "relay", m.env...)
	if !waitFor(30*time.Second, fired) {
		t.Fatalf("relay.lease-before-commit never fired on hit %d:\n%s", k, r1.log())
	}
	firedAt := time.Now()
	if !stop && !r1.killedBySIGKILL() {
		t.Errorf("relay ended %v, want SIGKILL at relay.lease-before-commit:\n%s", r1.cmd.ProcessState, r1.log())
	}
	before := pgtest.Count(t, m.pool, `SELECT count(*) FROM idem_outbox`)
	ids := make([]int64, n)
	ctx := context.Background()
	for j := range n {
		ids[j] = int64(i*100 + j + 1)
		tx, err := m.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		key := fmt.Sprintf("lease-%d-%c", i, 'a'+j%2)
		if err := EnqueuePaymentCharged(ctx, tx, PaymentCharged{ChargeID: ids[j], OrderID: key, Amount: 100, Currency: "EUR"}); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if !waitFor(15*time.Second, func() bool {
		return pgtest.Count(t, m.pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PUBLISHED'`) == before+n
	}) {
		t.Errorf("not every event was published 15s after the %s (lease 1s):\nfired relay:\n%s\nother relay:\n%s",
			map[bool]string{false: "kill", true: "freeze"}[stop], r1.log(), r2.log())
	}
	tr.recovery = time.Since(firedAt)
	if stop {
		mark := r1.logLen()
		_ = r1.cmd.Process.Signal(syscall.SIGCONT)
		if !waitFor(10*time.Second, func() bool { return regexp.MustCompile(`stepped down|standing by`).MatchString(r1.logSince(mark)) }) {
			t.Errorf("the thawed relay never stepped down:\n%s", r1.log())
		}
		r1.stop(t)
	}
	r2.stop(t)
	sentinel := fmt.Sprintf("lease-sentinel-%d", i)
	v, _ := json.Marshal(PaymentCharged{ChargeID: -int64(i + 1), OrderID: "sentinel", Amount: 1, Currency: "EUR"})
	m.produce(t, &kgo.Record{Topic: "billing.charged", Key: []byte("sentinel"), Value: v,
		Headers: []kgo.RecordHeader{{Key: idem.EventIDHeader, Value: []byte(sentinel)}}})
	if !waitFor(30*time.Second, func() bool { return notif.sawEvent(sentinel) }) {
		t.Errorf("the notifications consumer never reached the sentinel")
	}
	disorder, missing := notif.check(ids)
	tr.disorder = disorder
	if len(missing) > 0 {
		t.Errorf("events never delivered: %v", missing)
	}
	for _, id := range ids {
		score(&tr, pgtest.Count(t, m.pool, `SELECT count(*) FROM notifications WHERE charge_id = $1`, id))
	}
	return tr
}
