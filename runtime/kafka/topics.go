package kafka

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// TopicCheck says what CheckTopics does about a missing topic.
type TopicCheck struct {
	// CreatePartitions > 0 creates missing topics with this many partitions
	// instead of failing. Zero: a missing topic is an error.
	CreatePartitions int32
	// ReplicationFactor of created topics; 0 or -1 is the broker's default.
	ReplicationFactor int16
}

// ErrMissingTopics is wrapped by the error CheckTopics returns when topics
// do not exist (and were not to be created).
var ErrMissingTopics = errors.New("missing topics")

// CheckTopics asks the cluster whether topics exist and fails with an error
// naming every missing one, or creates them if chk.CreatePartitions > 0.
//
// Call it at start-up, before Consumer.Run or the relay: a consumer group
// subscribed to a topic that does not exist joins, gets no partitions, and
// waits forever without an error, and a producer's records to it fail only
// after retries. Brokers that auto-create topics on metadata requests are
// not asked to (the request says so), so the check does not create them by
// accident.
func CheckTopics(ctx context.Context, cl *kgo.Client, topics []string, chk TopicCheck) error {
	topics = slices.Compact(slices.Sorted(slices.Values(topics)))
	if len(topics) == 0 {
		return nil
	}
	missing, err := missingTopics(ctx, cl, topics)
	if err != nil {
		return err
	}
	if len(missing) == 0 {
		return nil
	}
	if chk.CreatePartitions <= 0 {
		return fmt.Errorf("%w: %s do(es) not exist on the cluster; create them, or let the service create them (e.g. KAFKA_CREATE_TOPICS=partitions)",
			ErrMissingTopics, strings.Join(missing, ", "))
	}
	req := kmsg.NewPtrCreateTopicsRequest()
	req.TimeoutMillis = 30000
	for _, t := range missing {
		rt := kmsg.NewCreateTopicsRequestTopic()
		rt.Topic = t
		rt.NumPartitions = chk.CreatePartitions
		rt.ReplicationFactor = chk.ReplicationFactor
		if rt.ReplicationFactor == 0 {
			rt.ReplicationFactor = -1
		}
		req.Topics = append(req.Topics, rt)
	}
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return fmt.Errorf("create topics %s: %w", strings.Join(missing, ", "), err)
	}
	for _, t := range resp.Topics {
		// Another replica creating it at the same moment is fine.
		if err := kerr.ErrorForCode(t.ErrorCode); err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
			return fmt.Errorf("create topic %s with %d partitions: %w", t.Topic, chk.CreatePartitions, err)
		}
	}
	return nil
}

// missingTopics returns the topics of topics the cluster does not have.
func missingTopics(ctx context.Context, cl *kgo.Client, topics []string) ([]string, error) {
	req := kmsg.NewPtrMetadataRequest()
	req.AllowAutoTopicCreation = false
	for _, t := range topics {
		rt := kmsg.NewMetadataRequestTopic()
		rt.Topic = kmsg.StringPtr(t)
		req.Topics = append(req.Topics, rt)
	}
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return nil, fmt.Errorf("check topics %s: %w", strings.Join(topics, ", "), err)
	}
	found := map[string]bool{}
	for _, t := range resp.Topics {
		if t.Topic == nil {
			continue
		}
		err := kerr.ErrorForCode(t.ErrorCode)
		switch {
		case err == nil:
			found[*t.Topic] = true
		case errors.Is(err, kerr.UnknownTopicOrPartition):
		default:
			return nil, fmt.Errorf("check topic %s: %w", *t.Topic, err)
		}
	}
	var missing []string
	for _, t := range topics {
		if !found[t] {
			missing = append(missing, t)
		}
	}
	return missing, nil
}

// Topics returns the topics the consumer subscribes to, sorted.
func (c *Consumer) Topics() []string {
	return slices.Sorted(maps.Keys(c.byTopic))
}

// CheckTopics runs CheckTopics for the consumer's topics. Call it before
// Run (the consumer opens its group client only in Run): it uses a
// short-lived client with the consumer's brokers and ClientOpts (TLS, SASL).
func (c *Consumer) CheckTopics(ctx context.Context, chk TopicCheck) error {
	cl, err := kgo.NewClient(append(append([]kgo.Opt{}, c.cfg.ClientOpts...), kgo.SeedBrokers(c.cfg.Brokers...))...)
	if err != nil {
		return fmt.Errorf("kafka consumer (group %s): check topics: %w", c.cfg.Group, err)
	}
	defer cl.Close()
	if err := CheckTopics(ctx, cl, c.Topics(), chk); err != nil {
		return fmt.Errorf("kafka consumer (group %s): %w", c.cfg.Group, err)
	}
	return nil
}
