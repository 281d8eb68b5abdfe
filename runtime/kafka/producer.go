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

	mu sync.Mutex
	// inflight holds the records the client still has (buffered or sent,
	// not yet answered), by event id. A message that is still in flight from
	// an earlier Publish (one that gave up at its deadline during an
	// outage) is not produced again: this Publish waits for that record's
	// answer instead. Without this, every retry during an outage would add
	// a copy of the batch to the client's buffer, all delivered when the
	// broker returns.
	inflight map[string]*flight
}

// flight is one record the client holds; done closes when it is answered.
type flight struct {
	done chan struct{}
	err  error
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
	flights := make([]*flight, len(msgs))
	for i, m := range msgs {
		p.mu.Lock()
		if p.inflight == nil {
			p.inflight = map[string]*flight{}
		}
		f, ok := p.inflight[m.EventID]
		if !ok || m.EventID == "" {
			f = &flight{done: make(chan struct{})}
			if m.EventID != "" {
				p.inflight[m.EventID] = f
			}
		}
		p.mu.Unlock()
		flights[i] = f
		if ok {
			continue // still in the client, ahead of what follows: wait for it
		}
		rec := &kgo.Record{Topic: m.Topic, Key: m.Key, Value: m.Value}
		for _, k := range slices.Sorted(maps.Keys(m.Headers)) {
			rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: k, Value: []byte(m.Headers[k])})
		}
		id := m.EventID
		// When ctx ends, the client fails the record if it safely can (no
		// request holding it was sent); otherwise it stays in flight, and a
		// later Publish of the same event waits for it (see inflight).
		p.Client.Produce(ctx, rec, func(_ *kgo.Record, err error) {
			if err != nil {
				err = classify(rec.Topic, err)
			}
			p.mu.Lock()
			if id != "" && p.inflight[id] == f {
				delete(p.inflight, id)
			}
			p.mu.Unlock()
			f.err = err
			close(f.done)
		})
	}
	errs := make([]error, len(msgs))
	var recreated []string
	for i, f := range flights {
		select {
		case <-f.done:
			errs[i] = f.err
		case <-ctx.Done():
			errs[i] = fmt.Errorf("not acked before the publish deadline: %w", context.Cause(ctx))
		}
		if errors.Is(errs[i], kerr.UnknownTopicID) && !slices.Contains(recreated, msgs[i].Topic) {
			recreated = append(recreated, msgs[i].Topic)
		}
	}
	if len(recreated) > 0 {
		// The topic was re-created under a new id (a broker restored or
		// restarted empty): franz-go keeps failing with the id it cached
		// until the topic is purged from the producer, which makes it load
		// the topic afresh on the next produce.
		p.Client.PurgeTopicsFromProducing(recreated...)
	}
	return errs
}

// classify names the topic in err (franz-go's errors do not, and an
// operator reading last_error or the log must see which topic fails) and
// marks errors that retrying cannot fix as permanent, and the broker's
// refusal of this record's topic as rejected.
func classify(topic string, err error) error {
	err = fmt.Errorf("produce to topic %q: %w", topic, err)
	switch {
	case isPermanent(err):
		return idem.Permanent(err)
	case errors.Is(err, kerr.UnknownTopicOrPartition):
		// franz-go fails a record with this only after the brokers said,
		// in several metadata answers (UnknownTopicRetries), that the
		// topic does not exist: the broker is up and refuses this topic.
		// Not an outage: it counts toward the row's attempts, so these
		// rows park instead of holding back every other topic forever.
		return idem.Rejected(err)
	}
	return err
}

// isPermanent reports errors that retrying the same record cannot fix. A
// broker restart's UNKNOWN_TOPIC_ID or UNKNOWN_TOPIC_OR_PARTITION,
// NOT_LEADER_FOR_PARTITION, timeouts and transport errors are all transient.
func isPermanent(err error) bool {
	return errors.Is(err, kerr.MessageTooLarge) || errors.Is(err, kerr.InvalidRecord) ||
		errors.Is(err, kerr.RecordListTooLarge) || errors.Is(err, kerr.InvalidTopicException)
}
