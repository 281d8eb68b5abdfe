package admin_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/admin"
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
