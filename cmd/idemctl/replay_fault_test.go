package main

import (
	"bytes"
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
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
	dbURL, conn := testSchemaConn(t)
	cluster, proxies := faultproxy.KafkaCluster(t, 1, kfake.SeedTopics(1, "orders.confirmed"))
	cluster.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		faultproxy.Each(proxies, (*faultproxy.Proxy).Blackhole) // the response is never delivered
		return nil, nil, false
	})
	t.Setenv("DATABASE_URL", dbURL)
	t.Setenv("KAFKA_BROKERS", strings.Join(cluster.ListenAddrs(), ","))
	t.Setenv("IDEMCTL_TIMEOUT", "5s")

	ctx := context.Background()
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
	replayed, err := deadLetterReplayedAt(conn)
	if err != nil {
		t.Fatal(err)
	}
	if replayed != nil {
		t.Errorf("dead letter marked replayed at %v though the broker never acked", replayed)
	}
}

// TestReplayMarkLostAfterAck: the database connection of the replay is
// lost after the broker got the record and before the mark commits (here:
// terminated while the produce request is at the broker, which then acks).
// idemctl must say that the record WAS produced and the dead letter NOT
// marked, and what to do about it; it said "produced, but marking it
// replayed failed (a second replay is deduplicated by event id)", which
// read as an invitation to replay it again.
func TestReplayMarkLostAfterAck(t *testing.T) {
	dbURL, conn := testSchemaConn(t)
	app := "idemctl-marklost-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	ctx := context.Background()
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders.confirmed"))
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
	terminated := make(chan int64, 8)
	cluster.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		var n int64
		if err := conn.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE application_name = $1 AND state = 'idle in transaction'`, app).Scan(&n); err != nil {
			t.Error(err)
		}
		terminated <- n
		return nil, nil, false // the broker writes the record and acks
	})
	t.Setenv("DATABASE_URL", dbURL+"&application_name="+app)
	t.Setenv("KAFKA_BROKERS", strings.Join(cluster.ListenAddrs(), ","))
	insertReplayableDeadLetter(t, conn)

	var stdout, stderr bytes.Buffer
	code := run(ctx, []string{"deadletters", "replay", "--id", "1", "--yes", "--timeout", "10s"}, &stdout, &stderr)
	select {
	case n := <-terminated:
		if n != 1 {
			t.Fatalf("terminated %d replay connections at the produce, want 1; stderr: %s", n, stderr.String())
		}
	default:
		t.Fatalf("the broker got no produce request; exit %d, stderr: %s", code, stderr.String())
	}
	if code != exitError {
		t.Errorf("exit %d, want %d", code, exitError)
	}
	t.Logf("stderr:\n%s", stderr.String())
	for _, w := range []string{
		"the record WAS produced (the broker acked it) but the dead letter was NOT marked replayed",
		"do not replay it again",
		"idemctl deadletters show --id 1",
		"idemctl deadletters discard --id 1 --yes",
	} {
		if !strings.Contains(stderr.String(), w) {
			t.Errorf("stderr does not say %q:\n%s", w, stderr.String())
		}
	}
	if replayed, err := deadLetterReplayedAt(conn); err != nil || replayed != nil {
		t.Errorf("replayed_at = %v (%v), want NULL: the mark's connection was lost", replayed, err)
	}
	// The record is in the topic all the same.
	cl, err := kgo.NewClient(kgo.SeedBrokers(cluster.ListenAddrs()...), kgo.ConsumeTopics("orders.confirmed"),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var got []*kgo.Record
	for len(got) == 0 && pctx.Err() == nil {
		got = append(got, cl.PollFetches(pctx).Records()...)
	}
	if len(got) != 1 || string(got[0].Value) != "v" {
		t.Errorf("records in the topic: %d, want the replayed one", len(got))
	}
}
