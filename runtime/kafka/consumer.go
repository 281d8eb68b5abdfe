// Package kafka runs idemgen's consumers and outbox relay on Kafka with
// franz-go (kgo). The idem package holds the broker-agnostic logic; this
// package adapts it: it polls records, hands them to an idem.Processor, and
// commits a record's offset only after its database transaction committed.
package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemgen/idemgen/internal/crash"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/internal/guardlane"
)

// ConsumerConfig configures a Consumer.
type ConsumerConfig struct {
	// Brokers are the seed brokers, e.g. []string{"127.0.0.1:9092"}.
	Brokers []string
	// Group is the consumer group.
	Group string
	// Handlers are the generated handlers (e.g. the package's
	// IdemConsumers(...)); their topics are consumed. Several handlers may
	// share a topic if their contexts differ; each applies each record in its
	// own context.
	Handlers []idem.EventHandler
	// BatchSize > 1 enables batch mode: up to BatchSize records of one
	// partition are applied in one transaction with one multi-row dedupe
	// insert. Default 1: one transaction per record.
	BatchSize int
	// Retry is the budget of a record's own failures (handler error, panic)
	// before it is dead-lettered.
	Retry idem.RetryPolicy
	// Outage is the wait between tries while PostgreSQL is unavailable;
	// such failures use no retry budget (see idem.ProcessorConfig).
	Outage idem.Backoff
	// StorageTimeout bounds each of the processor's own statements (see
	// idem.ProcessorConfig). Default 10s.
	StorageTimeout time.Duration
	// IdleInTransactionTimeout bounds how long a member frozen mid-record
	// keeps its locks (see idem.ProcessorConfig). Default 2m.
	IdleInTransactionTimeout time.Duration
	// CommitInterval is how often marked offsets are committed (default 1s,
	// at least 100ms, kgo's minimum).
	// Offsets are also committed on partition revocation and on shutdown.
	CommitInterval time.Duration
	// MaxPollRecords is how many records a partition's worker may have
	// queued behind the ones it is applying before its partition is paused
	// (default 500). Each poll takes everything kgo has buffered, so a
	// partition's queue grows by whole fetch responses: a worker holds at
	// most the records it is applying, fewer than MaxPollRecords queued, and
	// the partition's part of one more fetch response (up to about
	// FetchMaxPartitionBytes, 1 MB by default, or one record batch if that
	// is larger; two if both arrive before an idle worker wakes), besides
	// what kgo itself buffers (one fetch response per broker, up to
	// FetchMaxBytes). A smaller value pauses a partition that is behind sooner and
	// more often; it does not bound the records taken per poll.
	MaxPollRecords int
	// OnRecord, if set, is called after each record is done (applied, a
	// duplicate, or dead-lettered), once per handler, before its offset is
	// marked. Use it for metrics or logging; it runs on the partition's
	// goroutine, so keep it fast. A runtime.Goexit in it (t.FailNow in a
	// test) ends that goroutine: the partition's records not yet marked
	// are fetched again (duplicates of those applied), and an error is
	// logged; a panic in it ends the process.
	OnRecord func(h *idem.EventHandler, rec *idem.Record, o idem.Outcome)
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// MeterProvider and TracerProvider receive the processor's metrics and
	// spans (see idem.ProcessorConfig); nil: the global providers.
	MeterProvider  metric.MeterProvider
	TracerProvider trace.TracerProvider
	// ClientOpts are extra kgo options (TLS, SASL, ConsumeResetOffset, ...).
	// Run sets FetchMaxWait to 100ms (kgo's default is 5s) before them, so
	// they may set another (see Run).
	// The options the delivery guarantee rests on are always set by Run and
	// must not be overridden: ConsumerGroup, ConsumeTopics, AutoCommitMarks,
	// BlockRebalanceOnPoll, OnPartitionsAssigned, OnPartitionsRevoked,
	// OnPartitionsLost. Pausing the consumed partitions
	// (PauseFetchPartitions) is Run's too.
	ClientOpts []kgo.Opt
}

// Consumer consumes the topics of a set of generated handlers with
// exactly-once effects on PostgreSQL.
//
// Per record: in one transaction, the processed-event row and the handler's
// writes commit (or a duplicate is skipped); only then is the record's offset
// marked, and marked offsets are committed per partition, in order, every
// CommitInterval, on revocation and on shutdown. Each partition is applied
// by a worker goroutine of its own, records in order, independently of the
// others: one stuck partition holds up no other (see Run).
type Consumer struct {
	cfg     ConsumerConfig
	proc    *idem.Processor
	byTopic map[string][]*idem.EventHandler
	topics  []string
	logger  *slog.Logger
	started atomic.Bool
	running atomic.Pointer[run] // the Run in progress, for tests
	// beforePurge, when set (tests), is called by the poll loop just
	// before a re-created topic is purged from the client.
	beforePurge func(topic string)
}

