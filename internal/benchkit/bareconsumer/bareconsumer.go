// Package bareconsumer holds the hand-written kgo consumers that the
// consumer benchmarks measure kafka.Consumer against: runtime/kafka's
// BenchmarkConsumerSideBySide (throughput) and internal/rssbench's
// BenchmarkPeakRSS (peak resident set). Both take their baselines from here,
// so the two benchmarks compare against one and the same loop. Each is
// written as a user of franz-go would write it by hand: kafka.Consumer's
// structure and commit behaviour, none of its dedupe, rebalance handling,
// stuck-partition monitor, Goexit recovery, fetch-error backoff or handler
// lanes. BENCHMARKS.md ("What each row measures") describes both.
package bareconsumer

import (
	"cmp"
	"context"
	"slices"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// Config is what a run needs. The per-record work is the caller's (Apply),
// so each benchmark keeps its own next to its idempotent handler.
type Config struct {
	Brokers []string
	Group   string
	Topic   string
	// MaxPollRecords is, for Run, how many records a partition's worker may
	// have queued while it is behind before the partition is paused (as
	// kafka.Consumer's MaxPollRecords); for RunPerPoll, how many records a
	// poll takes.
	MaxPollRecords int
	// Opts are extra kgo options: where the group starts
	// (ConsumeResetOffset, AdjustFetchOffsetsFn).
	Opts []kgo.Opt
	// Apply applies one record, in a transaction of its own; the record is
	// marked for commit after it returns nil. An error ends the run unless
	// ctx is done.
	Apply func(ctx context.Context, rec *kgo.Record) error
}

// Run is the baseline with kafka.Consumer's structure: a worker goroutine
// per partition, living across polls. The poll loop takes all that kgo
// buffered (PollFetches), hands each partition's records to its worker
// without waiting, pausing the partition if the worker is still busy or had
// records queued and now has MaxPollRecords or more queued (the worker
// resumes it when it takes them), and polls again. Each worker applies its
// records in order and marks each after Apply returns. Marks are committed
// every second (AutoCommitMarks) and when the client leaves the group;
// rebalances wait only for a poll's hand-out (BlockRebalanceOnPoll);
// FetchMaxWait is 100ms, kafka.Consumer's default. It has no revoke
// handling: the benchmarks' groups have one member, so nothing is revoked.
//
// Run returns when ctx is done (nil) or a record fails (its error): it
// cancels the workers, waits for them and closes the client.
func Run(ctx context.Context, cfg Config) error {
	cl, err := newClient(cfg, kgo.FetchMaxWait(100*time.Millisecond))
	if err != nil {
		return err
	}
	defer cl.Close()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	var mu sync.Mutex
	var failed error
	type worker struct {
		mu     sync.Mutex
		queued []*kgo.Record
		busy   bool // applying the records it took
		paused bool
		more   chan struct{}
	}
	// work applies partition p's records as the poll loop queues them.
	work := func(p int32, w *worker) {
		defer wg.Done()
		for {
			w.mu.Lock()
			recs := w.queued
			w.queued, w.busy = nil, len(recs) > 0
			if len(recs) > 0 && w.paused {
				w.paused = false
				cl.ResumeFetchPartitions(map[string][]int32{cfg.Topic: {p}})
			}
			w.mu.Unlock()
			if len(recs) == 0 {
				select {
				case <-w.more:
					continue
				case <-ctx.Done():
					return
				}
			}
			for _, r := range recs {
				if err := cfg.Apply(ctx, r); err != nil {
					if ctx.Err() == nil {
						mu.Lock()
						failed = cmp.Or(failed, err)
						mu.Unlock()
						cancel()
					}
					return
				}
				cl.MarkCommitRecords(r)
			}
		}
	}
	workers := map[int32]*worker{}
	for ctx.Err() == nil {
		fetches := cl.PollFetches(ctx)
		fetches.EachPartition(func(p kgo.FetchTopicPartition) {
			if len(p.Records) == 0 {
				return
			}
			w := workers[p.Partition]
			if w == nil {
				w = &worker{more: make(chan struct{}, 1)}
				workers[p.Partition] = w
				wg.Add(1)
				go work(p.Partition, w)
			}
			w.mu.Lock()
			behind := w.busy || len(w.queued) > 0
			w.queued = append(w.queued, p.Records...)
			if behind && len(w.queued) >= cfg.MaxPollRecords && !w.paused {
				w.paused = true
				cl.PauseFetchPartitions(map[string][]int32{cfg.Topic: {p.Partition}})
			}
			w.mu.Unlock()
			select {
			case w.more <- struct{}{}:
			default:
			}
		})
		cl.AllowRebalance()
	}
	cancel()
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	return failed
}

// RunPerPoll is the second baseline, Run's work per record and commit
// behaviour in the structure kafka.Consumer had before 2026-12-01: each
// poll takes up to MaxPollRecords records (PollRecords), a goroutine per
// partition of the poll applies that partition's records in order, and all
// are waited for before the next poll (so each poll waits for its slowest
// partition), rebalances blocked meanwhile; kgo's default FetchMaxWait.
//
// It returns when ctx is done (nil) or after the poll in which a record
// failed (its error).
func RunPerPoll(ctx context.Context, cfg Config) error {
	cl, err := newClient(cfg)
	if err != nil {
		return err
	}
	defer cl.Close()
	for {
		fetches := cl.PollRecords(ctx, cfg.MaxPollRecords)
		if ctx.Err() != nil {
			cl.AllowRebalance() // or Close, leaving the group, waits for it
			return nil
		}
		var wg sync.WaitGroup
		var mu sync.Mutex
		var failed error
		fetches.EachPartition(func(p kgo.FetchTopicPartition) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for _, r := range p.Records {
					if err := cfg.Apply(ctx, r); err != nil {
						mu.Lock()
						failed = cmp.Or(failed, err)
						mu.Unlock()
						return
					}
					cl.MarkCommitRecords(r)
				}
			}()
		})
		wg.Wait()
		cl.AllowRebalance()
		if failed != nil && ctx.Err() == nil {
			return failed
		}
	}
}

// newClient is both baselines' group consumer: defaults (first), then
// cfg.Opts, then kafka.Consumer's commit behaviour: marks committed every
// second and when the client leaves the group, rebalances blocked while a
// poll is handed out.
func newClient(cfg Config, defaults ...kgo.Opt) (*kgo.Client, error) {
	opts := slices.Concat(defaults, cfg.Opts, []kgo.Opt{
		kgo.SeedBrokers(cfg.Brokers...), kgo.ConsumerGroup(cfg.Group), kgo.ConsumeTopics(cfg.Topic),
		kgo.AutoCommitMarks(), kgo.AutoCommitInterval(time.Second), kgo.BlockRebalanceOnPoll(),
	})
	return kgo.NewClient(opts...)
}
