package idem

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	mrand "math/rand/v2"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemgen/idemgen/internal/crash"
	"github.com/idemgen/idemgen/runtime/internal/db"
	"github.com/idemgen/idemgen/runtime/internal/relayhook"
	"github.com/idemgen/idemgen/runtime/internal/telemetry"
)

// leaseName names the outbox's row in idem_relay_leader. The table lives in
// the same schema as idem_outbox, so each schema elects its own relay.
const leaseName = "idem_outbox"

// RelayConfig configures a Relay. Zero fields take the defaults shown.
type RelayConfig struct {
	// BatchSize is the most rows claimed and produced at once (default 500).
	BatchSize int
	// Lease is the leadership lease (default 15s). The leader renews it
	// every Lease/3; a leader that cannot renew stops publishing at once,
	// and a standby takes over at most Lease after the leader's last
	// renewal, whether the leader died or is stuck (frozen, partitioned,
	// blackholed). Claimed rows carry the same lease.
	Lease time.Duration
	// PublishTimeout bounds one batch's produce-and-wait-for-acks (default
	// 10s). Records not acked by then are failed and retried later.
	PublishTimeout time.Duration
	// DBTimeout bounds each bookkeeping statement (claim, mark, reset),
	// always run with its own fresh context (default 5s, at most Lease).
	// The lease statements are bounded by the smaller of DBTimeout and
	// Lease/3, on the client and with statement_timeout on the server.
	DBTimeout time.Duration
	// MaxAttempts parks a row (status PARKED, last_error set) after this many
	// failed publishes that were its own: failures while other rows of the
	// same batch were acked (default 10). A broker-wide outage, where no row
	// of a batch gets through, never counts.
	MaxAttempts int
	// PollInterval is the fallback when no NOTIFY arrives (default 1s); a
	// commit normally wakes the relay at once. A standby also checks the
	// lease at least this often, so it takes over within PollInterval of
	// a leader's clean shutdown (which releases the lease).
	PollInterval time.Duration
	// MaxBackoff caps the jittered exponential backoff after a broker-wide
	// outage or a database error (default 30s). A leader that sees no
	// record acked for two whole leases hands the lease over (another relay
	// may reach the broker) and pauses a Lease before contending again.
	MaxBackoff time.Duration
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// OnLeader, if set, is called each time this relay becomes the leader,
	// after the takeover reset and before the first claim.
	OnLeader func()
	// MeterProvider and TracerProvider receive the relay's metrics and one
	// span per batch (nil: the global providers). See the README's "Metrics
	// and traces".
	MeterProvider  metric.MeterProvider
	TracerProvider trace.TracerProvider
}

// Relay publishes the outbox: PENDING → PUBLISHING → PUBLISHED (or PARKED).
//
// One relay per outbox leads at a time, elected with a lease row in
// idem_relay_leader; the others wait as standbys and take over when the
// lease expires (however the leader died or got stuck) or is released by a
// clean shutdown. On taking over, the new leader returns every PUBLISHING row
// to PENDING, then publishes in id order, so per-key order survives
// takeovers: the first delivery of each event is in order, and a takeover
// can only repeat a suffix, which consumers deduplicate by event id. Every
// claim and mark is conditional on the leader's lease token, so a leader
// that lost its lease can neither claim nor mark.
//
// A Relay holds only its configuration: Run may be called several times,
// even at once (each call contends for the lease on its own).
type Relay struct {
	store *Store
	pub   Publisher
	cfg   RelayConfig
	tel   *telemetry.Telemetry
	// noNotify turns LISTEN/NOTIFY off (set only by benchmarks through
	// runtime/internal/relayhook, to measure what NOTIFY buys).
	noNotify bool
	// onClaimed is called with the ids of each non-empty batch right after
	// its claim (set only by tests through runtime/internal/relayhook).
	onClaimed func(ids []int64)
}

func init() {
	relayhook.DisableNotify = func(r any) { r.(*Relay).noNotify = true }
	relayhook.OnClaimed = func(r any, hook func([]int64)) { r.(*Relay).onClaimed = hook }
}

