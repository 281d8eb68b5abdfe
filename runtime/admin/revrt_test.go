package admin_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/admin"
	"github.com/idemgen/idemgen/runtime/idem"
)

// Outside review (revrt): ReplayDeadLetter reads the dead letter before its
// transaction now. Many replays of one dead letter at once, each reading it
// before any marks it, still produce it exactly once; a failed produce rolls
// the mark back and a later replay produces it.
func TestRevrtConcurrentReplayProducesOnce(t *testing.T) {
	pool := migrated(t, func(c *pgxpool.Config) { c.MaxConns = 12 })
	for round := 0; round < 5; round++ {
		pgtest.Exec(t, pool, `DELETE FROM idem_dead_letters;
INSERT INTO idem_dead_letters (context, topic, kpartition, koffset, record_key, value, attempts, last_error)
VALUES ('billing', 'orders', 0, 7, 'k', 'v', 5, 'boom')`)
		id := pgtest.Count(t, pool, `SELECT id FROM idem_dead_letters`)
		a := admin.New(pool)
		var produced, replayed atomic.Int64
		const n = 10 // all read the row before the first one's produce (50ms) commits its mark
		var wg sync.WaitGroup
		errs := make(chan error, n)
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ok, err := a.ReplayDeadLetter(context.Background(), id, func(context.Context, admin.DeadLetter) error {
					produced.Add(1)
					time.Sleep(50 * time.Millisecond) // hold the mark while the others wait on it
					return nil
				})
				if err != nil {
					errs <- err
				}
				if ok {
					replayed.Add(1)
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		if produced.Load() != 1 || replayed.Load() != 1 {
			t.Fatalf("round %d: %d concurrent replays produced %d times, %d reported replayed; want 1 and 1", round, n, produced.Load(), replayed.Load())
		}
	}

	// A failed produce rolls the mark back: the next replay produces it.
	pgtest.Exec(t, pool, `DELETE FROM idem_dead_letters;
INSERT INTO idem_dead_letters (context, topic, kpartition, koffset, record_key, value, attempts, last_error)
VALUES ('billing', 'orders', 0, 8, 'k', 'v', 5, 'boom')`)
	id := pgtest.Count(t, pool, `SELECT id FROM idem_dead_letters`)
	a := admin.New(pool)
	if ok, err := a.ReplayDeadLetter(context.Background(), id, func(context.Context, admin.DeadLetter) error { return context.DeadlineExceeded }); ok || err == nil {
		t.Fatalf("failed produce: %v, %v; want false and an error", ok, err)
	}
	if ok, err := a.ReplayDeadLetter(context.Background(), id, func(context.Context, admin.DeadLetter) error { return nil }); !ok || err != nil {
		t.Fatalf("replay after a failed produce: %v, %v; want replayed", ok, err)
	}
}

// Outside review (revrt): a discard and a replay of one dead letter at once.
// Either the replay wins (produced once, then the discard deletes the
// replayed row) or the discard wins (nothing produced). Never produced after
// the discard returned, never produced twice.
func TestRevrtDiscardReplayRace(t *testing.T) {
	pool := migrated(t, nil)
	a := admin.New(pool)
	for round := 0; round < 20; round++ {
		pgtest.Exec(t, pool, `DELETE FROM idem_dead_letters;
INSERT INTO idem_dead_letters (context, topic, kpartition, koffset, record_key, value, attempts, last_error)
VALUES ('billing', 'orders', 0, 7, 'k', 'v', 5, 'boom')`)
		id := pgtest.Count(t, pool, `SELECT id FROM idem_dead_letters`)
		var discardedAt, producedAt atomic.Int64
		var wg sync.WaitGroup
		var replayOK, discardOK bool
		var replayErr, discardErr error
		wg.Add(2)
		go func() {
			defer wg.Done()
			replayOK, replayErr = a.ReplayDeadLetter(context.Background(), id, func(context.Context, admin.DeadLetter) error {
				producedAt.Store(time.Now().UnixNano())
				time.Sleep(time.Duration(round%3) * 10 * time.Millisecond)
				return nil
			})
		}()
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(round%4) * 3 * time.Millisecond)
			discardOK, discardErr = a.DiscardDeadLetter(context.Background(), id)
			discardedAt.Store(time.Now().UnixNano())
		}()
		wg.Wait()
		if replayErr != nil || discardErr != nil {
			t.Fatalf("round %d: replay %v, discard %v", round, replayErr, discardErr)
		}
		if !discardOK {
			t.Fatalf("round %d: the discard found no row (replay %v): a replayed row is still there to delete", round, replayOK)
		}
		if replayOK != (producedAt.Load() != 0) {
			t.Fatalf("round %d: replay reported %v but produced=%v", round, replayOK, producedAt.Load() != 0)
		}
		if replayOK && producedAt.Load() > discardedAt.Load() {
			t.Fatalf("round %d: produced after the discard returned", round)
		}
		if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
			t.Fatalf("round %d: %d rows left after a discard", round, n)
		}
	}
}

