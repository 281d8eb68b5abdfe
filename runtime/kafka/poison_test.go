package kafka_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// poisonNote makes the test handler fail with an error quoting the note,
// NUL byte and all.
const poisonNote = "x\x00y"

// The poison suite, through the real consumer on kfake: every record here
// must end dead-lettered with its raw bytes, and the valid record produced
// after them on the same partition must be applied, within one retry budget.
// Before the fix, the first two froze the partition forever (the dead-letter
// insert failed on a NUL byte and was retried inside the poll), and the
// bytes of the others were altered (U+FFFD) or lost (a repeated header).
func TestPoisonSuiteDeadLettersRawBytes(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{1, 10} {
		t.Run(fmt.Sprintf("batch=%d", batch), func(t *testing.T) {
			t.Parallel()
			addrs := cluster(t, 1, "orders")
			pool := db(t)
			poison := []*kgo.Record{
				// 1(a): the handler's error text holds a NUL byte.
				{Key: []byte("nul-error"), Value: []byte(`{"event_id":"e-nul","amount":-1,"note":"x\u0000y"}`)},
				// 1(b): undecodable, a header value with a NUL byte.
				{Value: []byte(`{not json`), Headers: []kgo.RecordHeader{{Key: "trace", Value: []byte("a\x00b")}}},
				// NUL and invalid UTF-8 in key and value.
				{Key: []byte("k\x00\xfe"), Value: []byte("\x00\xff\xfe")},
				// Invalid UTF-8 header values, a header with no value.
				{Value: []byte(`{`), Headers: []kgo.RecordHeader{{Key: "bin", Value: []byte("\xff\xfe")}, {Key: "nil"}}},
				// Repeated headers, kept in order.
				{Value: []byte(`[]`), Headers: []kgo.RecordHeader{{Key: "trace", Value: []byte("1")}, {Key: "span", Value: []byte("s")}, {Key: "trace", Value: []byte("2")}}},
				// A null value, an empty value.
				{Key: []byte("null-value")},
				{Key: []byte("empty-value"), Value: []byte{}},
			}
			valid := orderRecord("orders", order{EventID: "after", Amount: 9})
			p := producer(t, addrs)
			for _, r := range poison {
				r.Topic = "orders"
			}
			produce(t, p, append(append([]*kgo.Record{}, poison...), valid)...)

			var attempts atomic.Int64
			handler := func(ctx context.Context, tx pgx.Tx, ev noted) error {
				if ev.Amount < 0 {
					attempts.Add(1)
					return errors.New("refused: " + ev.Note)
				}
				_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, amount) VALUES ($1, $2)`, ev.EventID, ev.Amount)
				return err
			}
			var out outcomes
			r := startConsumer(t, pool, kafka.ConsumerConfig{
				Brokers: addrs, BatchSize: batch, Handlers: []idem.EventHandler{notedConsumer("orders", handler)},
				Retry: idem.RetryPolicy{MaxAttempts: 3, Initial: time.Millisecond, Max: 5 * time.Millisecond},
			}, &out)
			waitBounded(t, 20*time.Second, "the valid record after the poison ones", func() bool {
				return count(t, pool, `SELECT count(*) FROM effects WHERE event_id = 'after'`) == 1
			})
			r.shutdown(t)
			if attempts.Load() != 3 {
				t.Fatalf("the failing handler ran %d times, want one budget of 3", attempts.Load())
			}
			if out.get(idem.DeadLettered) != len(poison) || out.get(idem.Applied) != 1 {
				t.Fatalf("outcomes %v, want %d dead-lettered, 1 applied", out.n, len(poison))
			}
			got := deadLetters(t, pool)
			if len(got) != len(poison) {
				t.Fatalf("%d dead letters, want %d", len(got), len(poison))
			}
			for i, want := range poison {
				dl := got[i]
				if dl.Record.Offset != int64(i) || !sameBytes(dl.Record.Key, want.Key) || !sameBytes(dl.Record.Value, want.Value) {
					t.Errorf("dead letter %d: offset %d key %q value %q; want key %q value %q (nil: %v)",
						i, dl.Record.Offset, dl.Record.Key, dl.Record.Value, want.Key, want.Value, want.Value == nil)
				}
				if len(dl.Record.Headers) != len(want.Headers) {
					t.Errorf("dead letter %d: headers %q, want %q", i, dl.Record.Headers, want.Headers)
					continue
				}
				for j, h := range want.Headers {
					if dl.Record.Headers[j].Key != h.Key || !sameBytes(dl.Record.Headers[j].Value, h.Value) {
						t.Errorf("dead letter %d header %d: %q=%q, want %q=%q", i, j,
							dl.Record.Headers[j].Key, dl.Record.Headers[j].Value, h.Key, h.Value)
					}
				}
			}
			if e := got[0].LastError; e != `refused: x\x00y` || got[0].Attempts != 3 {
				t.Errorf("first dead letter: attempts %d, error %q", got[0].Attempts, e)
			}
		})
	}
}

// Issue 8 item 3, through the consumer: a cluster restored (or a topic
// re-created) reuses offset 0 for a new poison record; it gets its own dead
// letter instead of colliding with the old one and being dropped while its
// offset is committed.
func TestPoisonAtReusedOffsetKept(t *testing.T) {
	t.Parallel()
	pool := db(t)
	for i, value := range []string{`{first poison`, `{second poison`} {
		addrs := cluster(t, 1, "orders") // a new cluster: offsets start at 0 again
		produce(t, producer(t, addrs), &kgo.Record{Topic: "orders", Value: []byte(value)},
			orderRecord("orders", order{EventID: fmt.Sprintf("valid-%d", i), Amount: 1}))
		var out outcomes
		r := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Handlers: []idem.EventHandler{orderConsumer("orders", applyOrder)}}, &out)
		waitBounded(t, 20*time.Second, "the valid record", func() bool { return out.total() == 2 })
		r.shutdown(t)
	}
	got := deadLetters(t, pool)
	if len(got) != 2 || got[0].Record.Offset != 0 || got[1].Record.Offset != 0 ||
		string(got[0].Record.Value) != `{first poison` || string(got[1].Record.Value) != `{second poison` {
		t.Fatalf("dead letters %+v, want both poison records at offset 0", got)
	}
}

// noted is order with a free-text note the handler may quote in its error.
type noted struct {
	EventID string `json:"event_id"`
	Amount  int64  `json:"amount"`
	Note    string `json:"note"`
}

func notedConsumer(topic string, fn func(context.Context, pgx.Tx, noted) error) idem.EventHandler {
	return idem.Consume(idem.EventSpec[noted]{
		Topic: topic, Context: "billing",
		EventID: func(o noted) string { return o.EventID },
	}, fn)
}

// deadLetters reads every dead letter, raw, in id order.
func deadLetters(t testing.TB, pool *pgxpool.Pool) []*idem.DeadLetter {
	t.Helper()
	store := idem.NewStore(pool)
	var out []*idem.DeadLetter
	for id := int64(1); ; id++ {
		dl, err := store.DeadLetter(context.Background(), id)
		if errors.Is(err, idem.ErrDeadLetterNotFound) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, dl)
	}
}

// sameBytes compares bytes and null-ness: a null value must come back nil,
// an empty one empty.
func sameBytes(a, b []byte) bool { return (a == nil) == (b == nil) && bytes.Equal(a, b) }

// waitBounded is waitUntil with an explicit bound, for tests whose old
// failure mode was hanging forever.
func waitBounded(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
