package kafka_test

import (
	"cmp"
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// A handler that fails the same way on every attempt through the database
// — it holds its transaction idle past idle_in_transaction_session_timeout
// (the server ends the session, 25P03), its statement hits
// statement_timeout (57014), or a deadline of its own ends its statement
// (pgx closes the connection) — was waited out as a storage outage forever:
// its partition never moved again, and since a poll ends only when every
// partition of it is done, no partition of the consumer was fetched again
// either; the log said "storage unavailable". Through the real consumer on
// kfake: the record uses its budget and is dead-lettered with what
// happened, records produced on the other partition while it was being
// retried are applied, and so is the record after it on its own partition;
// every partition's offset is committed to its end.
func TestHandlerTimeoutDeadLettersAndPartitionsFlow(t *testing.T) {
	t.Parallel()
	culprits := map[string]struct {
		fn   func(ctx context.Context, tx pgx.Tx) error
		want string // in the dead letter's last_error
		// slow: runs beyond the budget are free retries after a probe
		// that answered only slowly (making a connection slower than
		// the deadline on a loaded machine), at most 2 per attempt.
		slow bool
		// idle: the consumer's IdleInTransactionTimeout, when not the
		// 100ms of the others.
		idle time.Duration
	}{
		// The handler lowers the timeout in its own transaction below
		// the runtime's (10s) and idles past it: waited out as an outage
		// forever, the partition stuck, before the idle window's rule.
		"idle past a timeout the handler lowered": {
			fn: func(ctx context.Context, tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, `SET LOCAL idle_in_transaction_session_timeout = '50ms'`); err != nil {
					return err
				}
				time.Sleep(300 * time.Millisecond)
				return nil
			},
			want: "lowered it",
			idle: 10 * time.Second,
		},
		"25P03 swallowed": {
			fn: func(ctx context.Context, tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, `SET LOCAL idle_in_transaction_session_timeout = '50ms'`); err != nil {
					return err
				}
				time.Sleep(300 * time.Millisecond)
				_, _ = tx.Exec(ctx, `SELECT 1`) //idemvet:ignore swallowcancel the mistake this test makes on purpose
				return nil
			},
			want: "lowered it",
			idle: 10 * time.Second,
		},
		"idle past idle_in_transaction_session_timeout": {
			fn:   func(context.Context, pgx.Tx) error { time.Sleep(400 * time.Millisecond); return nil },
			want: "idle_in_transaction_session_timeout (100ms)",
		},
		"statement_timeout": {
			fn: func(ctx context.Context, tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, `SET LOCAL statement_timeout = '50ms'`); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, `SELECT pg_sleep(1)`)
				return err
			},
			want: "statement_timeout",
		},
		// pgx's default context watcher ends the statement by closing
		// the connection, which read as the database going away.
		"the handler's own deadline": {
			fn: func(ctx context.Context, tx pgx.Tx) error {
				qctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
				defer cancel()
				_, err := tx.Exec(qctx, `SELECT pg_sleep(1)`)
				return err
			},
			want: "the handler's own context",
			slow: true,
		},
	}
	for name, c := range culprits {
		for _, batch := range []int{1, 10} {
			t.Run(fmt.Sprintf("%s/batch=%d", name, batch), func(t *testing.T) {
				t.Parallel()
				addrs := cluster(t, 2, "orders")
				pool := db(t)
				prod, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(prod.Close)
				on := func(p int32, o order) *kgo.Record {
					r := orderRecord("orders", o)
					r.Partition = p
					return r
				}
				var calls atomic.Int64
				handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
					if err := applyOrder(ctx, tx, ev); err != nil {
						return err
					}
					if ev.EventID == "culprit" {
						calls.Add(1)
						return c.fn(ctx, tx)
					}
					return nil
				}
				r := startConsumer(t, pool, kafka.ConsumerConfig{
					Brokers: addrs, BatchSize: batch, Handlers: []idem.EventHandler{orderConsumer("orders", handler)},
					Retry:                    idem.RetryPolicy{MaxAttempts: 3, Initial: time.Millisecond, Max: 5 * time.Millisecond},
					Outage:                   idem.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
					IdleInTransactionTimeout: cmp.Or(c.idle, 100*time.Millisecond),
				}, nil)
				produce(t, prod, on(0, order{EventID: "culprit", Amount: 1}))
				waitBounded(t, 20*time.Second, "the culprit's first attempt", func() bool { return calls.Load() >= 1 })
				// Produced while the culprit is being retried: fetched only
				// by a later poll.
				var others []*kgo.Record
				for i := range 5 {
					others = append(others, on(1, order{EventID: fmt.Sprintf("other-%d", i), Amount: 1}))
				}
				produce(t, prod, append(others, on(0, order{EventID: "after", Amount: 1}))...)
				waitBounded(t, 30*time.Second, "the other partition's records and the record after the culprit", func() bool {
					return count(t, pool, `SELECT count(*) FROM effects WHERE event_id <> 'culprit'`) == 6
				})
				waitBounded(t, 10*time.Second, "offsets committed to the end", func() bool {
					got := committedOffsets(t, addrs, "g", "orders", 2)
					return got[0] == 2 && got[1] == 5
				})
				r.shutdown(t)
				maxRuns := int64(3)
				if c.slow {
					maxRuns = 3 * 3
				}
				if n := calls.Load(); n < 3 || n > maxRuns {
					t.Fatalf("the culprit ran %d times, want the budget of 3 (at most %d runs)", n, maxRuns)
				}
				var attempts int32
				var last string
				if err := pool.QueryRow(context.Background(), `SELECT attempts, last_error FROM idem_dead_letters`).Scan(&attempts, &last); err != nil {
					t.Fatal(err)
				}
				if attempts != 3 || !strings.Contains(last, c.want) {
					t.Fatalf("dead letter: %d attempts, %q; want 3 naming %s", attempts, last, c.want)
				}
				if n := count(t, pool, `SELECT count(*) FROM effects WHERE event_id = 'culprit'`); n != 0 {
					t.Fatalf("the culprit's effect committed %d times, want 0", n)
				}
			})
		}
	}
}
