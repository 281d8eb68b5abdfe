// Command payments is the seed scenario as a runnable service: POST /payments
// charges an order through an //idem:http handler.
//
//	go run ./examples/payments            run the demo: start the service, play a client that retries, check the database
//	go run ./examples/payments serve      serve on $ADDR (default 127.0.0.1:8080) until SIGTERM
//
// On SIGTERM, serve drains requests for $DRAIN_TIMEOUT (default 10s), then
// cancels the rest: their transactions roll back and a retry is safe.
// Both use $DATABASE_URL (default postgres://postgres@127.0.0.1:5432/postgres).
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
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	idem "github.com/idemgen/idemgen/runtime"
)

//go:embed schema.sql
var schema string

const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cmd := "demo"
	if len(os.Args) > 1 {
		cmd = os.Args[1]
	}
	var err error
	switch cmd {
	case "demo":
		err = runDemo(ctx, os.Stdout)
	case "serve":
		err = serve(ctx)
	default:
		err = fmt.Errorf("unknown command %q (want demo or serve)", cmd)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "payments:", err)
		os.Exit(1)
	}
}

// open connects to the database and creates idemgen's and the service's tables.
func open(ctx context.Context) (*pgxpool.Pool, error) {
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = defaultDatabaseURL
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	if err := idem.Migrate(ctx, pool); err != nil {
		pool.Close()
		return nil, err
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("acquire: %w", err)
	}
	defer conn.Release()
	if _, err := conn.Conn().PgConn().Exec(ctx, schema).ReadAll(); err != nil {
		pool.Close()
		return nil, fmt.Errorf("create payments tables: %w", err)
	}
	return pool, nil
}

// newMux wires the generated routes.
func newMux(pool *pgxpool.Pool) *http.ServeMux {
	mux := http.NewServeMux()
	RegisterIdemRoutes(mux, idem.NewHTTP(idem.NewStore(pool)), &PaymentService{})
	return mux
}

func serve(ctx context.Context) error {
	pool, err := open(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	addr := os.Getenv("ADDR")
	if addr == "" {
		addr = "127.0.0.1:8080"
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	// The address actually bound (ADDR may say port 0), for scripts and tests.
	slog.Info("payments listening", "addr", ln.Addr().String())
	drain := 10 * time.Second
	if d := os.Getenv("DRAIN_TIMEOUT"); d != "" {
		if drain, err = time.ParseDuration(d); err != nil {
			return fmt.Errorf("DRAIN_TIMEOUT: %w", err)
		}
	}
	srv := &http.Server{Handler: newMux(pool), ReadHeaderTimeout: 5 * time.Second}
	err = idem.ServeHTTP(ctx, srv, ln, drain)
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	slog.Info("payments stopped", "err", err)
	return err
}
