package rssbench

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/internal/benchkit"
	"github.com/idemgen/idemgen/internal/benchkit/bareconsumer"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// Shapes of the burst, the same in every mode but for its size.
const (
	httpClients  = 64 // concurrent HTTP clients, each sending its next request when answered
	httpPoolSize = 8  // the service's pool (as in BenchmarkHTTPSideBySide)
	consumerPool = 8  // the consumer's pool
	partitions   = 8  // partitions of the consumer's topic (processed concurrently)
	relayKeys    = 50 // distinct record keys in the outbox backlog
	relayPartns  = 3
	stepTimeout  = 20 * time.Minute
)

// BenchmarkPeakRSS measures the peak resident set (VmHWM) of the child
// processes, each handling a burst against real PostgreSQL (its own schema)
// and an in-process Kafka (kfake, in this parent process), next to a
// baseline:
//
//   - HTTP: the idempotent handler (idem.Handle, default HTTPConfig) under
//     idem.ServeHTTP answering n POSTs with distinct keys from 64 concurrent
//     clients over loopback; baseline: the same child serving the bare
//     handler (the same INSERT in its own transaction) to the same burst.
//   - consumer: kafka.Consumer (defaults: one transaction per record, a
//     partition paused at 500 records queued) consuming n records already
//     in an 8-partition topic; two baselines, each a child of its own doing
//     the same INSERT per record with the same commit behaviour: bare, a
//     plain kgo loop with the consumer's structure (bareconsumer.Run: a
//     worker goroutine per partition across polls, the same pause rule),
//     and bare per-poll, the structure the consumer had before 2026-12-01
//     (bareconsumer.RunPerPoll: a goroutine per partition for each poll of
//     500, all waited for). After each side the parent checks that every
//     record has one effect row per side so far.
//   - relay: idem.Relay (defaults) publishing an outbox backlog of n rows;
//     baseline: the same process's RSS right after setup (pool, producer and
//     relay built and connected), before it starts.
//
// Each burst is 100,000 in long mode (IDEMBENCH_LONG); short mode makes
// them 10,000 requests, 3,000 records and 10,000 rows, said in the rows. Each
// child is the test binary run again with IDEMBENCH_RSS_CHILD set, so the
// parent's memory (the load generator, kfake) is not in the figure.
// Run: go run ./cmd/idembench -only rss
func BenchmarkPeakRSS(b *testing.B) {
	for _, r := range measure(b, benchkit.Pick(shortBursts, longBursts)) {
		benchkit.Emit(r)
	}
}

// bursts are the sizes of the three bursts.
type bursts struct{ requests, records, backlog int }

var (
	longBursts = bursts{100_000, 100_000, 100_000}
	// Short mode keeps the suite near 40 s on a loaded 2-core machine: the
	// consumer's records are applied one transaction each, a few hundred a
	// second there.
	shortBursts = bursts{10_000, 3_000, 10_000}
)

// measure runs the three shapes and returns their rows (two for the
// consumer: against each bare loop).
func measure(tb testing.TB, n bursts) []benchkit.Row {
	rows := []benchkit.Row{httpRSS(tb, n.requests)}
	rows = append(rows, consumerRSS(tb, n.records)...)
	return append(rows, relayRSS(tb, n.backlog))
}

// count is n as the rows' names say it: 300, 3k, 100k.
func count(n int) string {
	if n < 1000 {
		return strconv.Itoa(n)
	}
	return fmt.Sprintf("%dk", n/1000)
}

const section = "Peak RSS"