// NewRelay returns a Relay publishing store's outbox through pub. It
// validates cfg and keeps a copy, filled with the defaults.
func NewRelay(store *Store, pub Publisher, cfg RelayConfig) (*Relay, error) {
	if store == nil {
		return nil, errors.New("new relay: store is nil")
	}
	if pub == nil {
		return nil, errors.New("new relay: publisher is nil")
	}
	for name, d := range map[string]time.Duration{"Lease": cfg.Lease, "PublishTimeout": cfg.PublishTimeout,
		"DBTimeout": cfg.DBTimeout, "PollInterval": cfg.PollInterval, "MaxBackoff": cfg.MaxBackoff} {
		if d < 0 {
			return nil, fmt.Errorf("new relay: %s is negative (%v)", name, d)
		}
	}
	if cfg.BatchSize < 0 || cfg.MaxAttempts < 0 {
		return nil, fmt.Errorf("new relay: BatchSize (%d) and MaxAttempts (%d) must not be negative", cfg.BatchSize, cfg.MaxAttempts)
	}
	if cfg.BatchSize == 0 {
		cfg.BatchSize = 500
	}
	if cfg.Lease == 0 {
		cfg.Lease = 15 * time.Second
	}
	if cfg.Lease < 30*time.Millisecond {
		return nil, fmt.Errorf("new relay: Lease %v is too short to renew", cfg.Lease)
	}
	if cfg.PublishTimeout == 0 {
		cfg.PublishTimeout = 10 * time.Second
	}
	if cfg.DBTimeout == 0 {
		cfg.DBTimeout = min(5*time.Second, cfg.Lease)
	}
	if cfg.DBTimeout > cfg.Lease {
		return nil, fmt.Errorf("new relay: DBTimeout %v is longer than Lease %v", cfg.DBTimeout, cfg.Lease)
	}
	if cfg.MaxAttempts == 0 {
		cfg.MaxAttempts = 10
	}
	if cfg.PollInterval == 0 {
		cfg.PollInterval = time.Second
	}
	if cfg.MaxBackoff == 0 {
		cfg.MaxBackoff = 30 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Relay{store: store, pub: pub, cfg: cfg, tel: telemetry.Must(cfg.MeterProvider, cfg.TracerProvider)}, nil
}

// Config returns the relay's configuration, defaults filled in.
func (r *Relay) Config() RelayConfig { return r.cfg }

// Run relays until ctx is cancelled. A standby waits for the lease; the
// leader finishes the batch in hand (publish bounded by PublishTimeout, its
// marks by the lease), releases the lease so a standby takes over at once,
// and returns nil. Run returns only when ctx is cancelled: database and
// broker failures are waited out with backoff.
func (r *Relay) Run(ctx context.Context) error {
	holder := newToken()
	log := r.cfg.Logger.With("relay", holder[:8])
	var bo backoff
	for {
		t, err := r.acquire(ctx, holder, log)
		if err != nil {
			return nil // ctx cancelled while standing by
		}
		bo.reset()
		stepDown := r.lead(ctx, t, log)
		t.end(stepDown)
		if ctx.Err() != nil {
			r.release(t, log)
			return nil
		}
		log.Warn("relay stepped down; standing by", "err", stepDown)
		wait := bo.next(r.cfg.PollInterval, r.cfg.MaxBackoff)
		if errors.Is(stepDown, errBrokerUnreachable) {
			// Hand the lease to a standby that may reach the broker (this
			// relay may be the only one partitioned from it), and give it a
			// whole Lease to take it before contending again. If no other
			// relay takes it, this one leads again after that pause, during
			// an outage in which nothing could be published anyway.
			r.release(t, log)
			wait = r.cfg.Lease
		}
		if err := sleepCtx(ctx, wait); err != nil {
			return nil
		}
	}
}

// term is one leadership term: a lease token and what this process can vouch
// for about it.
type term struct {
	token  string
	ctx    context.Context // done when the term ends: the lease is lost or given up
	cancel context.CancelCauseFunc
	wg     sync.WaitGroup // the renewer and listener

	mu       sync.Mutex
	deadline time.Time // send time of the last successful renewal + Lease
}

// valid reports whether this process may still act as the leader: the term
// is not over and the lease cannot have expired yet on the server (the
// server's expiry is at least deadline: it adds Lease to its own, later,
// clock). A process that was frozen past its deadline finds it invalid on
// waking, before it claims or produces anything more.
func (t *term) valid() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.ctx.Err() == nil && time.Now().Before(t.deadline)
}

// expired reports whether the term's deadline has passed: the lease may
// have expired on the server, and another relay may hold it by now. A
// statement that fails past it was most likely stalled with the process
// (frozen, paused), not failed by the database; the step-down says so.
func (t *term) expired() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return !time.Now().Before(t.deadline)
}

func (t *term) extend(deadline time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.deadline = deadline
}