// Outside review (revrt): a record dead-lettered on its first attempt for an
// event id PostgreSQL refuses (invalid UTF-8, and too large for the index)
// keeps its raw bytes, and admin replay produces exactly those bytes: key
// with NUL and 0xff, value, repeated headers in order, a null header value,
// a header name that is not UTF-8.
func TestRevrtUnstorableIDReplayedByteForByte(t *testing.T) {
	pool := migrated(t, nil)
	p, err := idem.NewProcessor(idem.NewStore(pool), idem.ProcessorConfig{
		Retry:  idem.RetryPolicy{MaxAttempts: 5, Initial: time.Millisecond, Max: 2 * time.Millisecond},
		Outage: idem.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
	})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	h := idem.Consume(idem.EventSpec[map[string]any]{Topic: "events", Context: "raw"},
		func(context.Context, pgx.Tx, map[string]any) error { calls.Add(1); return nil })
	ids := []string{"\xff\xfe\x80", idRand()}
	for i, id := range ids {
		rec := &idem.Record{Topic: "events", Partition: 3, Offset: int64(10 + i),
			Key: []byte("k\x00\xff"), Value: []byte(`{"a":1}`),
			Headers: []idem.RecordHeader{
				{Key: "x-rep", Value: []byte("1")},
				{Key: idem.EventIDHeader, Value: []byte(id)},
				{Key: "x-rep", Value: []byte("\x00\xff")},
				{Key: "x-null", Value: nil},
				{Key: "n\xffame", Value: []byte{}},
			}}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		o, err := p.Process(ctx, &h, rec)
		cancel()
		if err != nil || o != idem.DeadLettered {
			t.Fatalf("id %d: %v, %v; want dead-lettered", i, o, err)
		}
		var dlID int64
		var attempts int
		if err := pool.QueryRow(context.Background(), `SELECT id, attempts FROM idem_dead_letters WHERE koffset = $1`, rec.Offset).Scan(&dlID, &attempts); err != nil {
			t.Fatal(err)
		}
		if attempts != 1 {
			t.Errorf("id %d: %d attempts, want 1", i, attempts)
		}
		var got admin.DeadLetter
		ok, err := admin.New(pool).ReplayDeadLetter(context.Background(), dlID, func(_ context.Context, d admin.DeadLetter) error {
			got = d
			return nil
		})
		if !ok || err != nil {
			t.Fatalf("id %d: replay %v, %v", i, ok, err)
		}
		if got.Topic != rec.Topic || got.Partition != rec.Partition || got.Offset != rec.Offset ||
			!bytes.Equal(got.Key, rec.Key) || !bytes.Equal(got.Value, rec.Value) || len(got.Headers) != len(rec.Headers) {
			t.Fatalf("id %d: produced %+v, want the record %+v", i, got, rec)
		}
		for j, hd := range rec.Headers {
			g := got.Headers[j]
			if g.Key != hd.Key || !bytes.Equal(g.Value, hd.Value) || (g.Value == nil) != (hd.Value == nil) {
				t.Errorf("id %d header %d: produced %q=%q (nil %v), want %q=%q (nil %v)", i, j, g.Key, g.Value, g.Value == nil, hd.Key, hd.Value, hd.Value == nil)
			}
		}
	}
	if calls.Load() != 0 {
		t.Errorf("handler ran %d times", calls.Load())
	}
}

// idRand is an ASCII event id too large for the processed-event index.
func idRand() string {
	b := make([]byte, 1600)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