// NewConsumer validates cfg and returns a Consumer on store; it keeps a copy
// of cfg. It opens nothing: Run opens the Kafka client and closes it when it
// returns, so a Consumer that is never run holds no resources.
func NewConsumer(store *idem.Store, cfg ConsumerConfig) (*Consumer, error) {
	if cfg.Group == "" || len(cfg.Brokers) == 0 || len(cfg.Handlers) == 0 {
		return nil, errors.New("kafka consumer: Brokers, Group and Handlers are required")
	}
	if cfg.BatchSize < 0 || cfg.MaxPollRecords < 0 || cfg.CommitInterval < 0 {
		return nil, errors.New("kafka consumer: BatchSize, MaxPollRecords and CommitInterval must not be negative")
	}
	// kgo refuses an autocommit interval below 100ms, but only when Run
	// opens the client; refuse it here, where the config is validated.
	if cfg.CommitInterval > 0 && cfg.CommitInterval < minCommitInterval {
		return nil, fmt.Errorf("kafka consumer: CommitInterval %v is below the minimum %v", cfg.CommitInterval, minCommitInterval)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	proc, err := idem.NewProcessor(store, idem.ProcessorConfig{
		Retry: cfg.Retry, Outage: cfg.Outage, StorageTimeout: cfg.StorageTimeout, Logger: cfg.Logger,
		MeterProvider: cfg.MeterProvider, TracerProvider: cfg.TracerProvider,
		IdleInTransactionTimeout: cfg.IdleInTransactionTimeout,
	})
	if err != nil {
		return nil, fmt.Errorf("kafka consumer: %w", err)
	}
	cfg.Handlers = append([]idem.EventHandler(nil), cfg.Handlers...)
	cfg.Brokers = append([]string(nil), cfg.Brokers...)
	cfg.ClientOpts = append([]kgo.Opt(nil), cfg.ClientOpts...)
	cfg.BatchSize = max(cfg.BatchSize, 1)
	if cfg.MaxPollRecords == 0 {
		cfg.MaxPollRecords = 500
	}
	if cfg.CommitInterval == 0 {
		cfg.CommitInterval = time.Second
	}
	c := &Consumer{cfg: cfg, proc: proc, byTopic: map[string][]*idem.EventHandler{}, logger: cfg.Logger}
	seen := map[[2]string]bool{}
	for i := range c.cfg.Handlers {
		h := &c.cfg.Handlers[i]
		if h.Topic == "" || h.Context == "" {
			return nil, fmt.Errorf("kafka consumer: handler %d has no Topic or Context", i)
		}
		// Two handlers with one context on one topic would each see the
		// other's processed-event rows and skip half the events.
		if seen[[2]string{h.Topic, h.Context}] {
			return nil, fmt.Errorf("kafka consumer: two handlers of topic %q share context %q", h.Topic, h.Context)
		}
		seen[[2]string{h.Topic, h.Context}] = true
		if _, ok := c.byTopic[h.Topic]; !ok {
			c.topics = append(c.topics, h.Topic)
		}
		c.byTopic[h.Topic] = append(c.byTopic[h.Topic], h)
	}
	return c, nil
}

// defaultFetchMaxWait is the consumer's FetchMaxWait unless ClientOpts set
// one (see Run).
const defaultFetchMaxWait = 100 * time.Millisecond

// minCommitInterval is kgo's lower bound on AutoCommitInterval.
const minCommitInterval = 100 * time.Millisecond

// run is the state of one Run: the client and the partition workers.
type run struct {
	*Consumer
	client *kgo.Client
	ctx    context.Context // Run's: the workers' contexts derive from it (its values, its end)

	mu      sync.Mutex
	workers map[topicPartition]*worker // the assigned partitions' workers, started by their first records
	wake    context.CancelFunc         // cancels the poll in progress; nil between polls
	woken   bool                       // wakePoll was called between polls: end the next one at once

	// Fetch failures, touched by Run's goroutine only.
	fetchFailures int                      // polls in a row that failed and returned nothing
	unknownID     map[string]*unknownSpell // topics answering UNKNOWN_TOPIC_ID
}

// unknownSpell is a run of UNKNOWN_TOPIC_ID answers for one topic: the
// first and the latest.
type unknownSpell struct{ since, last time.Time }

// topicPartition names one partition.
type topicPartition struct {
	topic     string
	partition int32
}

// Run consumes until ctx is cancelled, then finishes or rolls back the
// records in hand, commits the offsets of committed transactions, leaves the
// group and closes the client. It returns nil after a clean shutdown. A
// Consumer runs once.
//
// Each assigned partition has a worker goroutine of its own that applies the
// partition's records in order; the poll loop only hands each poll's records
// to their partitions' workers and polls again. So a partition stuck on one
// record (a handler retrying with backoff, a lock the record waits for, the
// database down) holds up only that partition: the others go on being
// fetched, applied and committed. Each poll takes all that kgo has buffered
// (PollFetches), so a pause drops nothing that was already fetched and
// buffered. A worker that is behind (applying records, or with records
// queued) and has at least MaxPollRecords queued has its partition paused
// (PauseFetchPartitions: kgo fetches nothing more for it, without moving the
// fetch position) and resumed when the worker takes the queued records. The
// one fetch a pause wastes is the partition's part of a fetch response in
// flight to its broker when it is paused: kgo buffers that response and
// drops the partition's records from it at the next poll if the partition
// is still paused; they are fetched again after the resume. So a partition
// catching up on a backlog is fetched at most about twice per record
// (TestAttackPWPauseRefetchAmplification), where polling MaxPollRecords at
// a time dropped the rest of every fetch response at each pause. A resumed
// partition is fetched again once the fetch in flight to its broker ends,
// which for a broker whose other partitions are idle is a long poll of
// FetchMaxWait: Run sets it to 100ms (kgo's default is 5s) unless
// ClientOpts set it.
//
// Rebalances wait only while a poll's records are handed out
// (BlockRebalanceOnPoll, AllowRebalance right after), never for records to
// be applied. A revoke cancels the workers of the revoked partitions only
// and waits for them: the record in hand rolls back and nothing after it is
// marked; then the marked offsets, each that of a committed transaction, are
// committed, and the new owner starts there. Partitions not revoked
// (cooperative rebalancing) keep running. Lost partitions' workers are
// cancelled and waited for too; kgo drops their marks. A revoke, a loss or
// the shutdown waits at most 10s (stopWait) for a cancelled worker: one
// whose handler ignores its context would otherwise stop the whole member
// (kgo polls nothing while a revoke runs) or keep Run from returning. After
// it, the worker is abandoned: an error is logged, it marks nothing more,
// its partition is resumed, and its goroutine ends when its handler
// returns.
//
// A runtime.Goexit in OnRecord ends the partition's worker: the poll loop
// moves the partition's fetch position back to its first record not marked
// (SetOffsets, before AllowRebalance, while the partition is surely ours),
// drops what the worker had queued, and a fresh worker starts with the
// partition's next records.
func (c *Consumer) Run(ctx context.Context) error {
	if !c.started.CompareAndSwap(false, true) {
		return errors.New("kafka consumer: Run called twice")
	}
	r := &run{Consumer: c, ctx: ctx, workers: map[topicPartition]*worker{}, unknownID: map[string]*unknownSpell{}}
	// A default the application's ClientOpts, after it, override: a
	// partition resumed after a pause waits for the fetch in flight to its
	// broker, up to FetchMaxWait when the broker's other partitions are
	// idle, and a partition behind on a backlog is paused and resumed once
	// a poll. kgo's default of 5s made such a partition crawl
	// (BenchmarkConsumerSkewed: 546 rec/s against 2,578 on main, per
	// record); 500ms (the Java client's) still left batch mode at a third
	// of main. The price is an idle consumer's fetch to each broker every
	// 100ms.
	opts := []kgo.Opt{kgo.FetchMaxWait(defaultFetchMaxWait)}
	opts = append(opts, c.cfg.ClientOpts...)
	opts = append(opts,
		kgo.SeedBrokers(c.cfg.Brokers...),
		kgo.ConsumerGroup(c.cfg.Group),
		kgo.ConsumeTopics(c.topics...),
		kgo.AutoCommitMarks(),
		kgo.AutoCommitInterval(c.cfg.CommitInterval),
		kgo.BlockRebalanceOnPoll(),
		kgo.OnPartitionsAssigned(r.onAssigned),
		kgo.OnPartitionsRevoked(r.onRevoked),
		kgo.OnPartitionsLost(r.onLost),
	)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return fmt.Errorf("kafka consumer: %w", err)
	}
	r.client = cl
	c.running.Store(r)
	defer r.close()
	monitorDone := make(chan struct{})
	defer func() { <-monitorDone }()
	monitorCtx, stopMonitor := context.WithCancel(ctx)
	defer stopMonitor()
	go func() {
		defer close(monitorDone)
		r.monitorStuck(monitorCtx)
	}()
	for {
		fetches := cl.PollFetches(r.pollContext(ctx))
		r.endPoll()
		if fetches.IsClientClosed() || ctx.Err() != nil {
			// No rebalance runs until AllowRebalance: the workers
			// stop with the partitions still ours, and close commits
			// their marks.
			r.stopWorkers(func(topicPartition) bool { return true })
			cl.AllowRebalance()
			return nil
		}
		failing := r.fetchErrors(fetches)
		rewound := r.rewindEnded()
		fetches.EachPartition(func(p kgo.FetchTopicPartition) {
			if len(p.Records) == 0 || rewound[topicPartition{p.Topic, p.Partition}] {
				return
			}
			r.dispatch(p)
		})
		// The workers of a re-created topic stop here, before
		// AllowRebalance, while the partitions are surely ours; the
		// purge comes after it (it may revoke them).
		recreated := r.recreatedTopics()
		if len(recreated) > 0 {
			r.stopWorkers(func(key topicPartition) bool { return slices.Contains(recreated, key.topic) })
		}
		cl.AllowRebalance()
		for _, topic := range recreated {
			r.recoverRecreatedTopic(topic)
		}
		if err := r.backOffFetchErrors(ctx, failing, fetches.NumRecords() > 0); err != nil {
			// ctx ended during the wait. The next poll returns at once
			// (its context is done), and the exit at the top of the loop
			// stops the workers before AllowRebalance: stopping them here,
			// after it, let a revoke commit before they had stopped
			// (TestShutdownDuringFetchBackoffStopsWorkersBeforeRebalance).
			continue
		}
	}
}

