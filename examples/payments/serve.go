package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

const usage = `usage: payments [command]

Commands:
  demo     (default) start the service on a loopback port, play HTTP clients that
           retry and an orders service that publishes every event three times,
           check in PostgreSQL that every order was charged once; exit 1 if not
  serve    run the whole service in one process: HTTP on $ADDR (with /readyz and
           /metrics, OpenTelemetry through a Prometheus exporter), the Kafka
           consumers (billing, notifications), the outbox relay and the janitor.
           Without KAFKA_BROKERS it starts an embedded broker (kfake) on
           $KAFKA_EMBEDDED_ADDR that kcat and other Kafka tools can use
  consume  run only the Kafka consumers (needs KAFKA_BROKERS)
  relay    run only the outbox relay (needs KAFKA_BROKERS)
  provider run the payment provider the service charges through (a separate
           process, as a real provider would be) on $PROVIDER_ADDR
  help     print this

Environment:
  DATABASE_URL          PostgreSQL (default postgres://postgres@127.0.0.1:5432/postgres)
  ADDR                  serve: HTTP listen address (default 127.0.0.1:8080; port 0 picks one)
  STARTUP_TIMEOUT       start-up (schema included) must finish within it, or exit 1 (default 15s)
  NOT_READY_DELAY       serve: on SIGTERM, /readyz answers 503 this long before the listener
                        closes, so load balancers stop sending traffic (default 5s; 0: none)
  DRAIN_TIMEOUT         serve: then, how long in-flight requests may finish (default 10s)
  PROVIDER_URL          serve, consume: the payment provider (default http://127.0.0.1:8081)
  PROVIDER_ADDR         provider: its listen address (default 127.0.0.1:8081)
  KAFKA_BROKERS         comma-separated seed brokers; serve: empty starts an embedded broker;
                        demo: empty uses an embedded broker on a random port
  KAFKA_EMBEDDED_ADDR   serve: the embedded broker's address (default 127.0.0.1:9092)
  KAFKA_CREATE_TOPICS   a partition count: create missing topics (orders.confirmed,
                        billing.charged) with it; empty: a missing topic is a start-up error
  KAFKA_SESSION_TIMEOUT consumer group session timeout (default: franz-go's 45s). A member
                        killed without leaving keeps its partitions until the coordinator
                        misses its heartbeats for this long; the others then rejoin at their
                        next heartbeat (every 3s), so its partitions wait ~45-48s. Lower it
                        (e.g. 6s) for faster takeover, at the cost of spurious rebalances
                        on long GC or network pauses
  KAFKA_FETCH_MAX_WAIT  how long a fetch waits for records (default: franz-go's 5s); tests
                        shorten it, as an in-process broker holds an empty fetch that long
  RELAY_LEASE           the relay's leadership lease (default 15s, idem's); a killed leader's
                        standby takes over after it; tests shorten it
  IDLE_TX_TIMEOUT       serve, consume: a process frozen mid-transaction (SIGSTOP, a paused VM)
                        loses its PostgreSQL session after this long without a statement, which
                        frees its in-flight keys and records (default 2m, idem's; tests shorten it)
  LOG_LEVEL             debug, info (default), warn or error; per-record lines are debug
  IDEM_CRASH_AT         tests only: SIGKILL the process at a named crash point
  IDEM_STOP_AT          tests only: SIGSTOP the process there instead
  IDEM_CRASH_HIT        tests only: act on the k-th time the point is reached (default 1)
`

// Topics: the consumers read orders.confirmed (billing) and billing.charged
// (notifications); the relay publishes billing.charged.
var (
	servedTopics = []string{"orders.confirmed", "billing.charged"}
	relayTopics  = []string{"billing.charged"}
)

const (
	defaultEmbeddedAddr       = "127.0.0.1:9092"
	defaultEmbeddedPartitions = 3
)

func init() {
	// The default handler's output is kept (scripts and tests read it); only
	// its level is set.
	if lvl := os.Getenv("LOG_LEVEL"); lvl != "" {
		var l slog.Level
		if err := l.UnmarshalText([]byte(lvl)); err != nil {
			fmt.Fprintf(os.Stderr, "payments: LOG_LEVEL %q: %v; using info\n", lvl, err)
		} else {
			slog.SetLogLoggerLevel(l)
		}
	}
}

