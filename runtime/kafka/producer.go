package kafka

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/runtime/idem"
)

// Publisher publishes outbox messages with a franz-go client; it implements
// idem.Publisher for idem.Relay.
//
// The client should keep franz-go's defaults for ordering: the idempotent
// producer (on by default, with acks=all), so that records of one partition
// land in the order they were produced even across retries, and a failed
// record fails the records behind it in its partition instead of letting
// them overtake it.
type Publisher struct {
	Client *kgo.Client
}

// NewPublisher returns a Publisher on a new client for brokers, with opts
// added (TLS, SASL, ...). Lingering is off: the relay hands over a whole
// batch at once and then waits for its acks, so waiting for more records
// would only add latency.
func NewPublisher(brokers []string, opts ...kgo.Opt) (*Publisher, error) {
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(brokers...), kgo.ProducerLinger(0)}, opts...)...)
	if err != nil {
		return nil, err
	}
	return &Publisher{Client: cl}, nil
}

// Close closes the client.
func (p *Publisher) Close() { p.Client.Close() }

// Publish produces every message at once, in order, and waits for all acks,
// or for ctx: when ctx ends first, every message not yet acked fails with
// ctx's error and Publish returns at once (franz-go keeps a request already
// sent until the broker answers or the connection dies, so an outage cannot
// hold Publish past the relay's PublishTimeout). Such a message may still
// land later: a duplicate, which consumers skip by event id. Each record
// carries the message's headers (among them idem-event-id) and its key.
// Errors that retrying cannot fix are marked permanent.
func (p *Publisher) Publish(ctx context.Context, msgs []idem.Message) []error {
	var (
		mu      sync.Mutex
		errs    = make([]error, len(msgs))
		done    = make([]bool, len(msgs))
		pending = len(msgs)
		all     = make(chan struct{})
	)
	if pending == 0 {
		return errs
	}
	for i, m := range msgs {
		rec := &kgo.Record{Topic: m.Topic, Key: m.Key, Value: m.Value}
		for _, k := range slices.Sorted(maps.Keys(m.Headers)) {
			rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: k, Value: []byte(m.Headers[k])})
		}
		p.Client.Produce(ctx, rec, func(_ *kgo.Record, err error) {
			if err != nil && isPermanent(err) {
				err = idem.Permanent(err)
			}
			mu.Lock()
			defer mu.Unlock()
			if done[i] {
				return // Publish already returned: the answer came too late
			}
			errs[i], done[i] = err, true
			if pending--; pending == 0 {
				close(all)
			}
		})
	}
	select {
	case <-all:
	case <-ctx.Done():
	}
	mu.Lock()
	defer mu.Unlock()
	out := make([]error, len(msgs))
	for i := range msgs {
		if !done[i] {
			done[i] = true
			errs[i] = fmt.Errorf("not acked before the publish deadline: %w", context.Cause(ctx))
		}
		out[i] = errs[i]
	}
	return out
}

// isPermanent reports errors that retrying the same record cannot fix. A
// broker restart's UNKNOWN_TOPIC_ID or UNKNOWN_TOPIC_OR_PARTITION,
// NOT_LEADER_FOR_PARTITION, timeouts and transport errors are all transient.
func isPermanent(err error) bool {
	return errors.Is(err, kerr.MessageTooLarge) || errors.Is(err, kerr.InvalidRecord) ||
		errors.Is(err, kerr.RecordListTooLarge) || errors.Is(err, kerr.InvalidTopicException)
}