// pollContext returns the context of the next poll: ctx, cancelled early by
// wakePoll (a worker ended abnormally and its partition's fetch position must
// be moved back) without waiting for new records.
func (r *run) pollContext(ctx context.Context) context.Context {
	pollCtx, cancel := context.WithCancel(ctx)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.wake = cancel
	if r.woken {
		r.woken = false
		cancel()
	}
	return pollCtx
}

func (r *run) endPoll() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.wake()
	r.wake = nil
}

// wakePoll makes the poll loop look at the workers now: the poll in
// progress returns (with no records), or the next one does at once.
func (r *run) wakePoll() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.wake != nil {
		r.wake()
	} else {
		r.woken = true
	}
}

// dispatch hands a partition's polled records to its worker, starting the
// worker if the partition has none, and pauses the partition if the worker
// is behind and has MaxPollRecords or more queued. Called by the poll loop
// before AllowRebalance, so no revoke runs meanwhile; it never blocks.
func (r *run) dispatch(p kgo.FetchTopicPartition) {
	key := topicPartition{p.Topic, p.Partition}
	r.mu.Lock()
	w := r.workers[key]
	if w == nil {
		w = r.startWorker(key)
		r.workers[key] = w
	}
	r.mu.Unlock()
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.ended {
		// The worker ended abnormally after rewindEnded looked: the next
		// poll moves the fetch position back to its first record not
		// marked, which comes before these.
		if w.rewindTo == nil {
			w.rewindTo = p.Records[0]
		}
		return
	}
	behind := w.busy || len(w.queued) > 0
	w.queued = append(w.queued, p.Records...)
	if behind && len(w.queued) >= r.cfg.MaxPollRecords && !w.paused {
		w.paused = true
		r.client.PauseFetchPartitions(map[string][]int32{key.topic: {key.partition}})
	}
	select {
	case w.more <- struct{}{}:
	default:
	}
}

