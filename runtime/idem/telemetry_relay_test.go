package idem_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// ackAllBut acks every message but those whose key is "bad", which fail
// with a permanent error (so the relay parks them at once).
type ackAllBut struct{}

func (ackAllBut) Publish(_ context.Context, msgs []idem.Message) []error {
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		if string(m.Key) == "bad" {
			errs[i] = idem.Permanent(errors.New("record too large"))
		}
	}
	return errs
}

// The relay reports published and parked events, its leadership, and one
// span per batch.
func TestRelayTelemetry(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := context.Background()
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, key := range []string{"a", "b", "bad", "c"} {
			if err := idem.Enqueue(ctx, tx, "t", key, map[string]string{"k": key}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	reader := sdkmetric.NewManualReader()
	spans := tracetest.NewSpanRecorder()
	relay, err := idem.NewRelay(idem.NewStore(pool), ackAllBut{}, idem.RelayConfig{
		PollInterval:   20 * time.Millisecond,
		MeterProvider:  sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
		TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)),
	})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(rctx) }()
	waitFor(t, func() bool {
		return metricSums(t, reader, "idem.relay.published", "")[""] == 3 &&
			metricSums(t, reader, "idem.relay.parked", "")[""] == 1
	})
	// A batch adds its counts before it ends its span: wait for the spans
	// of the batches that published and parked the four events to end too,
	// or the idle-poll check below counts a batch span ending late.
	waitFor(t, func() bool {
		var published, parked int64
		for _, s := range spans.Ended() {
			for _, kv := range s.Attributes() {
				switch kv.Key {
				case "idem.relay.published":
					published += kv.Value.AsInt64()
				case "idem.relay.parked":
					parked += kv.Value.AsInt64()
				}
			}
		}
		return published == 3 && parked == 1
	})
	leader := func() int64 {
		var rm metricdata.ResourceMetrics
		if err := reader.Collect(ctx, &rm); err != nil {
			t.Fatal(err)
		}
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				if m.Name == "idem.relay.leader" {
					return m.Data.(metricdata.Gauge[int64]).DataPoints[0].Value
				}
			}
		}
		return -1
	}
	// A span per batch that claimed rows, none for an idle poll: ten poll
	// intervals with nothing to publish add no span.
	batches := len(spans.Ended())
	time.Sleep(10 * 20 * time.Millisecond)
	if batches == 0 || len(spans.Ended()) != batches {
		t.Errorf("%d batch spans, then %d after idle polls; want at least 1, then no more", batches, len(spans.Ended()))
	}
	if got := leader(); got != 1 {
		t.Errorf("leader gauge while leading = %d, want 1", got)
	}
	if got := metricSums(t, reader, "idem.relay.failed", "")[""]; got != 0 {
		t.Errorf("failed = %d, want 0 (the parked event is counted as parked, not failed)", got)
	}
	if got := pgtest.Count(t, pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PARKED'`); got != 1 {
		t.Errorf("%d parked rows, want 1", got)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := leader(); got != 0 {
		t.Errorf("leader gauge after shutdown = %d, want 0", got)
	}
}
