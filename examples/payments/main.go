// Command payments is the seed scenario as a runnable service: POST /payments
// charges an order through an //idem:http handler.
//
//	go run ./examples/payments            run the demo: start the service, play a client that retries, check the database
//	go run ./examples/payments serve      HTTP on $ADDR, consumers, relay and janitor in one process, until SIGTERM
//	go run ./examples/payments provider   the payment provider on $PROVIDER_ADDR (default 127.0.0.1:8081); serve calls $PROVIDER_URL
//	go run ./examples/payments --help     every command and environment variable
//
// On SIGTERM, serve turns /readyz to 503 for $NOT_READY_DELAY (default 5s),
// then drains requests for $DRAIN_TIMEOUT (default 10s), then cancels the
// rest: their transactions roll back and a retry is safe. Start-up (schema
// included) must finish within $STARTUP_TIMEOUT (default 15s), or the
// process exits 1 with the reason. All use $DATABASE_URL (default
// postgres://postgres@127.0.0.1:5432/postgres).
package main

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/examples/payments/db"
	"github.com/idemgen/idemgen/internal/shutdown"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

//go:embed schema.sql
var schema string

const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

func main() {
	ctx, stop := shutdown.Context("payments")
	defer stop()
	cmd := "demo"
	if len(os.Args) > 1 {
		cmd = os.Args[1]
	}
	// A subcommand takes no arguments: its settings are environment
	// variables. "payments serve --help" must print the help, not start a
	// service on the default ports against the default database.
	for _, a := range os.Args[min(2, len(os.Args)):] {
		switch a {
		case "help", "-h", "-help", "--help":
			fmt.Print(usage)
			return
		}
		fmt.Fprintf(os.Stderr, "payments: %s takes no arguments (settings are environment variables; see payments --help), got %q\n", cmd, a)
		os.Exit(2)
	}
	var err error
	switch cmd {
	case "demo":
		err = runDemo(ctx, os.Stdout)
	case "serve":
		err = serve(ctx)
	case "consume":
		err = consume(ctx)
	case "relay":
		err = relay(ctx)
	case "provider":
		err = runProvider(ctx)
	case "help", "-h", "-help", "--help":
		fmt.Print(usage)
	default:
		err = fmt.Errorf("unknown command %q (want demo, serve, consume, relay or provider; see payments --help)", cmd)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "payments:", err)
		os.Exit(1)
	}
}

// open connects to the database and creates idemgen's and the service's
// tables, within $STARTUP_TIMEOUT (default 15s): a database that refuses,
// never answers or fails the schema is a clear error within that bound, and
// SIGTERM (ctx) ends it at once.
func open(ctx context.Context) (*pgxpool.Pool, error) {
	timeout, err := envDuration("STARTUP_TIMEOUT", 15*time.Second)
	if err != nil {
		return nil, err
	}
	if timeout == 0 {
		// 0 would fail every start-up at once with a misleading "database
		// unreachable"; it does not mean "no bound".
		return nil, errors.New(`STARTUP_TIMEOUT="0": want a positive duration such as 15s`)
	}
	cfg, err := pgxpool.ParseConfig(databaseURL())
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	startCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := createTables(startCtx, pool); err != nil {
		pool.Close() // no connection is held here, so Close cannot wait forever
		switch {
		case ctx.Err() != nil:
			return nil, fmt.Errorf("start-up interrupted: %w", err)
		case startCtx.Err() != nil:
			return nil, fmt.Errorf("start-up did not finish within STARTUP_TIMEOUT=%v (is the database at DATABASE_URL reachable?): %w", timeout, err)
		}
		return nil, err
	}
	return pool, nil
}