// rewindEnded handles the workers that ended abnormally (a runtime.Goexit
// in OnRecord): it moves each one's partition's fetch position back to its
// first record not marked, drops the worker (the partition's next records
// start a fresh one) and returns the partitions whose records in the poll
// at hand must not be dispatched: they are fetched again. Called by the
// poll loop before AllowRebalance: SetOffsets must not race a revoke.
func (r *run) rewindEnded() map[topicPartition]bool {
	r.mu.Lock()
	var ended []*worker
	for key, w := range r.workers {
		w.mu.Lock()
		if w.ended {
			ended = append(ended, w)
			delete(r.workers, key)
		}
		w.mu.Unlock()
	}
	r.mu.Unlock()
	if len(ended) == 0 {
		return nil
	}
	rewound := map[topicPartition]bool{}
	to := map[string]map[int32]kgo.EpochOffset{}
	for _, w := range ended {
		<-w.done
		rewound[w.key] = true
		if rec := w.rewindTo; rec != nil {
			if to[rec.Topic] == nil {
				to[rec.Topic] = map[int32]kgo.EpochOffset{}
			}
			to[rec.Topic][rec.Partition] = kgo.EpochOffset{Epoch: rec.LeaderEpoch, Offset: rec.Offset}
		}
		w.unpause()
	}
	r.logger.Info("records not done will be fetched again", "group", r.cfg.Group, "from", fmt.Sprint(to))
	r.client.SetOffsets(to)
	return rewound
}

