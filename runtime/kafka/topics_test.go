package kafka_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// TestCheckTopics: a missing topic is an error naming it (and nothing is
// created by asking); with CreatePartitions it is created with that many
// partitions; existing topics pass.
func TestCheckTopics(t *testing.T) {
	brokers := cluster(t, 1, "present")
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx := context.Background()
	if err := kafka.CheckTopics(ctx, cl, []string{"present"}, kafka.TopicCheck{}); err != nil {
		t.Fatalf("existing topic: %v", err)
	}
	err = kafka.CheckTopics(ctx, cl, []string{"present", "absent-b", "absent-a"}, kafka.TopicCheck{})
	if !errors.Is(err, kafka.ErrMissingTopics) || !strings.Contains(err.Error(), "absent-a, absent-b") || strings.Contains(err.Error(), "present") {
		t.Fatalf("err = %v, want ErrMissingTopics naming absent-a, absent-b only", err)
	}
	// Checking did not create them.
	if err := kafka.CheckTopics(ctx, cl, []string{"absent-a"}, kafka.TopicCheck{}); !errors.Is(err, kafka.ErrMissingTopics) {
		t.Fatalf("second check: %v, want still missing", err)
	}
	if err := kafka.CheckTopics(ctx, cl, []string{"absent-a", "present"}, kafka.TopicCheck{CreatePartitions: 3}); err != nil {
		t.Fatalf("create: %v", err)
	}
	req := kmsg.NewPtrMetadataRequest()
	rt := kmsg.NewMetadataRequestTopic()
	rt.Topic = kmsg.StringPtr("absent-a")
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Topics) != 1 || resp.Topics[0].ErrorCode != 0 || len(resp.Topics[0].Partitions) != 3 {
		t.Fatalf("created topic metadata: %+v", resp.Topics)
	}
}

// TestConsumerCheckTopics: the consumer checks the topics of its handlers.
func TestConsumerCheckTopics(t *testing.T) {
	brokers := cluster(t, 1, "orders")
	handlers := []idem.EventHandler{
		idem.Consume(idem.EventSpec[order]{Topic: "orders", Context: "a"}, nil),
		idem.Consume(idem.EventSpec[order]{Topic: "refunds", Context: "b"}, nil),
	}
	c, err := kafka.NewConsumer(idem.NewStore(db(t)), kafka.ConsumerConfig{Brokers: brokers, Group: "g", Handlers: handlers})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(c.Topics(), ","); got != "orders,refunds" {
		t.Errorf("Topics() = %s", got)
	}
	err = c.CheckTopics(context.Background(), kafka.TopicCheck{})
	if !errors.Is(err, kafka.ErrMissingTopics) || !strings.Contains(err.Error(), "refunds") {
		t.Fatalf("err = %v, want refunds missing", err)
	}
}
