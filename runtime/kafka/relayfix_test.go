package kafka_test

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/idemgen/idemgen/runtime/idem"
)

// Events for a topic that does not exist must not hold back the events of
// other topics forever, even when they fill whole batches: the broker
// answers (the topic is unknown), so this is no outage. The missing topic's
// rows carry a last_error naming the topic, and end PARKED after their
// attempt budget; every other event is published.
func TestMissingTopicDoesNotBlockOtherTopics(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "events")
	pool := db(t)
	var missing []keyed
	for i := range 6 {
		missing = append(missing, keyed{Key: "m", Seq: i})
	}
	enqueue(t, pool, "no-such-topic", missing...)
	enqueue(t, pool, "events", keyed{Key: "a", Seq: 0}, keyed{Key: "a", Seq: 1}, keyed{Key: "b", Seq: 0})
	logs := newLogSink()
	startRelay(t, newRelay(t, pool, publisher(t, addrs), idem.RelayConfig{
		BatchSize: 5, MaxAttempts: 2, PollInterval: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
		PublishTimeout: 40 * time.Second, Logger: slog.New(logs),
	}))
	start := time.Now()
	t.Cleanup(func() {
		if t.Failed() {
			logs.mu.Lock()
			t.Logf("relay log:\n%s", strings.Join(*logs.lines, "\n"))
			logs.mu.Unlock()
		}
	})
	distinctInKeyOrder(t, addrs, "events", 3, 0)
	t.Logf("other topic's events published after %v", time.Since(start).Round(time.Millisecond))
	waitUntil(t, "the missing topic's rows to be parked", func() bool { return statusCounts(t, pool)["PARKED"] == 6 })
	if n := count(t, pool, `SELECT count(*) FROM idem_outbox WHERE topic = 'no-such-topic' AND last_error LIKE '%UNKNOWN_TOPIC_OR_PARTITION%'`); n != 6 {
		t.Fatalf("%d parked rows say why (UNKNOWN_TOPIC_OR_PARTITION), want 6", n)
	}
	if !logs.has("no-such-topic") {
		t.Fatal("no log line names the missing topic")
	}
}
