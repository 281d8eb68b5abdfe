package idem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/runtime/internal/db"
)

// JanitorDisabled, as one of JanitorConfig's ages, turns that kind of
// retention off: those rows are kept until something else deletes them.
const JanitorDisabled time.Duration = -1

// Janitor defaults; see JanitorConfig.
const (
	DefaultJanitorInterval    = 5 * time.Minute
	DefaultJanitorBatchSize   = 1000
	DefaultProcessedEventAge  = 7 * 24 * time.Hour
	DefaultPublishedOutboxAge = 24 * time.Hour
	DefaultDeadLetterAge      = 30 * 24 * time.Hour
)

// JanitorConfig configures a Janitor. A zero field takes its documented
// default; an age set to JanitorDisabled (any negative duration) turns that
// kind of retention off.
type JanitorConfig struct {
	// Interval is the time between runs (default 5m). Each wait is
	// Interval ± a random amount up to Jitter, so replicas started together
	// do not all wake at once.
	Interval time.Duration
	// Jitter bounds the random part of each wait (default Interval/10;
	// negative: none). It must be smaller than Interval.
	Jitter time.Duration
	// BatchSize is the most rows one DELETE removes (default 1000). Each batch
	// is its own short transaction, so retention never holds locks on many
	// rows or keeps a long transaction open against vacuum.
	BatchSize int

	// ExpiredKeyAge is how long after its expiry an idempotency key is
	// deleted (default 0: as soon as it has expired; an expired key is never
	// replayed either way, so keeping it longer only helps forensics).
	ExpiredKeyAge time.Duration
	// ProcessedEventAge is how long a consumer's processed-event row is kept
	// (default 7 days, Kafka's default topic retention). It must exceed the
	// longest time a record can be redelivered — the topic's retention, or
	// how far back anyone may reset a group's offsets: a deleted row no
	// longer deduplicates its event.
	ProcessedEventAge time.Duration
	// PublishedOutboxAge is how long a PUBLISHED outbox row is kept after
	// publishing (default 24h). PENDING, PUBLISHING and PARKED rows are never
	// deleted by the janitor.
	PublishedOutboxAge time.Duration
	// DeadLetterAge is how long a dead letter is kept (default 30 days): the
	// time operators have to replay or discard it.
	DeadLetterAge time.Duration

	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// OnRun, if set, is called after every run with what it did; metrics hook
	// in here.
	OnRun func(JanitorRun)
}

// JanitorRun is what one janitor run did.
type JanitorRun struct {
	// Skipped: another janitor (another replica) was running; this one
	// deleted nothing.
	Skipped bool
	// Rows deleted per kind.
	ExpiredKeys, ProcessedEvents, PublishedOutbox, DeadLetters int64
	// Batches is the number of DELETE statements run.
	Batches  int
	Duration time.Duration
	// Err is the error that ended the run early, if any.
	Err error
}

// Deleted is the total number of rows the run deleted.
func (r JanitorRun) Deleted() int64 {
	return r.ExpiredKeys + r.ProcessedEvents + r.PublishedOutbox + r.DeadLetters
}

// Janitor deletes what idemgen no longer needs: expired idempotency keys,
// old processed-event rows, old PUBLISHED outbox rows and old dead letters.
// Run one in every replica: per run, a session-level advisory lock lets only
// one of them work while the others skip that run.
//
// Each batch is one DELETE of at most BatchSize rows, chosen oldest first
// through an index on the age column and with SKIP LOCKED (a row in use by
// a request or a relay is left for the next run), committed on its own.
// Cancelling the context stops a run between batches; committed batches stay.
type Janitor struct {
	store *Store
	cfg   JanitorConfig
}