// serve runs HTTP, the consumers, the relay and the janitor until ctx is
// cancelled or one of them fails; a failure stops the others.
func serve(ctx context.Context) error {
	chk, err := topicCheck()
	if err != nil {
		return err
	}
	// The database first: its start-up errors (and STARTUP_TIMEOUT) come
	// before anything binds a port.
	pool, err := open(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	stopMetrics, err := setupMetrics(idem.NewStore(pool))
	if err != nil {
		return err
	}
	defer stopMetrics()
	brokers, stopBroker, err := brokersOrEmbedded()
	if err != nil {
		return err
	}
	defer stopBroker()

	// Everything is set up and checked before anything runs, so a missing
	// topic fails start-up with its name instead of a silent consumer.
	consumer, err := newConsumer(ctx, pool, brokers, chk)
	if err != nil {
		return err
	}
	relay, closeRelay, err := newRelay(ctx, pool, brokers, chk)
	if err != nil {
		return err
	}
	defer closeRelay()
	janitor, err := idem.NewJanitor(idem.NewStore(pool), idem.JanitorConfig{})
	if err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	parts := map[string]func(context.Context) error{
		"http":     func(ctx context.Context) error { return serveHTTP(ctx, pool) },
		"consumer": consumer.Run,
		"relay":    relay.Run,
		"janitor":  janitor.Run,
	}
	errs := make(chan error, len(parts))
	var wg sync.WaitGroup
	for name, run := range parts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := run(ctx)
			if err != nil {
				err = fmt.Errorf("%s: %w", name, err)
			} else if ctx.Err() == nil {
				err = fmt.Errorf("%s stopped unexpectedly", name)
			}
			errs <- err
			cancel() // one part down takes the process down: run it again whole
		}()
	}
	wg.Wait()
	close(errs)
	var all []error
	for err := range errs {
		if err != nil {
			all = append(all, err)
		}
	}
	return errors.Join(all...)
}

// brokersOrEmbedded returns $KAFKA_BROKERS, or starts an embedded broker on
// $KAFKA_EMBEDDED_ADDR with the service's topics and returns its address.
func brokersOrEmbedded() ([]string, func(), error) {
	if b := os.Getenv("KAFKA_BROKERS"); b != "" {
		return strings.Split(b, ","), func() {}, nil
	}
	addr := os.Getenv("KAFKA_EMBEDDED_ADDR")
	if addr == "" {
		addr = defaultEmbeddedAddr
	}
	cluster, err := kfake.NewCluster(
		kfake.NumBrokers(1),
		kfake.SeedTopics(defaultEmbeddedPartitions, servedTopics...),
		kfake.ListenFn(func(network, _ string) (net.Listener, error) { return net.Listen(network, addr) }),
	)
	if err != nil {
		return nil, nil, fmt.Errorf("embedded kafka on KAFKA_EMBEDDED_ADDR %s: %w", addr, err)
	}
	brokers := cluster.ListenAddrs()
	slog.Info("embedded kafka broker (kfake) listening; its data is in memory and lost on exit",
		"addr", strings.Join(brokers, ","), "topics", servedTopics, "partitions", defaultEmbeddedPartitions)
	return brokers, cluster.Close, nil
}

// topicCheck reads $KAFKA_CREATE_TOPICS.
func topicCheck() (kafka.TopicCheck, error) {
	s := os.Getenv("KAFKA_CREATE_TOPICS")
	if s == "" {
		return kafka.TopicCheck{}, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n <= 0 {
		return kafka.TopicCheck{}, fmt.Errorf("KAFKA_CREATE_TOPICS=%q: want a partition count, e.g. 3", s)
	}
	return kafka.TopicCheck{CreatePartitions: int32(n)}, nil
}

// newConsumer builds the service's consumer group and checks its topics.
func newConsumer(ctx context.Context, pool *pgxpool.Pool, brokers []string, chk kafka.TopicCheck) (*kafka.Consumer, error) {
	cfg, err := consumerConfig(brokers)
	if err != nil {
		return nil, err
	}
	cfg.OnRecord = func(cons *idem.EventHandler, rec *idem.Record, o idem.Outcome) {
		slog.Debug("record done", "context", cons.Context, "topic", rec.Topic, "partition", rec.Partition, "offset", rec.Offset, "outcome", o.String())
	}
	c, err := kafka.NewConsumer(idem.NewStore(pool), cfg)
	if err != nil {
		return nil, err
	}
	if err := c.CheckTopics(ctx, chk); err != nil {
		return nil, err
	}
	slog.Info("payments consuming", "brokers", brokers, "group", cfg.Group, "topics", c.Topics())
	return c, nil
}

// newRelay builds the outbox relay and checks the topics it publishes to.
func newRelay(ctx context.Context, pool *pgxpool.Pool, brokers []string, chk kafka.TopicCheck) (*idem.Relay, func(), error) {
	pub, err := kafka.NewPublisher(brokers)
	if err != nil {
		return nil, nil, err
	}
	if err := kafka.CheckTopics(ctx, pub.Client, relayTopics, chk); err != nil {
		pub.Close()
		return nil, nil, fmt.Errorf("relay: %w", err)
	}
	slog.Info("payments relay standing by for leadership", "topics", relayTopics)
	cfg := idem.RelayConfig{OnLeader: func() { slog.Info("payments relay leading") }}
	// Tests shorten the lease so a standby (or a restarted relay) takes over
	// a killed leader quickly; production keeps the default.
	if d := os.Getenv("RELAY_LEASE"); d != "" {
		if cfg.Lease, err = time.ParseDuration(d); err != nil {
			pub.Close()
			return nil, nil, fmt.Errorf("RELAY_LEASE: %w", err)
		}
	}
	r, err := idem.NewRelay(idem.NewStore(pool), pub, cfg)
	if err != nil {
		pub.Close()
		return nil, nil, err
	}
	return r, pub.Close, nil
}