// createTables applies idemgen's schema (idem.Migrate: no DDL and no lock
// when it is current) and the service's own, serialized across replicas
// starting together.
func createTables(ctx context.Context, pool *pgxpool.Pool) error {
	if err := idem.Migrate(ctx, pool); err != nil {
		return err
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("create payments tables: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if err := db.New(tx).LockSchema(ctx); err != nil {
		return fmt.Errorf("create payments tables: lock: %w", err)
	}
	// The schema is several statements; only the simple protocol runs them in
	// one call.
	if _, err := tx.Conn().PgConn().Exec(ctx, schema).ReadAll(); err != nil {
		return fmt.Errorf("create payments tables: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("create payments tables: commit: %w", err)
	}
	return nil
}

// envDuration parses the duration in $name, or returns def if it is unset.
func envDuration(name string, def time.Duration) (time.Duration, error) {
	v := os.Getenv(name)
	if v == "" {
		return def, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		return 0, fmt.Errorf("%s=%q: want a non-negative duration such as 5s", name, v)
	}
	return d, nil
}

// newMux wires the generated routes.
func newMux(pool *pgxpool.Pool) (*http.ServeMux, error) {
	idle, err := envDuration("IDLE_TX_TIMEOUT", 0)
	if err != nil {
		return nil, err
	}
	h, err := idem.NewHTTP(idem.NewStore(pool), idem.HTTPConfig{IdleInTransactionTimeout: idle})
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	RegisterIdemRoutes(mux, h, &PaymentService{})
	if metricsHandler != nil {
		mux.Handle("GET /metrics", metricsHandler)
	}
	return mux, nil
}

// serveHTTP serves the payments API on $ADDR until ctx is cancelled
// (SIGTERM). Then /readyz answers 503 for $NOT_READY_DELAY (default 5s; 0
// for none) while the port still serves, so a load balancer sees it and
// stops sending traffic; then the listener closes and requests drain for
// $DRAIN_TIMEOUT (default 10s).
func serveHTTP(ctx context.Context, pool *pgxpool.Pool) error {
	drain, err := envDuration("DRAIN_TIMEOUT", 10*time.Second)
	if err != nil {
		return err
	}
	notReady, err := envDuration("NOT_READY_DELAY", idem.DefaultNotReadyDelay)
	if err != nil {
		return err
	}
	addr := os.Getenv("ADDR")
	if addr == "" {
		addr = "127.0.0.1:8080"
	}
	mux, err := newMux(pool)
	if err != nil {
		return err
	}
	ready := &idem.Readiness{}
	mux.Handle("GET /readyz", ready)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen on ADDR %s: %w", addr, err)
	}
	// The address actually bound (ADDR may say port 0), for scripts and tests.
	slog.Info("payments listening", "addr", ln.Addr().String())
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	cfg := idem.ServeConfig{Ready: ready, NotReadyDelay: notReady, NoNotReadyDelay: notReady == 0, Drain: drain}
	if drain == 0 {
		cfg.Drain = time.Nanosecond // DRAIN_TIMEOUT=0: cancel at once
	}
	err = idem.ServeHTTP(ctx, srv, ln, cfg)
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	slog.Info("payments stopped", "err", err)
	return err
}

// kafkaBrokers returns $KAFKA_BROKERS, or an error if it is unset.
func kafkaBrokers() ([]string, error) {
	b := os.Getenv("KAFKA_BROKERS")
	if b == "" {
		return nil, errors.New("KAFKA_BROKERS is not set")
	}
	return strings.Split(b, ","), nil
}

// consumerConfig is the consumer group of this service.
func consumerConfig(brokers []string) (kafka.ConsumerConfig, error) {
	cfg := kafka.ConsumerConfig{
		Brokers:    brokers,
		Group:      "payments",
		Handlers:   IdemConsumers(&Billing{}, &Notifications{}),
		ClientOpts: []kgo.Opt{kgo.ConsumeResetOffset(kgo.NewOffset().AtStart())},
	}
	// Tests shorten the session timeout so a killed member's partitions move
	// quickly; production keeps franz-go's default.
	if d := os.Getenv("KAFKA_SESSION_TIMEOUT"); d != "" {
		timeout, err := time.ParseDuration(d)
		if err != nil {
			return cfg, fmt.Errorf("KAFKA_SESSION_TIMEOUT: %w", err)
		}
		cfg.ClientOpts = append(cfg.ClientOpts, kgo.SessionTimeout(timeout), kgo.HeartbeatInterval(timeout/5))
	}
	idle, err := envDuration("IDLE_TX_TIMEOUT", 0)
	if err != nil {
		return cfg, err
	}
	cfg.IdleInTransactionTimeout = idle
	// Tests shorten the fetch wait too: kfake answers an empty fetch only
	// when the wait ends, so a record produced just after a member joins
	// would otherwise sit there for franz-go's default 5s.
	if d := os.Getenv("KAFKA_FETCH_MAX_WAIT"); d != "" {
		wait, err := time.ParseDuration(d)
		if err != nil {
			return cfg, fmt.Errorf("KAFKA_FETCH_MAX_WAIT: %w", err)
		}
		cfg.ClientOpts = append(cfg.ClientOpts, kgo.FetchMaxWait(wait))
	}
	return cfg, nil
}

// withKafka opens the database and runs fn with it and $KAFKA_BROKERS.
func withKafka(ctx context.Context, fn func(pool *pgxpool.Pool, brokers []string) error) error {
	brokers, err := kafkaBrokers()
	if err != nil {
		return err
	}
	pool, err := open(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	return fn(pool, brokers)
}

func consume(ctx context.Context) error {
	return withKafka(ctx, func(pool *pgxpool.Pool, brokers []string) error {
		chk, err := topicCheck()
		if err != nil {
			return err
		}
		c, err := newConsumer(ctx, pool, brokers, chk)
		if err != nil {
			return err
		}
		return c.Run(ctx)
	})
}

func relay(ctx context.Context) error {
	return withKafka(ctx, func(pool *pgxpool.Pool, brokers []string) error {
		chk, err := topicCheck()
		if err != nil {
			return err
		}
		r, closeRelay, err := newRelay(ctx, pool, brokers, chk)
		if err != nil {
			return err
		}
		defer closeRelay()
		return r.Run(ctx)
	})
}