// stopWorkers cancels the workers of the partitions match selects, waits
// for them to end and drops them. A worker's record in hand rolls back and
// nothing after it is marked; its queued records are dropped (the partition
// is leaving, or its fetch position was invalidated, or the consumer is
// shutting down: the next owner starts at the committed offset).
func (r *run) stopWorkers(match func(topicPartition) bool) {
	r.mu.Lock()
	var stop []*worker
	for key, w := range r.workers {
		if match(key) {
			stop = append(stop, w)
			delete(r.workers, key)
		}
	}
	r.mu.Unlock()
	for _, w := range stop {
		w.cancel()
	}
	timer := time.NewTimer(time.Duration(stopWait.Load()))
	defer timer.Stop()
	expired := false
	for _, w := range stop {
		if !expired {
			select {
			case <-w.done:
			case <-timer.C:
				expired = true
			}
		}
		if expired {
			select {
			case <-w.done:
			default:
				w.abandon()
			}
		}
		w.unpause()
	}
}

// stopWait bounds how long stopWorkers waits for the cancelled workers to
// end: a handler that ignores its context would otherwise hold the revoke
// (and kgo polls nothing while a revoke runs: every partition of the
// member stops) or the shutdown (Run never returns) for as long as it
// blocks. Well above the processor's grace for a COMMIT in flight (1s).
// Nanoseconds, atomic so that a test can shorten it.
var stopWait atomic.Int64

func init() { stopWait.Store(int64(10 * time.Second)) }

// abandon gives up on a cancelled worker that has not ended within
// stopWait: from now on it marks nothing (mark), so it cannot mark into a
// later assignment of its partition or after Run returned, and the caller
// goes on without it. Its goroutine is left running until its handler
// returns; the transaction in hand either rolls back (its context is
// cancelled) or, if its COMMIT was already under way, commits, and the
// record is then a duplicate the partition's next owner skips (the
// processed-event unique index).
func (w *worker) abandon() {
	w.mu.Lock()
	w.abandoned = true
	w.mu.Unlock()
	w.r.logger.Error("a partition worker did not stop within the bound after its context was cancelled (a handler ignoring its context?); its goroutine is abandoned and marks nothing more, and the partition's records not marked will be applied by its next owner, skipping duplicates",
		"group", w.r.cfg.Group, "topic", w.key.topic, "partition", w.key.partition, "offset", w.pending.Load(),
		"waited", time.Duration(stopWait.Load()))
}

// mark marks rec's offset for commit unless the worker was abandoned.
// Holding w.mu, so that abandon, once it returns, is never followed by a
// mark. kgo ignores a mark for a partition it no longer consumes and never
// moves one back, and a worker marks only committed records, so the mark
// that hurts is into the partition consumed again after its topic was
// deleted and re-created: an offset of the old topic, past records of the
// new one (TestAbandonedWorkerMarksNothingIntoRecreatedTopic).
func (w *worker) mark(rec *kgo.Record) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.abandoned {
		w.r.client.MarkCommitRecords(rec)
	}
}

// inMap returns a match function for stopWorkers selecting the partitions
// of m.
func inMap(m map[string][]int32) func(topicPartition) bool {
	return func(key topicPartition) bool { return slices.Contains(m[key.topic], key.partition) }
}

// worker applies one partition's records, in order, on a goroutine of its
// own that lives as long as the partition is assigned (or until it is
// cancelled).
type worker struct {
	r      *run
	key    topicPartition
	ctx    context.Context
	cancel context.CancelFunc
	more   chan struct{} // signalled when records are queued
	done   chan struct{} // closed when the goroutine has ended

	mu       sync.Mutex
	queued   []*kgo.Record // handed over by the poll loop, not yet taken
	taken    int           // how many records the worker took last
	busy     bool          // applying taken records
	paused   bool          // its partition is paused (by dispatch)
	ended    bool          // the goroutine ended abnormally; the poll loop rewinds
	rewindTo *kgo.Record   // when ended: the first record not marked
	warned   bool          // the monitor warned that it is stuck
	// abandoned: stopWorkers gave up waiting for it (stopWait); it marks
	// nothing more.
	abandoned bool

	// For the stuck monitor: when the worker last finished a chunk or
	// took records, and the offset of the first record not done.
	progress atomic.Int64 // unix nanoseconds
	pending  atomic.Int64
}

