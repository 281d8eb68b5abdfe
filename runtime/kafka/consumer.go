// Package kafka runs idemgen's consumers and outbox relay on Kafka with
// franz-go (kgo). The runtime package holds the broker-agnostic logic; this
// package adapts it: it polls records, hands them to a idem.Processor, and
// commits a record's offset only after its database transaction committed.
package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/internal/crash"
	"github.com/idemgen/idemgen/runtime/idem"
)

// ConsumerConfig configures a Consumer.
type ConsumerConfig struct {
	// Brokers are the seed brokers, e.g. []string{"127.0.0.1:9092"}.
	Brokers []string
	// Group is the consumer group.
	Group string
	// Handlers are the generated handlers (e.g. the package's
	// IdemConsumers(...)); their topics are consumed. Several consumers may
	// share a topic; each applies each record in its own context.
	Handlers []idem.EventHandler
	// BatchSize > 1 enables batch mode: up to BatchSize records of one
	// partition are applied in one transaction with one multi-row dedupe
	// insert. Default 1: one transaction per record.
	BatchSize int
	// Retry is the handler retry policy before a record is dead-lettered.
	Retry idem.RetryPolicy
	// CommitInterval is how often marked offsets are committed (default 1s).
	// Offsets are also committed on partition revocation and on shutdown.
	CommitInterval time.Duration
	// MaxPollRecords bounds the records handled per poll (default 500).
	MaxPollRecords int
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// ClientOpts are extra kgo options (TLS, SASL, ConsumeResetOffset, ...).
	// The options the delivery guarantee rests on are always set by
	// NewConsumer and must not be overridden: ConsumerGroup, ConsumeTopics,
	// AutoCommitMarks, BlockRebalanceOnPoll, OnPartitionsRevoked.
	ClientOpts []kgo.Opt
}

// Consumer consumes the topics of a set of generated consumers with
// exactly-once effects on PostgreSQL.
//
// Per record: in one transaction, the processed-event row and the handler's
// writes commit (or a duplicate is skipped); only then is the record's offset
// marked, and marked offsets are committed per partition, in order, every
// CommitInterval, on revocation and on shutdown. Rebalances are blocked while
// a poll is being processed, so no commit crosses a rebalance. Partitions of
// one poll are processed concurrently, records within a partition in order.
type Consumer struct {
	client  *kgo.Client
	proc    *idem.Processor
	byTopic map[string][]*idem.EventHandler
	batch   int
	maxPoll int
	logger  *slog.Logger

	// OnRecord, if set before Run, is called after each record is done, with
	// its outcome per consumer. Tests and metrics use it.
	OnRecord func(c *idem.EventHandler, rec *idem.Record, o idem.Outcome)
}

// NewConsumer returns a Consumer on pool. Call Run to consume.
func NewConsumer(pool *pgxpool.Pool, cfg ConsumerConfig) (*Consumer, error) {
	if cfg.Group == "" || len(cfg.Brokers) == 0 || len(cfg.Handlers) == 0 {
		return nil, errors.New("kafka consumer: Brokers, Group and Handlers are required")
	}
	c := &Consumer{
		proc:    &idem.Processor{Pool: pool, Retry: cfg.Retry, Logger: cfg.Logger},
		byTopic: map[string][]*idem.EventHandler{},
		batch:   max(cfg.BatchSize, 1),
		maxPoll: cfg.MaxPollRecords,
		logger:  cfg.Logger,
	}
	if c.maxPoll <= 0 {
		c.maxPoll = 500
	}
	if c.logger == nil {
		c.logger = slog.Default()
	}
	var topics []string
	for i := range cfg.Handlers {
		cons := &cfg.Handlers[i]
		if _, seen := c.byTopic[cons.Topic]; !seen {
			topics = append(topics, cons.Topic)
		}
		c.byTopic[cons.Topic] = append(c.byTopic[cons.Topic], cons)
	}
	interval := cfg.CommitInterval
	if interval <= 0 {
		interval = time.Second
	}
	opts := append([]kgo.Opt{}, cfg.ClientOpts...)
	opts = append(opts,
		kgo.SeedBrokers(cfg.Brokers...),
		kgo.ConsumerGroup(cfg.Group),
		kgo.ConsumeTopics(topics...),
		kgo.AutoCommitMarks(),
		kgo.AutoCommitInterval(interval),
		kgo.BlockRebalanceOnPoll(),
		kgo.OnPartitionsRevoked(c.onRevoked),
		kgo.OnPartitionsAssigned(func(_ context.Context, _ *kgo.Client, p map[string][]int32) {
			c.logger.Info("partitions assigned", "group", cfg.Group, "partitions", p)
		}),
		kgo.OnPartitionsLost(func(_ context.Context, _ *kgo.Client, p map[string][]int32) {
			c.logger.Warn("partitions lost (the group moved on without us); uncommitted records are re-read by their new owner", "group", cfg.Group, "partitions", p)
		}),
	)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("kafka consumer: %w", err)
	}
	c.client = cl
	return c, nil
}