// NewJanitor validates cfg, fills in its defaults and returns a Janitor on
// store. The configuration is copied: later changes to cfg have no effect.
func NewJanitor(store *Store, cfg JanitorConfig) (*Janitor, error) {
	if store == nil {
		return nil, errors.New("new janitor: store is nil")
	}
	if cfg.Interval < 0 {
		return nil, fmt.Errorf("new janitor: Interval %v is negative", cfg.Interval)
	}
	if cfg.BatchSize < 0 {
		return nil, fmt.Errorf("new janitor: BatchSize %d is negative", cfg.BatchSize)
	}
	if cfg.Interval == 0 {
		cfg.Interval = DefaultJanitorInterval
	}
	switch {
	case cfg.Jitter == 0:
		cfg.Jitter = cfg.Interval / 10
	case cfg.Jitter < 0:
		cfg.Jitter = 0
	case cfg.Jitter >= cfg.Interval:
		return nil, fmt.Errorf("new janitor: Jitter %v must be smaller than Interval %v", cfg.Jitter, cfg.Interval)
	}
	if cfg.BatchSize == 0 {
		cfg.BatchSize = DefaultJanitorBatchSize
	}
	// ExpiredKeyAge's default is 0, its zero value: nothing to fill in.
	if cfg.ProcessedEventAge == 0 {
		cfg.ProcessedEventAge = DefaultProcessedEventAge
	}
	if cfg.PublishedOutboxAge == 0 {
		cfg.PublishedOutboxAge = DefaultPublishedOutboxAge
	}
	if cfg.DeadLetterAge == 0 {
		cfg.DeadLetterAge = DefaultDeadLetterAge
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Janitor{store: store, cfg: cfg}, nil
}

// Config returns the janitor's configuration with its defaults filled in.
func (j *Janitor) Config() JanitorConfig { return j.cfg }

// Run runs the janitor until ctx is cancelled: a first run after a random
// delay of up to Jitter, then one every Interval ± Jitter. A failed run is
// logged and retried at the next interval (a database that is down must not
// stop retention for good). It returns nil when ctx is cancelled.
func (j *Janitor) Run(ctx context.Context) error {
	wait := j.jitter(0)
	for {
		if err := sleep(ctx, wait); err != nil {
			return nil
		}
		run, err := j.RunOnce(ctx)
		if ctx.Err() != nil {
			return nil
		}
		switch {
		case err != nil:
			j.cfg.Logger.Warn("janitor run failed; retrying at the next interval", "err", err,
				"deleted", run.Deleted())
		case run.Skipped:
			j.cfg.Logger.Debug("janitor run skipped: another janitor is running")
		default:
			j.cfg.Logger.Info("janitor run", "expired_keys", run.ExpiredKeys, "processed_events", run.ProcessedEvents,
				"published_outbox", run.PublishedOutbox, "dead_letters", run.DeadLetters,
				"batches", run.Batches, "duration", run.Duration)
		}
		wait = j.jitter(j.cfg.Interval)
	}
}

// jitter returns base ± a random amount up to Jitter, never negative.
func (j *Janitor) jitter(base time.Duration) time.Duration {
	if j.cfg.Jitter <= 0 {
		return base
	}
	d := base + rand.N(2*j.cfg.Jitter+1) - j.cfg.Jitter
	return max(d, 0)
}

// RunOnce runs the janitor once, now, and returns what it did. If another
// janitor holds the lock it returns at once with Skipped set. On
// cancellation it stops between batches and returns ctx's error together
// with the counts of the batches that committed.
func (j *Janitor) RunOnce(ctx context.Context) (run JanitorRun, err error) {
	start := time.Now()
	defer func() {
		run.Duration = time.Since(start)
		run.Err = err
		if j.cfg.OnRun != nil {
			j.cfg.OnRun(run)
		}
	}()
	conn, err := j.store.pool.Acquire(ctx)
	if err != nil {
		return run, fmt.Errorf("janitor: acquire connection: %w", err)
	}
	q := db.New(conn)
	got, err := q.TryJanitorLock(ctx)
	if err != nil {
		conn.Release()
		return run, fmt.Errorf("janitor: take lock: %w", err)
	}
	if !got {
		conn.Release()
		run.Skipped = true
		return run, nil
	}
	defer unlockJanitor(ctx, conn, j.cfg.Logger)

	// Batches run on the locked connection, each DELETE in a transaction
	// of its own at read committed whatever the session's
	// default_transaction_isolation: the DELETEs skip rows locked by
	// requests (SKIP LOCKED) and re-check a row another transaction changed
	// and committed after the statement began (a key taken over and live
	// again), which repeatable read and serializable refuse with 40001 and
	// which failed the whole run (TestSessionDefaultIsolationJanitorRacingATakeover).
	kinds := []struct {
		name    string
		age     time.Duration
		deleted *int64
		batch   func(ctx context.Context, q *db.Queries) (int64, error)
	}{
		{"expired keys", j.cfg.ExpiredKeyAge, &run.ExpiredKeys, func(ctx context.Context, q *db.Queries) (int64, error) {
			return q.DeleteKeysExpiredAgo(ctx, db.DeleteKeysExpiredAgoParams{
				GraceSeconds: j.cfg.ExpiredKeyAge.Seconds(), BatchSize: int32(j.cfg.BatchSize)})
		}},
		{"processed events", j.cfg.ProcessedEventAge, &run.ProcessedEvents, func(ctx context.Context, q *db.Queries) (int64, error) {
			return q.DeleteProcessedEventsBefore(ctx, db.DeleteProcessedEventsBeforeParams{
				Before: before(j.cfg.ProcessedEventAge), BatchSize: int32(j.cfg.BatchSize)})
		}},
		{"published outbox rows", j.cfg.PublishedOutboxAge, &run.PublishedOutbox, func(ctx context.Context, q *db.Queries) (int64, error) {
			return q.DeletePublishedOutbox(ctx, db.DeletePublishedOutboxParams{
				Before: before(j.cfg.PublishedOutboxAge), BatchSize: int32(j.cfg.BatchSize)})
		}},
		{"dead letters", j.cfg.DeadLetterAge, &run.DeadLetters, func(ctx context.Context, q *db.Queries) (int64, error) {
			return q.DeleteDeadLettersBefore(ctx, db.DeleteDeadLettersBeforeParams{
				Before: before(j.cfg.DeadLetterAge), BatchSize: int32(j.cfg.BatchSize)})
		}},
	}
	for _, k := range kinds {
		if k.age < 0 {
			continue // JanitorDisabled
		}
		for {
			if err := ctx.Err(); err != nil {
				return run, err
			}
			n, err := j.batch(ctx, conn, k.batch)
			if err != nil {
				if ctxErr := ctx.Err(); ctxErr != nil {
					return run, ctxErr
				}
				return run, fmt.Errorf("janitor: delete %s: %w", k.name, err)
			}
			run.Batches++
			*k.deleted += n
			if n < int64(j.cfg.BatchSize) {
				break
			}
		}
	}
	return run, nil
}

// batch runs one batch on conn in a read committed transaction of its own.
func (j *Janitor) batch(ctx context.Context, conn *pgxpool.Conn, fn func(context.Context, *db.Queries) (int64, error)) (int64, error) {
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return 0, err
	}
	n, err := fn(ctx, db.New(tx))
	if err != nil {
		rollback(ctx, tx)
		return 0, err
	}
	// A batch whose DELETE completed commits even if ctx ended meanwhile,
	// as the statement alone (autocommit) did: a cancellation stops the
	// run after the batch in progress, not in its COMMIT.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	if err := tx.Commit(cctx); err != nil {
		rollback(ctx, tx)
		return 0, err
	}
	return n, nil
}

// before is now minus age, on the application's clock. (Keys use the
// database's clock: see DeleteKeysExpiredAgo.)
func before(age time.Duration) pgtype.Timestamptz {
	return pgtype.Timestamptz{Time: time.Now().Add(-age), Valid: true}
}

// unlockJanitor releases the janitor lock and returns conn to the pool. It
// runs even when ctx was cancelled. If the unlock cannot be confirmed, the
// connection is closed instead of returned: a pooled connection still
// holding the lock would stop every janitor for as long as it lives.
func unlockJanitor(ctx context.Context, conn *pgxpool.Conn, logger *slog.Logger) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	released, err := db.New(conn).JanitorUnlock(ctx)
	if err != nil || !released {
		logger.Warn("janitor: could not release its lock; closing the connection, which releases it", "err", err)
		_ = conn.Hijack().Close(ctx)
		return
	}
	conn.Release()
}
