package idem_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemgen/idemgen/runtime/idem"
)

// The processor counts each record by outcome (applied, duplicate,
// dead-lettered, and each retried attempt), per record and in batch mode,
// and ends a span per record or batch.
func TestProcessorTelemetry(t *testing.T) {
	t.Parallel()
	_, store := consumeDB(t)
	reader := sdkmetric.NewManualReader()
	spans := tracetest.NewSpanRecorder()
	p, err := idem.NewProcessor(store, idem.ProcessorConfig{
		Retry:          idem.RetryPolicy{MaxAttempts: 3, Initial: time.Millisecond, Max: 2 * time.Millisecond},
		MeterProvider:  sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
		TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)),
	})
	if err != nil {
		t.Fatal(err)
	}
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		if e.Note == "fail" {
			return errors.New("always fails")
		}
		return insertEffect(ctx, tx, e)
	})
	rec := func(off int64, value string) *idem.Record {
		return &idem.Record{Topic: "events", Partition: 0, Offset: off, Value: []byte(value)}
	}
	processBounded(t, p, &h, rec(0, `{"id":"a","amount":1}`))
	processBounded(t, p, &h, rec(1, `{"id":"a","amount":1}`))               // duplicate
	processBounded(t, p, &h, rec(2, `{"id":"b","amount":1,"note":"fail"}`)) // 2 retries, then dead
	if _, err := p.ProcessBatch(context.Background(), &h, []*idem.Record{   // batch: 2 applied, 1 duplicate
		rec(3, `{"id":"c","amount":1}`), rec(4, `{"id":"d","amount":1}`), rec(5, `{"id":"a","amount":1}`),
	}); err != nil {
		t.Fatal(err)
	}
	got := metricSums(t, reader, "idem.consumer.records", "idem.outcome")
	want := map[string]int64{"applied": 3, "duplicate": 2, "dead-lettered": 1, "retried": 2}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("records{outcome=%s} = %d, want %d (all: %v)", k, got[k], v, got)
		}
	}
	if n := len(spans.Ended()); n != 4 {
		t.Errorf("%d spans, want 4 (three records, one batch)", n)
	}
}