func (r *run) startWorker(key topicPartition) *worker {
	ctx, cancel := context.WithCancel(r.ctx)
	w := &worker{r: r, key: key, ctx: ctx, cancel: cancel, more: make(chan struct{}, 1), done: make(chan struct{})}
	go w.loop()
	return w
}

// loop takes the queued records and applies them until cancelled.
//
// pending is the first record taken and not marked; returned is false while
// the goroutine unwinds from a runtime.Goexit in code the application gave
// the loop (OnRecord): then the records not marked, and those queued, are
// fetched again (rewindEnded). Without it the partition's later records went
// on after them, and their marks committed past them: records lost.
func (w *worker) loop() {
	var pending *kgo.Record
	returned := false
	defer func() {
		if !returned {
			w.mu.Lock()
			w.ended = true
			w.rewindTo = pending
			if w.rewindTo == nil && len(w.queued) > 0 {
				w.rewindTo = w.queued[0]
			}
			w.queued = nil
			w.mu.Unlock()
			if w.rewindTo != nil {
				w.r.logger.Error("a partition worker ended before its records were done (runtime.Goexit in OnRecord); they will be fetched again",
					"group", w.r.cfg.Group, "topic", w.key.topic, "partition", w.key.partition, "offset", w.rewindTo.Offset)
			}
		}
		close(w.done)
		if !returned {
			w.r.wakePoll()
		}
	}()
	for {
		recs := w.take()
		if recs == nil {
			returned = true
			return
		}
		pending = recs[0]
		if rec := w.apply(recs, &pending); rec != nil {
			returned = w.ctx.Err() != nil // else: not cancelled, yet not done; fetch it again
			return
		}
	}
}

// take returns the queued records, waiting for some; nil once cancelled.
// Taking them resumes the partition if dispatch paused it.
func (w *worker) take() []*kgo.Record {
	for {
		if w.ctx.Err() != nil {
			return nil
		}
		w.mu.Lock()
		if recs := w.queued; len(recs) > 0 {
			w.queued, w.busy, w.taken = nil, true, len(recs)
			w.progress.Store(time.Now().UnixNano())
			w.pending.Store(recs[0].Offset)
			w.unpauseLocked()
			w.mu.Unlock()
			return recs
		}
		w.busy = false
		w.mu.Unlock()
		select {
		case <-w.more:
		case <-w.ctx.Done():
			return nil
		}
	}
}

// apply runs processPartition on a guardlane of its own, ended with the
// records (no lane worker is left idle between polls).
func (w *worker) apply(recs []*kgo.Record, pending **kgo.Record) *kgo.Record {
	lane, stop := guardlane.With(w.ctx)
	defer stop()
	return w.r.processPartition(lane, w, recs, pending)
}

func (w *worker) unpause() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.unpauseLocked()
}

func (w *worker) unpauseLocked() {
	if w.paused {
		w.paused = false
		w.r.client.ResumeFetchPartitions(map[string][]int32{w.key.topic: {w.key.partition}})
	}
}

// stuckWarnAfter is how long a partition's worker may go without finishing a
// record before the monitor warns (once per stuck spell); nanoseconds,
// atomic so that a test can shorten it.
var stuckWarnAfter atomic.Int64

func init() { stuckWarnAfter.Store(int64(30 * time.Second)) }

