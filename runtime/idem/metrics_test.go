package idem_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemgen/idemgen/internal/faultproxy"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// The store's gauges report the outbox lag (pending count, oldest pending
// age), parked events and dead letters waiting for an operator, read from the
// database at each collection.
func TestStoreMetrics(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, key := range []string{"a", "b", "c"} {
			if err := idem.Enqueue(ctx, tx, "t", key, map[string]string{"k": key}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `UPDATE idem_outbox SET status = 'PARKED' WHERE record_key = 'c'`)
	// A record that cannot be decoded becomes a dead letter.
	h := handler(insertEffect)
	if o := processBounded(t, processor(t, store, 1), &h, &idem.Record{Topic: "events", Value: []byte("not json")}); o != idem.DeadLettered {
		t.Fatalf("outcome %v, want dead-lettered", o)
	}
	time.Sleep(50 * time.Millisecond) // so the oldest pending event has an age

	reader := sdkmetric.NewManualReader()
	unregister, err := store.RegisterMetrics(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)))
	if err != nil {
		t.Fatal(err)
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Gauge[int64]:
				got[m.Name] = float64(d.DataPoints[0].Value)
			case metricdata.Gauge[float64]:
				got[m.Name] = d.DataPoints[0].Value
			}
		}
	}
	for name, want := range map[string]float64{"idem.outbox.pending": 2, "idem.outbox.parked": 1, "idem.dead_letters": 1} {
		if got[name] != want {
			t.Errorf("%s = %v, want %v (all: %v)", name, got[name], want, got)
		}
	}
	if age := got["idem.outbox.oldest_pending_age"]; age < 0.05 || age > 60 {
		t.Errorf("oldest pending age = %vs, want about the time since the enqueue", age)
	}
	if err := unregister(); err != nil {
		t.Fatal(err)
	}
}

// A scrape while the database is partitioned (connections accepted, never
// answered) returns: the gauges' query gives up after its own timeout, so
// /metrics answers (without those gauges) instead of hanging every scrape.
func TestStoreMetricsDatabaseBlackholed(t *testing.T) {
	t.Parallel()
	url := pgtest.Schema(t)
	direct, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close()
	if err := idem.Migrate(context.Background(), direct); err != nil {
		t.Fatal(err)
	}
	proxy := faultproxy.New(t, faultproxy.PostgresTarget(url))
	pool, err := pgxpool.New(context.Background(), proxy.RewriteURL(url))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	reader := sdkmetric.NewManualReader()
	unregister, err := idem.NewStore(pool).RegisterMetrics(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = unregister() }()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatalf("collect with the database up: %v", err)
	}
	for _, blackholeAfterConnect := range []bool{true, false} {
		if !blackholeAfterConnect {
			proxy.Cut() // new connections from now on, into the blackhole
		}
		proxy.Blackhole()
		done := make(chan error, 1)
		go func() { done <- reader.Collect(context.Background(), &rm) }()
		select {
		case err := <-done:
			t.Logf("collect (pooled connection %v): %v", blackholeAfterConnect, err)
		case <-time.After(20 * time.Second):
			t.Fatalf("collect still waiting on a blackholed database after 20s (pooled connection %v)", blackholeAfterConnect)
		}
		proxy.Restore()
	}
}