func (t *term) end(cause error) {
	t.cancel(cause)
	t.wg.Wait()
}

var errLeaseLost = errors.New("relay lease lost")

// errBrokerUnreachable ends a term after no record was acked for
// outageHandover leases: another relay may reach the broker.
var errBrokerUnreachable = errors.New("the broker has not acked a record")

// outageHandover is how many leases of unbroken broker outage a leader
// waits out before it hands the lease over.
const outageHandover = 2

// acquire stands by until this relay holds the lease, and returns its term
// with the renewer (and the LISTEN connection) running. It returns an error
// only when ctx is cancelled.
func (r *Relay) acquire(ctx context.Context, holder string, log *slog.Logger) (*term, error) {
	var bo backoff
	standing := false
	for {
		token := newToken()
		sent := time.Now()
		got, remaining, err := r.tryAcquire(ctx, holder, token)
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		var wait time.Duration
		switch {
		case err != nil:
			log.Warn("relay lease: cannot reach the database; retrying", "err", err)
			wait = bo.next(r.cfg.PollInterval, r.cfg.MaxBackoff)
		case got:
			tctx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
			t := &term{token: token, ctx: tctx, cancel: cancel, deadline: sent.Add(r.cfg.Lease)}
			t.wg.Add(1)
			go r.renew(t, log)
			return t, nil
		default:
			bo.reset()
			if !standing {
				log.Info("relay standing by: another relay holds the lease", "expires_in", remaining)
				standing = true
			}
			// Wake just after the lease would expire if it is not renewed
			// (a standby takes over at most Lease, plus one round trip,
			// after the leader's last renewal), and at least every
			// PollInterval: a leader stopping cleanly releases the lease,
			// and a standby asleep until the expiry would leave the outbox
			// unpublished for up to a whole Lease.
			wait = min(remaining+10*time.Millisecond, r.cfg.PollInterval, r.cfg.Lease)
		}
		if err := sleepCtx(ctx, wait); err != nil {
			return nil, err
		}
	}
}

// leaseTimeout bounds each lease statement: a renewal that takes longer
// than a third of the lease is a failed renewal.
func (r *Relay) leaseTimeout() time.Duration { return min(r.cfg.DBTimeout, r.cfg.Lease/3) }

// inLeaseTx runs fn in a transaction bounded by leaseTimeout on the client
// (a fresh context: a cancelled caller must not stop a lease statement
// half-way) and by statement_timeout on the server. It runs at read
// committed whatever the session's default_transaction_isolation: its
// snapshot would be SetRelayStatementTimeout's, older than a renewal the
// lease statement waited for, and a standby's acquisition then failed with
// 40001 ("cannot reach the database") instead of standing by
// (TestSessionDefaultIsolationStandbyRacingARenewal). BEGIN is a round
// trip either way.
func (r *Relay) inLeaseTx(ctx context.Context, fn func(context.Context, *db.Queries) error) error {
	lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.leaseTimeout())
	defer cancel()
	tx, err := r.store.pool.BeginTx(lctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer rollback(lctx, tx)
	q := db.New(tx)
	if err := q.SetRelayStatementTimeout(lctx, strconv.FormatInt(r.leaseTimeout().Milliseconds(), 10)); err != nil {
		return fmt.Errorf("set statement_timeout: %w", err)
	}
	if err := fn(lctx, q); err != nil {
		return err
	}
	// A relay frozen here holds the lease row's lock: the server ends its
	// session after the idle-in-transaction timeout set above.
	crash.Point(lctx, "relay.lease-before-commit")
	if err := tx.Commit(lctx); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

func (r *Relay) tryAcquire(ctx context.Context, holder, token string) (bool, time.Duration, error) {
	var row db.AcquireRelayLeaseRow
	err := r.inLeaseTx(ctx, func(ctx context.Context, q *db.Queries) error {
		var err error
		row, err = q.AcquireRelayLease(ctx, db.AcquireRelayLeaseParams{
			Name: leaseName, Holder: holder, Token: token, LeaseSeconds: r.cfg.Lease.Seconds(),
		})
		return err
	})
	if err != nil {
		return false, 0, fmt.Errorf("acquire relay lease: %w", err)
	}
	return row.Acquired, time.Duration(row.RemainingMs) * time.Millisecond, nil
}

// renew extends the lease every Lease/3 until the term ends. A failed
// renewal (an error, a timeout, or the lease found taken over) ends the
// term at once: the leader stops publishing rather than act on a lease it
// cannot vouch for.
func (r *Relay) renew(t *term, log *slog.Logger) {
	defer t.wg.Done()
	tick := time.NewTicker(r.cfg.Lease / 3)
	defer tick.Stop()
	for {
		select {
		case <-t.ctx.Done():
			return
		case <-tick.C:
		}
		sent := time.Now()
		var n int64
		err := r.inLeaseTx(t.ctx, func(ctx context.Context, q *db.Queries) error {
			var err error
			n, err = q.RenewRelayLease(ctx, db.RenewRelayLeaseParams{Name: leaseName, Token: t.token, LeaseSeconds: r.cfg.Lease.Seconds()})
			if h := relayhook.InRenewal; h != nil {
				h()
			}
			return err
		})
		switch {
		case t.ctx.Err() != nil:
			return
		case err != nil:
			if t.expired() {
				// Failed past the deadline (a process frozen in the middle of
				// the renewal fails it on waking): the lease, not the
				// database, is what this term lost.
				err = fmt.Errorf("%w: %w", leaseCause(t), err)
			}
			t.cancel(fmt.Errorf("renew relay lease: %w", err))
			return
		case n == 0:
			t.cancel(fmt.Errorf("renew relay lease: %w: another relay took it over", errLeaseLost))
			return
		}
		t.extend(sent.Add(r.cfg.Lease))
	}
}

// release ends the lease of a leader that stops cleanly, so a standby takes
// over at once instead of after the lease.
func (r *Relay) release(t *term, log *slog.Logger) {
	err := r.inLeaseTx(t.ctx, func(ctx context.Context, q *db.Queries) error {
		_, err := q.ReleaseRelayLease(ctx, db.ReleaseRelayLeaseParams{Name: leaseName, Token: t.token})
		return err
	})
	if err != nil {
		log.Warn("relay lease not released; a standby takes over when it expires", "err", err)
	}
}

// dbCtx is the fresh, bounded context of one bookkeeping statement: never
// the caller's, which may just have expired.
func (r *Relay) dbCtx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), r.cfg.DBTimeout)
}