// monitorStuck warns, once per spell, about each partition whose worker has
// done no record for stuckWarnAfter while it has records, and says when it
// moves again. One look every stuckWarnAfter/4; nothing per record.
func (r *run) monitorStuck(ctx context.Context) {
	after := time.Duration(stuckWarnAfter.Load())
	t := time.NewTicker(max(after/4, 10*time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		r.mu.Lock()
		ws := make([]*worker, 0, len(r.workers))
		for _, w := range r.workers {
			ws = append(ws, w)
		}
		r.mu.Unlock()
		now := time.Now()
		for _, w := range ws {
			idle := now.Sub(time.Unix(0, w.progress.Load()))
			w.mu.Lock()
			stuck := w.busy && idle >= after
			warn, moving := stuck && !w.warned, !stuck && w.warned
			w.warned = stuck
			queued := len(w.queued)
			w.mu.Unlock()
			if warn {
				r.logger.Warn("partition stuck: no record done for a while; the other partitions go on",
					"group", r.cfg.Group, "topic", w.key.topic, "partition", w.key.partition,
					"offset", w.pending.Load(), "for", idle.Round(time.Millisecond), "queued", queued)
			}
			if moving {
				r.logger.Info("partition moving again", "group", r.cfg.Group, "topic", w.key.topic, "partition", w.key.partition)
			}
		}
	}
}

// recreateGrace is how long a consumed topic must answer UNKNOWN_TOPIC_ID
// before it is taken as deleted and re-created (and not a broker whose
// metadata lags for a moment).
const recreateGrace = 2 * time.Second

// fetchErrors logs a poll's fetch errors and returns whether there were any.
// It tracks since when each topic answers UNKNOWN_TOPIC_ID: a spell ends
// when the topic delivers records, or when it has not answered so for
// recreateGrace. A poll without the error for the topic does not end it:
// while other topics deliver records, most polls return before the failing
// topic's fetch answers again, and ending the spell there meant a topic
// re-created while another one flowed was never recovered.
func (r *run) fetchErrors(fetches kgo.Fetches) bool {
	failing := false
	unknownID := map[string]bool{}
	fetches.EachError(func(topic string, p int32, err error) {
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			return // the poll's own context: shutdown or wakePoll
		}
		failing = true
		if errors.Is(err, kerr.UnknownTopicID) {
			unknownID[topic] = true
		}
		if r.fetchFailures == 0 { // the first of a run of failures; the others are counted in backOffFetchErrors
			r.logger.Warn("fetch error", "group", r.cfg.Group, "topic", topic, "partition", p, "err", err)
		}
	})
	now := time.Now()
	for topic := range unknownID {
		if s := r.unknownID[topic]; s != nil {
			s.last = now
		} else {
			r.unknownID[topic] = &unknownSpell{since: now, last: now}
		}
	}
	fetches.EachPartition(func(p kgo.FetchTopicPartition) {
		if len(p.Records) > 0 {
			delete(r.unknownID, p.Topic)
		}
	})
	for topic, s := range r.unknownID {
		if now.Sub(s.last) > recreateGrace {
			delete(r.unknownID, topic)
		}
	}
	return failing
}