// usage is what one child measured.
type usage struct {
	ready benchkit.Memory // after setup, before the burst
	end   benchkit.Memory // when the burst is done
	took  time.Duration   // the burst's wall time
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", benchkit.MiB(n)) }

// rate is n per second over d.
func rate(n int, d time.Duration) string { return fmt.Sprintf("%.0f/s", float64(n)/d.Seconds()) }

func httpRSS(tb testing.TB, n int) benchkit.Row {
	dbURL, pool := schema(tb)
	pgtest.Exec(tb, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount int NOT NULL)`)
	run := func(mode string) usage {
		c := startChild(tb, mode, "RSS_DB="+withParam(tb, dbURL, "pool_max_conns", strconv.Itoa(httpPoolSize)))
		defer c.stop(tb)
		addr := c.await(tb, "listening ")
		var u usage
		u.ready = c.memory(tb)
		start := time.Now()
		httpBurst(tb, addr, mode, n)
		u.took = time.Since(start)
		u.end = c.memory(tb)
		return u
	}
	bare := run("http-bare")
	if got := pgtest.Count(tb, pool, `SELECT count(*) FROM effects`); got != int64(n) {
		tb.Fatalf("bare HTTP: %d effects, want %d", got, n)
	}
	idm := run("http-idem")
	if got := pgtest.Count(tb, pool, `SELECT count(*) FROM idem_keys WHERE status_code = 201`); got != int64(n) {
		tb.Fatalf("idempotent HTTP: %d completed keys, want %d", got, n)
	}
	if got := pgtest.Count(tb, pool, `SELECT count(*) FROM effects`); got != 2*int64(n) {
		tb.Fatalf("idempotent HTTP: %d effects in all, want %d", got, 2*n)
	}
	return benchkit.Row{Section: section, Name: "HTTP service, " + count(n) + " requests, idempotent/bare", Unit: "ratio",
		Value: float64(idm.end.Peak) / float64(bare.end.Peak),
		Detail: fmt.Sprintf("idempotent %s, bare %s (after start %s, %s); %d POSTs, %d clients, %s, %s",
			mib(idm.end.Peak), mib(bare.end.Peak), mib(idm.ready.RSS), mib(bare.ready.RSS), n, httpClients, rate(n, idm.took), rate(n, bare.took))}
}

// httpBurst sends n POSTs with distinct keys from httpClients concurrent
// clients, each sending its next request when the last is answered.
func httpBurst(tb testing.TB, addr, tag string, n int) {
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: httpClients, MaxConnsPerHost: httpClients}, Timeout: time.Minute}
	defer client.CloseIdleConnections()
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, httpClients)
	for range httpClients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1)
				if i > int64(n) {
					return
				}
				body := fmt.Sprintf(`{"order":"%s-%d","amount":100}`, tag, i)
				req, err := http.NewRequest(http.MethodPost, "http://"+addr+"/charges", strings.NewReader(body))
				if err != nil {
					errs <- err
					return
				}
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("Idempotency-Key", fmt.Sprintf("%s-%d", tag, i))
				resp, err := client.Do(req)
				if err != nil {
					errs <- err
					return
				}
				got, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusCreated {
					errs <- fmt.Errorf("request %d: status %d: %s", i, resp.StatusCode, got)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		tb.Fatalf("%s burst: %v", tag, err)
	}
}

func consumerRSS(tb testing.TB, n int) []benchkit.Row {
	dbURL, pool := schema(tb)
	pgtest.Exec(tb, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
	addrs := cluster(tb, partitions, "orders")
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.DefaultProduceTopic("orders"))
	if err != nil {
		tb.Fatal(err)
	}
	defer cl.Close()
	for i := 0; i < n; {
		var recs []*kgo.Record
		for ; i < n && len(recs) < 10_000; i++ {
			id := fmt.Sprintf("e-%d", i)
			v, _ := json.Marshal(order{EventID: id, Amount: 1})
			recs = append(recs, &kgo.Record{Key: []byte(id), Value: v})
		}
		if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
			tb.Fatal(err)
		}
	}
	run := func(mode string) usage {
		c := startChild(tb, mode, "RSS_DB="+withParam(tb, dbURL, "pool_max_conns", strconv.Itoa(consumerPool)),
			"RSS_BROKERS="+strings.Join(addrs, ","), "RSS_N="+strconv.Itoa(n))
		defer c.stop(tb)
		c.await(tb, "ready")
		var u usage
		u.ready = c.memory(tb)
		start := time.Now()
		c.send(tb, "go")
		c.await(tb, "done")
		u.took = time.Since(start)
		u.end = c.memory(tb)
		return u
	}
	// Each side applies every record once: after the k-th side, every
	// event id has k effect rows. None of the bare loops has a dedupe that
	// would hide a double or a missed record.
	sides := 0
	appliedOnce := func(side string) {
		tb.Helper()
		sides++
		if got := pgtest.Count(tb, pool, `SELECT count(*) FROM (SELECT event_id FROM effects GROUP BY event_id HAVING count(*) = $1) x`, sides); got != int64(n) {
			tb.Fatalf("%s: %d of %d records have one effect row per side (%d sides)", side, got, n, sides)
		}
	}
	bare := run("consumer-bare")
	appliedOnce("bare consumer")
	perPoll := run("consumer-bare-per-poll")
	appliedOnce("bare per-poll consumer")
	idm := run("consumer-idem")
	appliedOnce("kafka.Consumer")
	if got := pgtest.Count(tb, pool, `SELECT count(*) FROM idem_processed_events`); got != int64(n) {
		tb.Fatalf("consumer: %d processed events, want %d", got, n)
	}
	return []benchkit.Row{
		{Section: section, Name: "consumer, " + count(n) + " records, idempotent/bare", Unit: "ratio",
			Value: float64(idm.end.Peak) / float64(bare.end.Peak),
			Detail: fmt.Sprintf("bare: per-partition workers across polls, as the consumer; kafka.Consumer %s, bare %s (after setup %s, %s); %d records, %d partitions, %s, %s",
				mib(idm.end.Peak), mib(bare.end.Peak), mib(idm.ready.RSS), mib(bare.ready.RSS), n, partitions, rate(n, idm.took), rate(n, bare.took))},
		{Section: section, Name: "consumer, " + count(n) + " records, idempotent/bare per-poll", Unit: "ratio",
			Value: float64(idm.end.Peak) / float64(perPoll.end.Peak),
			Detail: fmt.Sprintf("bare per-poll: a goroutine per partition for each poll of 500 (the consumer's structure before 2026-12-01); bare per-poll %s (after setup %s), %s",
				mib(perPoll.end.Peak), mib(perPoll.ready.RSS), rate(n, perPoll.took))},
	}
}

func relayRSS(tb testing.TB, n int) benchkit.Row {
	dbURL, pool := schema(tb)
	addrs := cluster(tb, relayPartns, "events")
	// The backlog, as idem.Enqueue would write it (JSON payload, a record
	// key, no headers), in one statement.
	pgtest.Exec(tb, pool, fmt.Sprintf(`INSERT INTO idem_outbox (topic, record_key, payload, headers)
		SELECT 'events', convert_to('k' || (i %% %d), 'UTF8'),
		       convert_to(json_build_object('key', 'k' || (i %% %d), 'seq', i, 'pad', repeat('x', 64))::text, 'UTF8'), '{}'
		FROM generate_series(1, %d) i`, relayKeys, relayKeys, n))
	c := startChild(tb, "relay", "RSS_DB="+dbURL, "RSS_BROKERS="+strings.Join(addrs, ","))
	defer c.stop(tb)
	c.await(tb, "ready")
	ready := c.memory(tb)
	start := time.Now()
	c.send(tb, "go")
	deadline := time.Now().Add(stepTimeout)
	for pgtest.Count(tb, pool, `SELECT count(*) FROM idem_outbox WHERE status <> 'PUBLISHED'`) > 0 {
		if time.Now().After(deadline) || c.exitedEarly() {
			tb.Fatalf("relay: backlog not published in %v (child exited: %v)", stepTimeout, c.exitedEarly())
		}
		time.Sleep(100 * time.Millisecond)
	}
	took := time.Since(start)
	end := c.memory(tb)
	return benchkit.Row{Section: section, Name: "relay, " + count(n) + "-row backlog, peak/after setup", Unit: "ratio",
		Value: float64(end.Peak) / float64(ready.RSS),
		Detail: fmt.Sprintf("peak %s, after setup %s; %d-row outbox backlog, %d keys, %d partitions, %s",
			mib(end.Peak), mib(ready.RSS), n, relayKeys, relayPartns, rate(n, took))}
}

// schema is a fresh schema with idemgen's tables: its URL and a pool on it.
func schema(tb testing.TB) (string, *pgxpool.Pool) {
	tb.Helper()
	u := pgtest.Schema(tb)
	pool, err := pgxpool.New(context.Background(), u)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(pool.Close)
	if err := idem.Migrate(context.Background(), pool); err != nil {
		tb.Fatal(err)
	}
	return u, pool
}

func withParam(tb testing.TB, dbURL, name, value string) string {
	tb.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		tb.Fatal(err)
	}
	q := u.Query()
	q.Set(name, value)
	u.RawQuery = q.Encode()
	return u.String()
}

func cluster(tb testing.TB, partitions int32, topic string) []string {
	tb.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, topic))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(c.Close)
	return c.ListenAddrs()
}

// child is this test binary run as one of the measured processes.
type child struct {
	mode   string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string // its stdout, line by line; closed when it ends
	exited chan struct{}
	err    error // Wait's, once exited is closed
}

func startChild(tb testing.TB, mode string, env ...string) *child {
	tb.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$", "-test.bench=^$")
	cmd.Env = append(os.Environ(), append([]string{childEnv + "=" + mode}, env...)...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		tb.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	c := &child{mode: mode, cmd: cmd, stdin: stdin, lines: make(chan string, 16), exited: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
		close(c.lines)
		c.err = cmd.Wait()
		close(c.exited)
	}()
	tb.Cleanup(func() { _ = cmd.Process.Kill(); <-c.exited })
	return c
}

// await waits for a line starting with prefix and returns the rest of it.
func (c *child) await(tb testing.TB, prefix string) string {
	tb.Helper()
	timeout := time.After(stepTimeout)
	for {
		select {
		case line, ok := <-c.lines:
			if !ok {
				<-c.exited
				tb.Fatalf("%s child exited before %q: %v", c.mode, prefix, c.err)
			}
			if rest, found := strings.CutPrefix(line, prefix); found {
				return rest
			}
		case <-timeout:
			tb.Fatalf("%s child: no %q in %v", c.mode, prefix, stepTimeout)
		}
	}
}

func (c *child) send(tb testing.TB, line string) {
	tb.Helper()
	if _, err := io.WriteString(c.stdin, line+"\n"); err != nil {
		tb.Fatalf("%s child: %v", c.mode, err)
	}
}

func (c *child) memory(tb testing.TB) benchkit.Memory {
	tb.Helper()
	m, err := benchkit.ProcMemory(c.cmd.Process.Pid)
	if err != nil {
		tb.Fatalf("%s child: %v", c.mode, err)
	}
	return m
}

func (c *child) exitedEarly() bool {
	select {
	case <-c.exited:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM and waits for a clean exit.
func (c *child) stop(tb testing.TB) {
	tb.Helper()
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.exited:
		if c.err != nil {
			tb.Errorf("%s child: %v", c.mode, c.err)
		}
	case <-time.After(30 * time.Second):
		tb.Errorf("%s child did not stop in 30s after SIGTERM", c.mode)
	}
}

// The child side.

// childEnv names the child's mode; TestMain runs the child instead of the
// tests when it is set.
const childEnv = "IDEMBENCH_RSS_CHILD"

func TestMain(m *testing.M) {
	mode := os.Getenv(childEnv)
	if mode == "" {
		os.Exit(m.Run())
	}
	// The libraries' own logs at Info (rebalances, leases) would only be
	// noise in the benchmark's output.
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	if err := runChild(ctx, mode); err != nil {
		fmt.Fprintf(os.Stderr, "%s child: %v\n", mode, err)
		os.Exit(1)
	}
	os.Exit(0)
}

func runChild(ctx context.Context, mode string) error {
	pool, err := pgxpool.New(ctx, os.Getenv("RSS_DB"))
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := pool.Ping(ctx); err != nil {
		return err
	}
	brokers := strings.Split(os.Getenv("RSS_BROKERS"), ",")
	n, _ := strconv.Atoi(os.Getenv("RSS_N"))
	switch mode {
	case "http-bare", "http-idem":
		return serveChild(ctx, pool, mode == "http-idem")
	case "consumer-bare":
		return bareConsumerChild(ctx, pool, brokers, n, bareconsumer.Run)
	case "consumer-bare-per-poll":
		return bareConsumerChild(ctx, pool, brokers, n, bareconsumer.RunPerPoll)
	case "consumer-idem":
		return consumerChild(ctx, pool, brokers, n)
	case "relay":
		return relayChild(ctx, pool, brokers)
	}
	return fmt.Errorf("unknown mode %q", mode)
}

type chargeReq struct {
	Order  string `json:"order"`
	Amount int    `json:"amount"`
}

type receipt struct {
	ID     int64  `json:"id"`
	Order  string `json:"order"`
	Amount int    `json:"amount"`
}

func insertCharge(ctx context.Context, tx pgx.Tx, req chargeReq) (receipt, error) {
	var id int64
	err := tx.QueryRow(ctx, `INSERT INTO effects (order_id, amount) VALUES ($1, $2) RETURNING id`, req.Order, req.Amount).Scan(&id)
	return receipt{ID: id, Order: req.Order, Amount: req.Amount}, err
}

// bareCharge is the baseline handler: decode, the same INSERT in its own
// transaction (BEGIN, INSERT … RETURNING, COMMIT), encode.
func bareCharge(pool *pgxpool.Pool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req chargeReq
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var resp receipt
		err := pgx.BeginFunc(r.Context(), pool, func(tx pgx.Tx) (err error) {
			resp, err = insertCharge(r.Context(), tx, req)
			return err
		})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(resp)
	})
}

// serveChild serves POST /charges (idempotent or bare) through
// idem.ServeHTTP on a free loopback port, printing "listening ADDR", until
// SIGTERM.
func serveChild(ctx context.Context, pool *pgxpool.Pool, idempotent bool) error {
	mux := http.NewServeMux()
	if idempotent {
		engine, err := idem.NewHTTP(idem.NewStore(pool), idem.HTTPConfig{})
		if err != nil {
			return err
		}
		idem.HandleRoute(mux, "POST /charges", idem.Handle(engine, idem.Endpoint{Scope: "rss", Route: "POST /charges", Status: http.StatusCreated}, insertCharge))
	} else {
		mux.Handle("POST /charges", bareCharge(pool))
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	fmt.Printf("listening %s\n", ln.Addr())
	return idem.ServeHTTP(ctx, &http.Server{Handler: mux}, ln, idem.ServeConfig{NoNotReadyDelay: true, Drain: 5 * time.Second})
}

type order struct {
	EventID string `json:"event_id"`
	Amount  int64  `json:"amount"`
}

func applyOrder(ctx context.Context, tx pgx.Tx, ev order) error {
	_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, amount) VALUES ($1, $2)`, ev.EventID, ev.Amount)
	return err
}