// lead relays while this relay holds the lease and ctx is not cancelled. It
// returns why the term ended (nil when ctx was cancelled).
func (r *Relay) lead(ctx context.Context, t *term, log *slog.Logger) error {
	wake := make(chan struct{}, 1)
	if !r.noNotify {
		t.wg.Add(1)
		go r.listen(t, wake, log)
	}
	dctx, cancel := r.dbCtx()
	n, err := db.New(readCommittedDB{r.store.pool}).ResetOutboxPublishing(dctx, db.ResetOutboxPublishingParams{Name: leaseName, Token: t.token})
	cancel()
	if err != nil {
		return fmt.Errorf("takeover reset: %w", err)
	}
	log.Info("relay is the leader", "reset_publishing", n)
	r.tel.RelayLeader(ctx, true)
	defer r.tel.RelayLeader(context.WithoutCancel(ctx), false)
	if r.cfg.OnLeader != nil {
		r.cfg.OnLeader()
	}

	var outage backoff
	var outageSince time.Time // start of the current unbroken outage
	lastReap := time.Now()
	for ctx.Err() == nil {
		if !t.valid() {
			return leaseCause(t)
		}
		res := r.relayBatch(t, log)
		if res.stepDown != nil {
			return res.stepDown
		}
		var wait time.Duration
		switch {
		case res.err != nil:
			log.Warn("relay batch failed; backing off", "err", res.err)
			wait = outage.next(r.cfg.PollInterval, r.cfg.MaxBackoff)
		case res.outage:
			// Nothing of the batch got through: the broker (or the way to
			// it) is down. Back off instead of hammering it, and charge no
			// row for it.
			wait = outage.next(100*time.Millisecond, r.cfg.MaxBackoff)
			log.Warn("broker outage: no record of the batch was acked; backing off",
				"rows", res.claimed, "first_error", res.firstErr, "retry_in", wait)
			if outageSince.IsZero() {
				outageSince = time.Now()
			}
			if d := time.Since(outageSince); d >= outageHandover*r.cfg.Lease {
				// Maybe only this relay is cut off from the broker: a standby
				// with a working path would publish while it backs off.
				return fmt.Errorf("%w for %v (last error: %s); handing the lease over", errBrokerUnreachable, d.Round(time.Millisecond), res.firstErr)
			}
		case res.noneAcked:
			// Every row was rejected (e.g. its topic does not exist): charged
			// to the rows, which park after MaxAttempts, but not retried in a
			// tight loop meanwhile.
			wait = outage.next(100*time.Millisecond, r.cfg.MaxBackoff)
			outageSince = time.Time{} // the broker answered
		default:
			outage.reset()
			if res.claimed > 0 {
				outageSince = time.Time{}
			}
		}
		r.tel.RelayBackoff(ctx, wait)
		if time.Since(lastReap) > r.cfg.Lease {
			// Takeover resets what predecessors left PUBLISHING; the reaper
			// returns rows whose row lease ran out without a takeover.
			dctx, cancel := r.dbCtx()
			if _, err := db.New(readCommittedDB{r.store.pool}).ReapOutbox(dctx); err != nil {
				log.Warn("reap failed", "err", err)
			}
			cancel()
			lastReap = time.Now()
		}
		if wait == 0 && res.claimed == r.cfg.BatchSize {
			continue // more is waiting
		}
		w := wake
		if wait == 0 {
			wait = r.cfg.PollInterval
		} else {
			w = nil // a commit during a backoff must not cut it short
		}
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
		case <-t.ctx.Done():
		case <-w:
		case <-timer.C:
		}
		timer.Stop()
	}
	return nil
}

