package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemgen/idemgen/examples/payments/provider"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// crashPointsInSource parses every non-test Go file of the module and
// returns the names passed to crash.Point, with where each is. A call whose
// name is not a string literal is an error: the matrix could not know it.
func crashPointsInSource(t *testing.T) map[string][]string {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "internal", "crash")); err != nil {
		t.Fatalf("module root not found at %s: %v", root, err)
	}
	points := map[string][]string{}
	fset := token.NewFileSet()
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if name := d.Name(); path != root && (strings.HasPrefix(name, ".") || name == "testdata" || name == "vendor") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok || sel.Sel.Name != "Point" {
				return true
			}
			if pkg, ok := sel.X.(*ast.Ident); !ok || pkg.Name != "crash" || len(call.Args) != 2 {
				return true
			}
			where := fset.Position(call.Pos()).String()
			lit, ok := call.Args[1].(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING {
				t.Errorf("%s: crash.Point with a name that is not a string literal; the matrix cannot cover it", where)
				return true
			}
			name, _ := strconv.Unquote(lit.Value)
			rel, _ := filepath.Rel(root, where)
			points[name] = append(points[name], rel)
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return points
}

// matrixTrials is how many trials each row runs: IDEM_MATRIX_TRIALS, else
// 20 (3 with -short).
func matrixTrials(t *testing.T) int {
	if s := os.Getenv("IDEM_MATRIX_TRIALS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("IDEM_MATRIX_TRIALS=%q: want a positive integer", s)
		}
		return n
	}
	if testing.Short() {
		return 3
	}
	return 20
}

// trialResult is what one trial found. dup counts effects applied more than
// once, lost the events or acknowledged requests never applied, disorder the
// keys whose first deliveries came out of enqueue order, dead the valid
// records dead-lettered or outbox rows parked (the matrix sends nothing
// invalid, so a redelivery that fails instead of being skipped shows here,
// even where a unique constraint kept the second effect out).
type trialResult struct {
	dup, lost, disorder, dead int
	recovery                  time.Duration // from the kill (or freeze) to every effect applied
}

// rowResult sums a row's trials.
type rowResult struct {
	row       string
	ran       bool
	trials    int
	dup, lost int
	disorder  int
	dead      int
	failures  int // trials that reported a test error (see the log)
	recovery  []time.Duration
	elapsed   time.Duration
}

func (r *rowResult) add(tr trialResult) {
	r.trials++
	r.dup += tr.dup
	r.lost += tr.lost
	r.disorder += tr.disorder
	r.dead += tr.dead
	if tr.recovery > 0 {
		r.recovery = append(r.recovery, tr.recovery)
	}
}

func (r *rowResult) median() time.Duration {
	if len(r.recovery) == 0 {
		return 0
	}
	s := slices.Clone(r.recovery)
	slices.Sort(s)
	return s[len(s)/2].Round(time.Millisecond)
}

func formatTable(rows []*rowResult) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%-48s %6s %10s %5s %9s %12s %9s %9s %9s\n", "point", "trials", "duplicates", "lost", "disorder", "dead/parked", "failures", "median", "row time")
	for _, r := range rows {
		fmt.Fprintf(&b, "%-48s %6d %10d %5d %9d %12d %9d %9v %9v\n", r.row, r.trials, r.dup, r.lost, r.disorder, r.dead, r.failures,
			r.median(), r.elapsed.Round(100*time.Millisecond))
	}
	return b.String()
}

// exited reports whether the child has exited, without waiting.
func (c *child) exitedNow() bool {
	select {
	case <-c.exited:
		return true
	default:
		return false
	}
}

// stoppedNow reports whether the child is stopped (SIGSTOP): state T in
// /proc/<pid>/stat.
func (c *child) stoppedNow() bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", c.cmd.Process.Pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && i+2 < len(s) && (s[i+2] == 'T' || s[i+2] == 't')
}

// logLen and logSince let a test look only at lines written after a moment.
func (c *child) logLen() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.lines)
}

func (c *child) logSince(n int) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return strings.Join(c.lines[min(n, len(c.lines)):], "\n")
}

// startUnready runs `payments <subcmd>` without waiting for a ready line
// (a standby relay prints none).
func startUnready(t *testing.T, subcmd string, env ...string) *child {
	t.Helper()
	cmd := exec.Command(buildCrashBinary(t), subcmd)
	cmd.Env = append(os.Environ(), env...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{cmd: cmd, exited: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			c.mu.Lock()
			c.lines = append(c.lines, sc.Text())
			c.mu.Unlock()
		}
		_ = cmd.Wait()
		close(c.exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Kill()
		<-c.exited
	})
	return c
}

