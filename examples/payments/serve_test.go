package main

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/internal/pgtest"
)

// freeAddr returns a loopback address with a port that was free a moment ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// TestServeEmbeddedBroker: `payments serve` without KAFKA_BROKERS starts a
// broker on KAFKA_EMBEDDED_ADDR that an ordinary Kafka client (standing in
// for kcat) can produce to; the order it produces is charged once, and the
// charge's receipt goes out through outbox → relay → billing.charged →
// notifications, all in the one process, which then stops cleanly on SIGTERM.
func TestServeEmbeddedBroker(t *testing.T) {
	dbURL := pgtest.Schema(t)
	kafkaAddr := freeAddr(t)
	c := startProcess(t, "serve", listening, "DATABASE_URL="+dbURL, "ADDR=127.0.0.1:0", "KAFKA_EMBEDDED_ADDR="+kafkaAddr,
		"PROVIDER_URL="+providerFor(t, dbURL).url)
	c.waitLog(t, regexp.MustCompile(`embedded kafka broker .*addr=`+regexp.QuoteMeta(kafkaAddr)))
	c.waitLog(t, regexp.MustCompile(`partitions assigned`))
	c.waitLog(t, leading)

	cl, err := kgo.NewClient(kgo.SeedBrokers(kafkaAddr))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	v, _ := json.Marshal(OrderConfirmed{EventID: "evt-serve-1", OrderID: "o-serve-1", Total: 700, Currency: "EUR"})
	rec := &kgo.Record{Topic: "orders.confirmed", Key: []byte("o-serve-1"), Value: v}
	for range 2 { // delivered twice, charged once
		if err := cl.ProduceSync(context.Background(), rec).FirstErr(); err != nil {
			t.Fatal(err)
		}
		rec = &kgo.Record{Topic: rec.Topic, Key: rec.Key, Value: rec.Value}
	}

	pool, err := pgxpool.New(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	deadline := time.Now().Add(30 * time.Second)
	count := func(sql string) int64 {
		var n int64
		_ = pool.QueryRow(context.Background(), sql, "o-serve-1").Scan(&n)
		return n
	}
	for time.Now().Before(deadline) && count(`SELECT count(*) FROM notifications WHERE order_id = $1`) < 1 {
		time.Sleep(50 * time.Millisecond)
	}
	if n := count(`SELECT count(*) FROM charges WHERE order_id = $1`); n != 1 {
		t.Errorf("%d charges for the produced order, want 1:\n%s", n, c.log())
	}
	if n := count(`SELECT count(*) FROM notifications WHERE order_id = $1`); n != 1 {
		t.Errorf("%d receipts for the charge, want 1 (outbox → relay → notifications):\n%s", n, c.log())
	}
	// /metrics, as a person would curl it: the OpenTelemetry instruments
	// through the Prometheus exporter, with what just happened in them.
	resp, err := http.Get("http://" + c.addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []*regexp.Regexp{
		regexp.MustCompile(`(?m)^idem_consumer_records_total\{.*idem_consumer="billing".*idem_outcome="applied".*\} 1$`),
		regexp.MustCompile(`(?m)^idem_consumer_records_total\{.*idem_consumer="billing".*idem_outcome="duplicate".*\} 1$`),
		regexp.MustCompile(`(?m)^idem_relay_published_total\{.*\} [1-9]`),
		regexp.MustCompile(`(?m)^idem_relay_leader(_ratio)?\{.*\} 1$`),
		regexp.MustCompile(`(?m)^idem_outbox_pending\{.*\} 0$`),
		regexp.MustCompile(`(?m)^idem_dead_letters\{.*\} 0$`),
	} {
		if !want.Match(body) {
			t.Errorf("/metrics has no line matching %s:\n%s", want, body)
		}
	}
	c.stop(t)
}

// TestServeMissingTopic: against a cluster without the service's topics,
// serve exits at start-up with an error naming them (it used to log
// "consuming" and wait forever); with KAFKA_CREATE_TOPICS it creates them
// and starts.
func TestServeMissingTopic(t *testing.T) {
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "unrelated"))
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
	env := []string{"DATABASE_URL=" + pgtest.Schema(t), "ADDR=127.0.0.1:0", "KAFKA_BROKERS=" + strings.Join(cluster.ListenAddrs(), ",")}
	for _, sub := range []string{"serve", "consume", "relay"} {
		cmd := exec.Command(buildCrashBinary(t), sub)
		cmd.Env = append(cmd.Environ(), env...)
		done := make(chan struct{})
		var out []byte
		go func() { out, err = cmd.CombinedOutput(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			t.Fatalf("payments %s still running after 30s with missing topics", sub)
		}
		if err == nil {
			t.Fatalf("payments %s succeeded with missing topics:\n%s", sub, out)
		}
		want := "billing.charged"
		if sub != "relay" {
			want = "billing.charged, orders.confirmed"
		}
		if !strings.Contains(string(out), "missing topics: "+want+" do(es) not exist") {
			t.Errorf("payments %s output does not name the missing topics %s:\n%s", sub, want, out)
		}
	}
	c := startProcess(t, "serve", listening, append(env, "KAFKA_CREATE_TOPICS=2")...)
	c.waitLog(t, regexp.MustCompile(`partitions assigned`))
	c.stop(t)
}

// TestHelp: --help lists every subcommand and environment variable the
// program reads.
func TestHelp(t *testing.T) {
	out, err := exec.Command(buildCrashBinary(t), "--help").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"demo", "serve", "consume", "relay", "provider",
		"DATABASE_URL", "ADDR", "PROVIDER_URL", "PROVIDER_ADDR", "STARTUP_TIMEOUT", "NOT_READY_DELAY", "DRAIN_TIMEOUT", "KAFKA_BROKERS", "KAFKA_EMBEDDED_ADDR", "KAFKA_CREATE_TOPICS",
		"KAFKA_SESSION_TIMEOUT", "KAFKA_FETCH_MAX_WAIT", "RELAY_LEASE", "LOG_LEVEL", "IDEM_CRASH_AT", "IDEM_STOP_AT", "IDEM_CRASH_HIT"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("--help does not mention %s", want)
		}
	}
}

// TestSubcommandHelp: "payments serve --help" (and every other subcommand's)
// prints the help and exits 0; it used to ignore the flag and start the
// service. A stray argument is refused (exit 2) before anything starts. The
// database is unreachable here, so a subcommand that starts anyway fails
// with exit 1 instead of hanging the test.
func TestSubcommandHelp(t *testing.T) {
	bin := buildCrashBinary(t)
	env := append(os.Environ(), "DATABASE_URL=postgres://postgres@127.0.0.1:1/none?sslmode=disable", "STARTUP_TIMEOUT=2s",
		"ADDR=127.0.0.1:0", "KAFKA_EMBEDDED_ADDR=127.0.0.1:0", "PROVIDER_ADDR=127.0.0.1:0", "KAFKA_BROKERS=")
	for _, sub := range []string{"demo", "serve", "consume", "relay", "provider"} {
		for _, h := range []string{"--help", "-h", "help"} {
			cmd := exec.Command(bin, sub, h)
			cmd.Env = env
			out, err := cmd.Output()
			if err != nil || !strings.Contains(string(out), "KAFKA_EMBEDDED_ADDR") {
				t.Errorf("payments %s %s: %v, output %q; want the help and exit 0", sub, h, err, out)
			}
		}
		cmd := exec.Command(bin, sub, "--port=1")
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != 2 || !strings.Contains(string(out), "takes no arguments") {
			t.Errorf("payments %s --port=1: %v, output %q; want exit 2, takes no arguments", sub, err, out)
		}
	}
}