func leaseCause(t *term) error {
	if err := context.Cause(t.ctx); err != nil {
		return err
	}
	return fmt.Errorf("%w: the lease may have expired before it could be renewed (was the process stopped?)", errLeaseLost)
}

type batchResult struct {
	claimed int
	// published, failed and parked count rows whose outcome was recorded.
	published, failed, parked int
	outage                    bool // no row acked, and some failed with a retriable error
	// noneAcked: no row acked and some went back to PENDING; back off
	// before the next claim even if they were all rejections (which count
	// toward parking), rather than claim the same rows again at once.
	noneAcked bool
	firstErr  string // for the log
	err       error  // the claim failed: back off and retry
	stepDown  error  // the term must end
}

// relayBatch claims one batch, publishes it and records the outcome. Once
// claimed, the batch is finished even if Run's ctx is cancelled meanwhile:
// the publish is bounded by PublishTimeout and the term, the marks are
// retried until they succeed or the term ends.
func (r *Relay) relayBatch(t *term, log *slog.Logger) (res batchResult) {
	dctx, cancel := r.dbCtx()
	rows, err := db.New(readCommittedDB{r.store.pool}).ClaimOutboxBatch(dctx, db.ClaimOutboxBatchParams{
		Name: leaseName, BatchSize: int32(r.cfg.BatchSize), ClaimToken: pgtype.Text{String: t.token, Valid: true},
		LeaseSeconds: r.cfg.Lease.Seconds(),
	})
	cancel()
	if err != nil {
		return batchResult{err: fmt.Errorf("claim outbox batch: %w", err)}
	}
	if len(rows) == 0 {
		return batchResult{}
	}
	// One span per batch that claimed rows (an idle poll is no batch). Its
	// context is t.ctx, so a traced Publisher's spans (franz-go's kotel
	// hooks) are its children and a lost lease still cancels the publish.
	spanCtx, done := r.tel.RelayBatchStart(t.ctx)
	defer func() { done(res.published, res.failed, res.parked, res.stepDown) }()
	if h := relayhook.AfterClaim; h != nil {
		h()
	}
	if h := r.onClaimed; h != nil {
		ids := make([]int64, len(rows))
		for i, row := range rows {
			ids[i] = row.ID
		}
		h(ids)
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i].ID < rows[j].ID })
	msgs := make([]Message, len(rows))
	// Rows whose headers cannot be sent as meant are not published: they
	// park (a permanent error) with last_error saying why, instead of going
	// out with their headers silently dropped.
	malformed := make([]error, len(rows))
	var send []Message
	for i, row := range rows {
		headers, err := decodeHeaders(row.Headers)
		if err != nil {
			malformed[i] = Permanent(fmt.Errorf("outbox row %d: %w", row.ID, err))
		}
		headers[EventIDHeader] = row.EventID
		msgs[i] = Message{ID: row.ID, EventID: row.EventID, Topic: row.Topic, Key: row.RecordKey, Value: row.Payload, Headers: headers}
		if err == nil {
			send = append(send, msgs[i])
		}
	}

	// Check the lease again right before producing: a leader frozen between
	// claim and produce must not produce after waking once its lease may
	// have passed to another relay. (A freeze between this check and the
	// produce call, or during a produce in flight, is the unavoidable
	// window: at most this one batch reaches the broker late, a duplicate
	// of rows the new leader republishes from the oldest unpublished id.)
	if !t.valid() {
		return batchResult{claimed: len(rows), stepDown: leaseCause(t)}
	}
	var sent []error
	if len(send) > 0 {
		pctx, cancel := context.WithTimeout(spanCtx, r.cfg.PublishTimeout)
		sent = r.pub.Publish(pctx, send)
		cancel()
	}
	if len(sent) != len(send) {
		// A Publisher that breaks its contract cannot tell us what was acked:
		// count nothing as published (the rows go out again, and consumers
		// dedupe) rather than guess.
		err := fmt.Errorf("publisher returned %d results for %d messages", len(sent), len(send))
		sent = make([]error, len(send))
		for i := range sent {
			sent[i] = err
		}
	}
	errs := malformed
	for i, j := 0, 0; i < len(errs); i++ {
		if errs[i] == nil {
			errs[i] = sent[j]
			j++
		}
	}
	crash.Point(t.ctx, "relay.after-publish")

	out := outcome(msgs, errs)
	res = batchResult{claimed: len(rows), outage: out.outage, noneAcked: out.noneAcked, firstErr: out.firstErr}
	published, failed := len(out.acked), len(out.failed)
	if err := r.recordUntilDone(t, &out, log); err != nil {
		res.stepDown = err
		return res
	}
	res.published, res.failed, res.parked = published, failed-out.parked, out.parked
	return res
}

