package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemgen/idemgen/internal/faultproxy"
)

// TestReplayBrokerSilentAfterProduce: the broker goes silent (a partition)
// right after it received the replay's produce request. kgo's idempotent
// producer does not fail a record whose request it sent on its context
// alone (it cannot know whether the broker wrote it), so without
// AllowIdempotentProduceCancellation idemctl waited for the broker forever,
// holding the dead letter's row lock. It must give up after --timeout, exit
// 2 and leave the dead letter unreplayed: a second replay that does reach
// the broker is deduplicated by event id if the first one was written.
func TestReplayBrokerSilentAfterProduce(t *testing.T) {
	dbURL, drop, err := newSchema()
	if drop != nil {
		t.Cleanup(drop)
	}
	if err != nil {
		t.Fatal(err)
	}
	cluster, proxies := faultproxy.KafkaCluster(t, 1, kfake.SeedTopics(1, "orders.confirmed"))
	cluster.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		faultproxy.Each(proxies, (*faultproxy.Proxy).Blackhole) // the response is never delivered
		return nil, nil, false
	})
	t.Setenv("DATABASE_URL", dbURL)
	t.Setenv("KAFKA_BROKERS", strings.Join(cluster.ListenAddrs(), ","))
	t.Setenv("IDEMCTL_TIMEOUT", "5s")

	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `INSERT INTO idem_dead_letters (id, context, topic, kpartition, koffset, record_key, value, attempts, last_error)
		VALUES (1, 'billing', 'orders.confirmed', 0, 7, 'k', 'v', 3, 'boom')`); err != nil {
		t.Fatal(err)
	}

	var stdout, stderr bytes.Buffer
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"deadletters", "replay", "--id", "1", "--yes", "--timeout", "2s"}, &stdout, &stderr)
	}()
	select {
	case code := <-done:
		if code != exitError {
			t.Errorf("exit %d, want %d; stdout %q stderr %q", code, exitError, stdout.String(), stderr.String())
		}
	case <-time.After(30 * time.Second):
		// End the hung replay's transaction so the schema can be dropped.
		_, _ = conn.Exec(ctx, `SELECT pg_terminate_backend(l.pid) FROM pg_locks l
			WHERE l.relation = 'idem_dead_letters'::regclass AND l.pid <> pg_backend_pid()`)
		t.Fatal("deadletters replay still waiting for a silent broker 30s after its --timeout 2s")
	}
	if !strings.Contains(stderr.String(), "no ack from KAFKA_BROKERS within --timeout 2s") {
		t.Errorf("stderr %q does not say the broker did not ack", stderr.String())
	}
	var replayed *time.Time
	if err := conn.QueryRow(ctx, `SELECT replayed_at FROM idem_dead_letters WHERE id = 1`).Scan(&replayed); err != nil {
		t.Fatal(err)
	}
	if replayed != nil {
		t.Errorf("dead letter marked replayed at %v though the broker never acked", replayed)
	}
}