// backOffFetchErrors waits before the next poll while fetches fail and
// return nothing: kgo returns a failing fetch at once, so without a wait the
// poll loop spins (seen: 14,000 "fetch error" lines a second after a topic
// was re-created). It returns ctx's error when ctx ends during the wait.
func (r *run) backOffFetchErrors(ctx context.Context, failing, gotRecords bool) error {
	if !failing || gotRecords {
		if r.fetchFailures > 1 {
			r.logger.Info("fetching again after failures", "group", r.cfg.Group, "failed_polls", r.fetchFailures)
		}
		r.fetchFailures = 0
		return nil
	}
	r.fetchFailures++
	wait := max(fetchBackoff(r.fetchFailures), time.Duration(fetchBackoffFloor.Load()))
	if r.fetchFailures%10 == 0 {
		r.logger.Warn("fetches still failing; waiting between polls", "group", r.cfg.Group,
			"failed_polls", r.fetchFailures, "wait", wait)
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// fetchBackoffFloor is the least wait of backOffFetchErrors, in
// nanoseconds: zero, but in a test that holds the poll loop in the backoff
// to stop the consumer there.
var fetchBackoffFloor atomic.Int64

// fetchBackoff is the wait after n failed polls in a row: 50ms doubling to
// 2s, between half and all of it.
func fetchBackoff(n int) time.Duration {
	d := 50 * time.Millisecond << min(max(n-1, 0), 6)
	d = min(d, 2*time.Second)
	return d/2 + rand.N(d/2+1)
}

// recreatedTopics returns the topics taken as deleted and re-created while
// consumed: kgo refuses to consume the new instance (UNKNOWN_TOPIC_ID) until
// the topic is purged from the client and added back (kgo README, "Topic
// recreation"). A topic is taken as re-created once it has answered so for
// recreateGrace, whether or not other topics deliver records meanwhile.
//
// The poll loop stops the topic's workers before AllowRebalance, then
// recovers it (recoverRecreatedTopic). Purging alone does not revoke the
// partitions when kgo's metadata has added the topic back before its
// session ends (a heartbeat in flight delays the end): the assignment is
// the same, no revoke runs, and the old instance's workers went on. One
// stuck on a record stayed stuck with its partition paused, so the new
// instance's partition was never consumed (TestTopicRecreatedWithoutRevoke);
// one applying its queued records of the old instance went on marking them.
func (r *run) recreatedTopics() []string {
	var topics []string
	for topic, s := range r.unknownID {
		if s.last.Sub(s.since) < recreateGrace {
			continue
		}
		delete(r.unknownID, topic)
		topics = append(topics, topic)
		r.logger.Error("topic was deleted and re-created; stopping its workers, purging it from the client and consuming the new topic",
			"group", r.cfg.Group, "topic", topic)
	}
	slices.Sort(topics)
	return topics
}

// recoverRecreatedTopic purges topic from the client and consumes it
// again. The broker deleted the group's committed offsets of the old
// instance with it, so the new instance starts at the group's reset offset
// (ClientOpts' ConsumeResetOffset): on Kafka 4.1 and later only. Below it
// the old instance's marks committed by topic name before the recovery
// become the new instance's commits (a known defect, README "Broker.").
func (r *run) recoverRecreatedTopic(topic string) {
	if r.beforePurge != nil {
		r.beforePurge(topic)
	}
	r.client.PurgeTopicsFromClient(topic)
	r.client.AddConsumeTopics(topic)
}

func (r *run) onAssigned(_ context.Context, _ *kgo.Client, assigned map[string][]int32) {
	r.logger.Info("partitions assigned", "group", r.cfg.Group, "partitions", fmt.Sprint(assigned))
}

// onRevoked stops the revoked partitions' workers, then commits what is
// marked before the partitions go to another member. A worker stops at its
// record in hand (which rolls back) and marks nothing after it, so every
// marked offset belongs to a committed transaction. The other partitions'
// workers (cooperative rebalancing) keep running. The wait is short: the
// processor's waits (retry backoff, outage, the handler's own statements)
// end with the worker's context.
func (r *run) onRevoked(ctx context.Context, cl *kgo.Client, revoked map[string][]int32) {
	r.logger.Info("partitions revoked", "group", r.cfg.Group, "partitions", fmt.Sprint(revoked))
	r.stopWorkers(inMap(revoked))
	if err := cl.CommitMarkedOffsets(ctx); err != nil {
		r.logger.Warn("commit on revoke failed; the new owner re-reads from the last commit and skips duplicates",
			"group", r.cfg.Group, "partitions", fmt.Sprint(revoked), "err", err)
	}
}

// onLost: the partitions are gone without a chance to commit (session
// expired); their workers are stopped (and waited for, or abandoned after
// stopWait: either way none marks into a later assignment), their marks
// are dropped by kgo, and the new owner re-reads from the last commit,
// skipping duplicates.
func (r *run) onLost(_ context.Context, _ *kgo.Client, lost map[string][]int32) {
	r.logger.Warn("partitions lost", "group", r.cfg.Group, "partitions", fmt.Sprint(lost))
	r.stopWorkers(inMap(lost))
}

// processPartition applies one partition's records in order, marking each
// chunk's offset after every handler is done with it. When ctx is cancelled
// (shutdown, or the partition revoked or lost) it stops and returns the
// first record not done, which is not marked; nil when every record is done.
//
// *pending is kept at the first record not marked (nil once all are), and
// w's progress at the last chunk done.
func (r *run) processPartition(ctx context.Context, w *worker, recs []*kgo.Record, pending **kgo.Record) *kgo.Record {
	for start := 0; start < len(recs); start += r.cfg.BatchSize {
		chunk := recs[start:min(start+r.cfg.BatchSize, len(recs))]
		irecs := make([]*idem.Record, len(chunk))
		for i, rec := range chunk {
			irecs[i] = toRecord(rec)
		}
		done := len(chunk) // records of the chunk every handler is done with
		handlers := r.byTopic[chunk[0].Topic]
		for i, h := range handlers {
			outcomes, err := r.proc.ProcessBatch(ctx, h, irecs)
			if r.cfg.OnRecord != nil {
				for j, o := range outcomes {
					r.cfg.OnRecord(h, irecs[j], o)
				}
			}
			if err != nil {
				done = min(done, len(outcomes))
				if i < len(handlers)-1 {
					done = 0 // the handlers after this one have not seen the chunk
				}
				break
			}
		}
		if done < len(chunk) {
			if done > 0 {
				w.mark(chunk[done-1])
			}
			*pending = chunk[done]
			return chunk[done]
		}
		crash.Point(ctx, "consume.after-commit")
		w.mark(chunk[len(chunk)-1])
		*pending = nil
		if end := start + len(chunk); end < len(recs) {
			*pending = recs[end]
			w.pending.Store(recs[end].Offset)
		}
		w.progress.Store(time.Now().UnixNano())
	}
	return nil
}

func (r *run) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.client.CommitMarkedOffsets(ctx); err != nil {
		r.logger.Warn("final offset commit failed; the next owner skips the duplicates", "group", r.cfg.Group, "err", err)
	}
	r.client.CloseAllowingRebalance()
}

func toRecord(r *kgo.Record) *idem.Record {
	rec := &idem.Record{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset, Key: r.Key, Value: r.Value}
	if len(r.Headers) > 0 { // nil when none, as before
		rec.Headers = make([]idem.RecordHeader, len(r.Headers))
		for i, h := range r.Headers {
			rec.Headers[i] = idem.RecordHeader{Key: h.Key, Value: h.Value}
		}
	}
	return rec
}
