package idem_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

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