// decodeHeaders returns an outbox row's headers (a JSON object) as record
// headers: string values as they are, any other value as its JSON text.
// Enqueue writes {}; other writers may put anything jsonb holds there, and
// none of it may be dropped silently. The map is never nil.
func decodeHeaders(raw []byte) (map[string]string, error) {
	headers := map[string]string{}
	if len(raw) == 0 {
		return headers, nil
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(raw, &obj); err != nil {
		return headers, fmt.Errorf("headers are not a JSON object: %w", err)
	}
	for k, v := range obj {
		var s string
		if json.Unmarshal(v, &s) == nil {
			headers[k] = s
		} else {
			headers[k] = string(v)
		}
	}
	return headers, nil
}

// batchOutcome is what one publish did, ready for the marks.
type batchOutcome struct {
	acked     []int64
	failed    []int64
	reasons   []string
	permanent []bool
	counted   []bool
	parked    int // set once the failures are recorded
	outage    bool
	noneAcked bool // no row acked, and some went back to PENDING (an outage, or rejections)
	firstErr  string
}

// outcome classifies a batch's results. A failure counts against its row's
// attempt budget only when other rows of the batch were acked: if nothing
// got through, the broker is down (or unreachable), which is no row's fault.
func outcome(msgs []Message, errs []error) batchOutcome {
	var o batchOutcome
	for i, m := range msgs {
		if errs[i] == nil {
			o.acked = append(o.acked, m.ID)
		}
	}
	unreachable := 0
	for i, m := range msgs {
		if errs[i] == nil {
			continue
		}
		perm := IsPermanent(errs[i])
		// A rejection is the broker's answer about this row (its topic does
		// not exist): the row's own failure even if nothing got through.
		rejected := !perm && IsRejected(errs[i])
		if !perm && !rejected {
			unreachable++
		}
		o.failed = append(o.failed, m.ID)
		o.reasons = append(o.reasons, relayErrorText(errs[i]))
		o.permanent = append(o.permanent, perm)
		o.counted = append(o.counted, !perm && (rejected || len(o.acked) > 0))
		if o.firstErr == "" {
			o.firstErr = o.reasons[len(o.reasons)-1]
		}
	}
	o.outage = len(o.acked) == 0 && unreachable > 0
	// Rows that go back to PENDING with nothing acked would be claimed
	// again at once: back off. (Rows parked as permanent are out of the
	// way; the next claim gets others, so no backoff for those.)
	o.noneAcked = len(o.acked) == 0 && len(o.failed) > countTrue(o.permanent)
	return o
}

func countTrue(permanent []bool) (n int) {
	for _, p := range permanent {
		if p {
			n++
		}
	}
	return n
}

// recordUntilDone records a batch's outcome, retrying with backoff (each try
// a fresh bounded context) while the database does not answer. The leader
// claims nothing more until the outcome is recorded: rows left PUBLISHING
// while newer rows went out would break per-key order. It gives up when the
// term ends or after a whole Lease of failures (which also bounds a
// shutdown); the term then ends, and the next leader (maybe this relay
// again) resets the rows: republishing them is a duplicate consumers skip.
func (r *Relay) recordUntilDone(t *term, out *batchOutcome, log *slog.Logger) error {
	var bo backoff
	giveUp := time.Now().Add(r.cfg.Lease)
	for {
		err := r.record(t.token, out, log)
		if err == nil || errors.Is(err, errLeaseLost) {
			return err
		}
		if t.ctx.Err() != nil {
			return fmt.Errorf("%w (the batch's outcome could not be recorded: %v)", leaseCause(t), err)
		}
		if time.Now().After(giveUp) {
			if t.expired() {
				// The term's deadline passed too: the process was most likely
				// frozen with the mark in flight (its context ran out during
				// the freeze), and the lease may be another relay's. Say so
				// rather than blame the database for a single failed try.
				return fmt.Errorf("%w (the batch's outcome could not be recorded: %v)", leaseCause(t), err)
			}
			return fmt.Errorf("the batch's outcome could not be recorded for %v; stepping down: %w", r.cfg.Lease, err)
		}
		wait := bo.next(50*time.Millisecond, min(r.cfg.MaxBackoff, r.cfg.Lease/3))
		log.Warn("recording the batch outcome failed; retrying", "err", err, "retry_in", wait)
		select {
		case <-t.ctx.Done():
		case <-time.After(wait):
		}
	}
}

// record marks acked rows PUBLISHED and failed ones PENDING or PARKED, each
// in one statement with its own fresh bounded context, and only while token
// is the lease's token and still holds the rows' claim. A refused mark
// (fewer rows than sent) means the lease was taken over: errLeaseLost.
func (r *Relay) record(token string, out *batchOutcome, log *slog.Logger) error {
	tok := pgtype.Text{String: token, Valid: true}
	q := db.New(readCommittedDB{r.store.pool})
	if len(out.acked) > 0 {
		ctx, cancel := r.dbCtx()
		if h := relayhook.BeforeMark; h != nil {
			h()
		}
		n, err := q.MarkOutboxPublished(ctx, db.MarkOutboxPublishedParams{Name: leaseName, Ids: out.acked, ClaimToken: tok})
		cancel()
		if err != nil {
			return fmt.Errorf("mark %d rows published: %w", len(out.acked), err)
		}
		if int(n) != len(out.acked) {
			return fmt.Errorf("%w: %d of %d published rows could not be marked; the new leader publishes them again",
				errLeaseLost, len(out.acked)-int(n), len(out.acked))
		}
		out.acked = nil // a retry must not mark them again
	}
	if len(out.failed) > 0 {
		if !out.outage {
			log.Warn("publish failed", "rows", len(out.failed), "first_error", out.firstErr)
		}
		ctx, cancel := r.dbCtx()
		res, err := q.MarkOutboxFailed(ctx, db.MarkOutboxFailedParams{
			Name: leaseName, MaxAttempts: int32(r.cfg.MaxAttempts), ClaimToken: tok,
			Ids: out.failed, Errors: out.reasons, Permanent: out.permanent, Counted: out.counted,
		})
		cancel()
		if err != nil {
			return fmt.Errorf("mark %d rows failed: %w", len(out.failed), err)
		}
		if int(res.Marked) != len(out.failed) {
			return fmt.Errorf("%w: %d of %d failed rows could not be marked", errLeaseLost, len(out.failed)-int(res.Marked), len(out.failed))
		}
		out.parked = int(res.Parked)
	}
	return nil
}

// maxRelayErrorText bounds a stored last_error.
const maxRelayErrorText = 2000

// relayErrorText is err's text as PostgreSQL's text type accepts it: valid
// UTF-8, no NUL (both are refused, and a refused last_error must not turn a
// publish failure into a bookkeeping failure), at most maxRelayErrorText bytes.
func relayErrorText(err error) string {
	s := []rune(err.Error())
	b := make([]rune, 0, len(s))
	for _, c := range s {
		switch c {
		case 0:
			b = append(b, '\\', '0')
		default:
			b = append(b, c) // invalid bytes are already U+FFFD
		}
	}
	out := string(b)
	if len(out) > maxRelayErrorText {
		cut := maxRelayErrorText
		for cut > 0 && !utf8RuneStart(out[cut]) {
			cut--
		}
		out = out[:cut] + "…"
	}
	if out == "" {
		out = "(empty error)"
	}
	return out
}

func utf8RuneStart(b byte) bool { return b&0xC0 != 0x80 }

// listen holds a LISTEN connection for the term and turns notifications into
// wake-ups. It is not leadership: when the connection fails, the relay
// polls every PollInterval while listen reconnects with backoff.
func (r *Relay) listen(t *term, wake chan<- struct{}, log *slog.Logger) {
	defer t.wg.Done()
	var bo backoff
	for t.ctx.Err() == nil {
		err := r.listenOnce(t.ctx, wake)
		if t.ctx.Err() != nil {
			return
		}
		wait := bo.next(r.cfg.PollInterval, r.cfg.MaxBackoff)
		log.Debug("relay LISTEN connection lost; polling meanwhile", "err", err, "retry_in", wait)
		if sleepCtx(t.ctx, wait) != nil {
			return
		}
	}
}

func (r *Relay) listenOnce(ctx context.Context, wake chan<- struct{}) error {
	actx, cancel := context.WithTimeout(ctx, r.cfg.DBTimeout)
	defer cancel()
	conn, err := r.store.pool.Acquire(actx)
	if err != nil {
		return err
	}
	// A LISTENing session must not go back to the pool.
	pc := conn.Hijack()
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = pc.Close(cctx)
	}()
	if err := db.New(pc).ListenOutbox(actx); err != nil {
		return err
	}
	notifyWake(wake) // a commit may have come while not listening
	for {
		if _, err := pc.WaitForNotification(ctx); err != nil {
			return err
		}
		notifyWake(wake)
	}
}