// readyThenGo prints "ready" and waits for the parent's line on stdin (it
// reads the child's memory in between).
func readyThenGo(ctx context.Context) error {
	fmt.Println("ready")
	got := make(chan error, 1)
	go func() {
		_, err := bufio.NewReader(os.Stdin).ReadString('\n')
		got <- err
	}()
	select {
	case err := <-got:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// counter prints "done" when the n-th record is applied.
type counter struct {
	n    int64
	done atomic.Int64
}

func (c *counter) add() {
	if c.done.Add(1) == c.n {
		fmt.Println("done")
	}
}

// consumerChild runs kafka.Consumer (defaults) on the topic "orders" from
// its start until SIGTERM, printing "done" when n records are applied.
func consumerChild(ctx context.Context, pool *pgxpool.Pool, brokers []string, n int) error {
	cnt := &counter{n: int64(n)}
	c, err := kafka.NewConsumer(idem.NewStore(pool), kafka.ConsumerConfig{
		Brokers: brokers, Group: "rss-idem",
		Handlers:   []idem.EventHandler{idem.Consume(idem.EventSpec[order]{Topic: "orders", Context: "rss", EventID: func(o order) string { return o.EventID }}, applyOrder)},
		OnRecord:   func(*idem.EventHandler, *idem.Record, idem.Outcome) { cnt.add() },
		ClientOpts: []kgo.Opt{kgo.ConsumeResetOffset(kgo.NewOffset().AtStart())},
	})
	if err != nil {
		return err
	}
	if err := readyThenGo(ctx); err != nil {
		return err
	}
	return c.Run(ctx)
}

// bareConsumerChild is a baseline: run (bareconsumer.Run, the consumer's
// structure, or RunPerPoll, its structure before 2026-12-01) in a group of
// its own from the topic's start, MaxPollRecords 500 (kafka.Consumer's
// default), per record json.Unmarshal and the same INSERT in its own
// transaction, then the record marked: the consumer's commit behaviour
// without its dedupe. Like consumerChild it prints "done" when n records
// are applied and runs until SIGTERM.
func bareConsumerChild(ctx context.Context, pool *pgxpool.Pool, brokers []string, n int, run func(context.Context, bareconsumer.Config) error) error {
	if err := readyThenGo(ctx); err != nil {
		return err
	}
	cnt := &counter{n: int64(n)}
	return run(ctx, bareconsumer.Config{Brokers: brokers, Group: "rss-" + os.Getenv(childEnv), Topic: "orders", MaxPollRecords: 500,
		Opts: []kgo.Opt{kgo.ConsumeResetOffset(kgo.NewOffset().AtStart())},
		Apply: func(ctx context.Context, r *kgo.Record) error {
			var ev order
			if err := json.Unmarshal(r.Value, &ev); err != nil {
				return err
			}
			if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return applyOrder(ctx, tx, ev) }); err != nil {
				return err
			}
			cnt.add()
			return nil
		}})
}

// relayChild builds a relay (defaults) on a connected pool and producer,
// prints "ready", and on the parent's word runs it until SIGTERM.
func relayChild(ctx context.Context, pool *pgxpool.Pool, brokers []string) error {
	pub, err := kafka.NewPublisher(brokers)
	if err != nil {
		return err
	}
	defer pub.Close()
	if err := pub.Client.Ping(ctx); err != nil {
		return err
	}
	r, err := idem.NewRelay(idem.NewStore(pool), pub, idem.RelayConfig{})
	if err != nil {
		return err
	}
	if err := readyThenGo(ctx); err != nil {
		return err
	}
	if err := r.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

// The benchmark's three shapes work end to end on a small burst: every
// child does the work (the effects are counted in PostgreSQL inside
// measure) and reports a peak at least as large as its RSS after setup.
func TestPeakRSSShapes(t *testing.T) {
	rows := measure(t, bursts{300, 300, 300})
	if len(rows) != 4 {
		t.Fatalf("%d rows, want 4", len(rows))
	}
	for _, r := range rows {
		if r.Value < 0.5 || r.Value > 20 || r.Unit != "ratio" || r.Detail == "" {
			t.Errorf("row %+v", r)
		}
	}
}