// waitFor polls cond every 20ms until it holds or d passes; it reports
// whether cond held.
func waitFor(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// withAppName tags a database URL so pg_stat_activity tells the processes apart.
func withAppName(url, name string) string {
	sep := "?"
	if strings.Contains(url, "?") {
		sep = "&"
	}
	return url + sep + "application_name=" + name
}

// migrateAll creates idemgen's, the service's and the provider's tables in
// pool's schema, without the process environment open() reads (the matrix
// rows run in parallel and may not Setenv).
func migrateAll(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if err := provider.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Conn().PgConn().Exec(ctx, schema).ReadAll(); err != nil {
		t.Fatal(err)
	}
}

// matrixEnv is one matrix row's world: a schema, a pool on it, the
// in-process provider, and (for Kafka rows) a kfake cluster that outlives
// every child, with a producer client.
type matrixEnv struct {
	url      string
	pool     *pgxpool.Pool
	provider *testProvider
	counter  *testProvider // reads the provider's tables, for a provider run as a child
	brokers  []string
	producer *kgo.Client
	env      []string // the children's environment
}

func newMatrixEnv(t *testing.T, withKafka bool) *matrixEnv {
	t.Helper()
	url := pgtest.Schema(t)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	migrateAll(t, pool)
	m := &matrixEnv{url: url, pool: pool, provider: providerFor(t, url), counter: &testProvider{Server: provider.New(pool, nil)}}
	m.env = []string{"DATABASE_URL=" + url, "PROVIDER_URL=" + m.provider.url}
	if withKafka {
		cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders.confirmed", "billing.charged"),
			kfake.GroupMinSessionTimeout(200*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cluster.Close)
		m.brokers = cluster.ListenAddrs()
		if m.producer, err = kgo.NewClient(kgo.SeedBrokers(m.brokers...)); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(m.producer.Close)
		m.env = append(m.env, "KAFKA_BROKERS="+strings.Join(m.brokers, ","), "KAFKA_SESSION_TIMEOUT=1s", "KAFKA_FETCH_MAX_WAIT=200ms", "RELAY_LEASE=1s", "LOG_LEVEL=debug")
	}
	return m
}

// produce writes a record and returns its offset.
func (m *matrixEnv) produce(t *testing.T, r *kgo.Record) int64 {
	t.Helper()
	res := m.producer.ProduceSync(context.Background(), r)
	if err := res.FirstErr(); err != nil {
		t.Fatal(err)
	}
	return res[0].Record.Offset
}

func (m *matrixEnv) produceOrder(t *testing.T, ev OrderConfirmed) int64 {
	v, _ := json.Marshal(ev)
	return m.produce(t, &kgo.Record{Topic: "orders.confirmed", Key: []byte(ev.OrderID), Value: v})
}

// effects counts, for one order, our charges, the provider's applied
// charges and the outbox events announcing a charge.
func (m *matrixEnv) effects(t *testing.T, order string) (ours, prov, outbox int64) {
	t.Helper()
	_, prov = m.counter.counts(t, order)
	return pgtest.Count(t, m.pool, `SELECT count(*) FROM charges WHERE order_id = $1`, order), prov,
		pgtest.Count(t, m.pool, `SELECT count(*) FROM idem_outbox WHERE record_key = $1`, []byte(order))
}

// score adds one order's effects to tr: each effect must exist exactly once.
func score(tr *trialResult, counts ...int64) {
	for _, n := range counts {
		if n == 0 {
			tr.lost++
		}
		if n > 1 {
			tr.dup += int(n - 1)
		}
	}
}

// delivery is one record the row's notifications consumer saw.
type delivery struct {
	chargeID int64
	key      string
	eventID  string
}

// notifier is a row's in-process notifications consumer on billing.charged:
// it dedupes the relay's repeats and records every delivery in order.
type notifier struct {
	mu   sync.Mutex
	seen []delivery
}

func startNotifier(t *testing.T, m *matrixEnv) *notifier {
	t.Helper()
	cfg, err := consumerConfig(m.brokers)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Group = "matrix-notifications"
	cfg.ClientOpts = append(cfg.ClientOpts, kgo.FetchMaxWait(200*time.Millisecond))
	cfg.Handlers = IdemConsumers(&Billing{}, &Notifications{})[1:]
	n := &notifier{}
	cfg.OnRecord = func(_ *idem.EventHandler, rec *idem.Record, _ idem.Outcome) {
		var ev PaymentCharged
		_ = json.Unmarshal(rec.Value, &ev)
		d := delivery{chargeID: ev.ChargeID, key: string(rec.Key)}
		for _, h := range rec.Headers {
			if h.Key == idem.EventIDHeader {
				d.eventID = string(h.Value)
			}
		}
		n.mu.Lock()
		n.seen = append(n.seen, d)
		n.mu.Unlock()
	}
	cons, err := kafka.NewConsumer(idem.NewStore(m.pool), cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- cons.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("notifications consumer: %v", err)
		}
	})
	return n
}

// sawEvent reports whether the notifier has processed the event id.
func (n *notifier) sawEvent(id string) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return slices.ContainsFunc(n.seen, func(d delivery) bool { return d.eventID == id })
}

// disorder returns the number of keys among ids whose first deliveries
// are not in ascending charge id (= enqueue) order, and the ids never
// delivered.
func (n *notifier) check(ids []int64) (disorder int, missing []int64) {
	n.mu.Lock()
	defer n.mu.Unlock()
	want := map[int64]bool{}
	for _, id := range ids {
		want[id] = true
	}
	first := map[string][]int64{}
	got := map[int64]bool{}
	for _, d := range n.seen {
		if !want[d.chargeID] || got[d.chargeID] {
			continue
		}
		got[d.chargeID] = true
		first[d.key] = append(first[d.key], d.chargeID)
	}
	for _, seq := range first {
		if !sort.SliceIsSorted(seq, func(i, j int) bool { return seq[i] < seq[j] }) {
			disorder++
		}
	}
	for _, id := range ids {
		if !got[id] {
			missing = append(missing, id)
		}
	}
	return disorder, missing
}

// groupMembers returns how many members a consumer group has while it is
// Stable (0 while it rebalances).
func (m *matrixEnv) groupMembers(group string) int {
	req := kmsg.NewPtrDescribeGroupsRequest()
	req.Groups = []string{group}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := req.RequestWith(ctx, m.producer)
	if err != nil || len(resp.Groups) == 0 || resp.Groups[0].State != "Stable" {
		return 0
	}
	return len(resp.Groups[0].Members)
}

// deadOrParked counts the schema's dead letters and parked outbox rows.
func (m *matrixEnv) deadOrParked(t *testing.T) int {
	t.Helper()
	return int(pgtest.Count(t, m.pool, `SELECT count(*) FROM idem_dead_letters`) +
		pgtest.Count(t, m.pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PARKED'`))
}