func notifyWake(wake chan<- struct{}) {
	select {
	case wake <- struct{}{}:
	default:
	}
}

// backoff is capped, jittered exponential backoff.
type backoff struct{ n int }

func (b *backoff) reset() { b.n = 0 }

// next returns a wait in [d/2, d], where d doubles from base on every call up
// to limit.
func (b *backoff) next(base, limit time.Duration) time.Duration {
	d := base
	for i := 0; i < b.n && d < limit; i++ {
		d *= 2
	}
	d = min(d, limit)
	b.n++
	if d <= 1 {
		return d
	}
	return d/2 + mrand.N(d/2+1)
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func newToken() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// RequeueParked returns the PARKED outbox rows with the given ids to
// PENDING, with a fresh attempt budget, and returns how many it requeued.
// They go out through the ordinary relay path: claimed under the leader's
// lease, published with their original event id (consumers still
// deduplicate), marked under the claim token. A requeued event is published
// after the newer events of its key that went out while it was parked.
func (s *Store) RequeueParked(ctx context.Context, ids ...int64) (int64, error) {
	return s.requeueParked(ctx, db.RequeueParkedOutboxParams{Ids: ids, Topics: []string{}})
}

// RequeueParkedTopic is RequeueParked for every parked row of topic.
func (s *Store) RequeueParkedTopic(ctx context.Context, topic string) (int64, error) {
	return s.requeueParked(ctx, db.RequeueParkedOutboxParams{Ids: []int64{}, Topics: []string{topic}})
}

// RequeueAllParked is RequeueParked for every parked row.
func (s *Store) RequeueAllParked(ctx context.Context) (int64, error) {
	return s.requeueParked(ctx, db.RequeueParkedOutboxParams{AllRows: true, Ids: []int64{}, Topics: []string{}})
}

func (s *Store) requeueParked(ctx context.Context, p db.RequeueParkedOutboxParams) (int64, error) {
	var n int64
	err := inTx(ctx, s.pool, func(q *db.Queries) error {
		var err error
		if n, err = q.RequeueParkedOutbox(ctx, p); err != nil || n == 0 {
			return err
		}
		// The NOTIFY trigger fires on INSERT only; wake the relay at commit.
		return q.NotifyOutbox(ctx)
	})
	if err != nil {
		return 0, fmt.Errorf("requeue parked outbox rows: %w", err)
	}
	return n, nil
}

// inTx runs fn in a transaction at read committed, whatever the session's
// default_transaction_isolation: under serializable the requeue's read of
// the parked rows took part in read/write dependencies with the relay's
// claims and failed with 40001 (TestRequeueParkedRacingRelay with a
// serializable default), an operator's command refused for the relay's
// doing.
func inTx(ctx context.Context, pool *pgxpool.Pool, fn func(*db.Queries) error) error {
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return err
	}
	defer rollback(ctx, tx)
	if err := fn(db.New(tx)); err != nil {
		return err
	}
	return tx.Commit(ctx)
}