// onRevoked commits what is marked before the partitions go to another
// member. It runs between polls (BlockRebalanceOnPoll), so every marked
// offset belongs to a committed transaction.
func (c *Consumer) onRevoked(ctx context.Context, cl *kgo.Client, p map[string][]int32) {
	c.logger.Info("partitions revoked", "partitions", p)
	if err := cl.CommitMarkedOffsets(ctx); err != nil {
		c.logger.Warn("commit on revoke failed; the new owner re-reads from the last commit and skips duplicates", "err", err)
	}
}

// Run consumes until ctx is cancelled, then finishes or rolls back the
// records in hand, commits the offsets of committed transactions, leaves the
// group and closes the client. It returns nil after a clean shutdown.
func (c *Consumer) Run(ctx context.Context) error {
	defer c.close()
	for {
		fetches := c.client.PollRecords(ctx, c.maxPoll)
		if fetches.IsClientClosed() || ctx.Err() != nil {
			c.client.AllowRebalance()
			return nil
		}
		fetches.EachError(func(topic string, p int32, err error) {
			if !errors.Is(err, context.Canceled) {
				c.logger.Warn("fetch error", "topic", topic, "partition", p, "err", err)
			}
		})
		var wg sync.WaitGroup
		fetches.EachPartition(func(p kgo.FetchTopicPartition) {
			if len(p.Records) == 0 {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				c.processPartition(ctx, p.Records)
			}()
		})
		wg.Wait()
		c.client.AllowRebalance()
	}
}

// processPartition applies one partition's records in order, marking each
// record's offset after it is done. On cancellation it stops: the rest is
// not marked and will be delivered again.
func (c *Consumer) processPartition(ctx context.Context, recs []*kgo.Record) {
	for start := 0; start < len(recs); start += c.batch {
		chunk := recs[start:min(start+c.batch, len(recs))]
		irecs := make([]*idem.Record, len(chunk))
		for i, r := range chunk {
			irecs[i] = toRecord(r)
		}
		for _, cons := range c.byTopic[chunk[0].Topic] {
			outcomes, err := c.proc.ProcessBatch(ctx, cons, irecs)
			if err != nil {
				return // cancelled: nothing of this chunk is marked
			}
			if c.OnRecord != nil {
				for i, o := range outcomes {
					c.OnRecord(cons, irecs[i], o)
				}
			}
		}
		crash.Point(ctx, "consume.after-commit")
		c.client.MarkCommitRecords(chunk[len(chunk)-1])
	}
}

func (c *Consumer) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.client.CommitMarkedOffsets(ctx); err != nil {
		c.logger.Warn("final offset commit failed; the next owner skips the duplicates", "err", err)
	}
	c.client.CloseAllowingRebalance()
}

func toRecord(r *kgo.Record) *idem.Record {
	rec := &idem.Record{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset, Key: r.Key, Value: r.Value}
	for _, h := range r.Headers {
		rec.Headers = append(rec.Headers, idem.RecordHeader{Key: h.Key, Value: h.Value})
	}
	return rec
}
