package telemetry_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemgen/idemgen/runtime/internal/telemetry"
)

// collect reads every metric from reader, by name.
func collect(t *testing.T, reader *sdkmetric.ManualReader) map[string]metricdata.Aggregation {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	out := map[string]metricdata.Aggregation{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			out[m.Name] = m.Data
		}
	}
	return out
}

func sumFor(t *testing.T, agg metricdata.Aggregation, kv ...attribute.KeyValue) int64 {
	t.Helper()
	sum, ok := agg.(metricdata.Sum[int64])
	if !ok {
		t.Fatalf("aggregation %T, want Sum[int64]", agg)
	}
	want := attribute.NewSet(kv...)
	var n int64
	for _, dp := range sum.DataPoints {
		match := true
		for _, a := range want.ToSlice() {
			if v, ok := dp.Attributes.Value(a.Key); !ok || v != a.Value {
				match = false
			}
		}
		if match {
			n += dp.Value
		}
	}
	return n
}

func setup(t *testing.T) (*telemetry.Telemetry, *sdkmetric.ManualReader, *tracetest.SpanRecorder) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	tel, err := telemetry.New(mp, tp)
	if err != nil {
		t.Fatal(err)
	}
	return tel, reader, rec
}

func TestHTTPInstruments(t *testing.T) {
	tel, reader, rec := setup(t)
	ctx := context.Background()
	for _, outcome := range []string{"executed", "replayed", "replayed", "409"} {
		_, done := tel.HTTPStart(ctx, "POST /payments", "scope")
		done(outcome, nil)
	}
	tel.HTTPWaited(ctx, "POST /payments")
	m := collect(t, reader)
	if got := sumFor(t, m["idem.http.operations"], telemetry.KeyOutcome.String("replayed")); got != 2 {
		t.Errorf("replayed = %d, want 2", got)
	}
	if got := sumFor(t, m["idem.http.key_waits"]); got != 1 {
		t.Errorf("key_waits = %d, want 1", got)
	}
	h, ok := m["idem.http.duration"].(metricdata.Histogram[float64])
	if !ok || len(h.DataPoints) == 0 || h.DataPoints[0].Count+func() uint64 {
		var c uint64
		for _, dp := range h.DataPoints[1:] {
			c += dp.Count
		}
		return c
	}() != 4 {
		t.Errorf("duration histogram = %+v, want 4 observations", m["idem.http.duration"])
	}
	spans := rec.Ended()
	if len(spans) != 4 {
		t.Fatalf("%d spans, want 4", len(spans))
	}
	if spans[0].Name() != "idem.http POST /payments" {
		t.Errorf("span name %q", spans[0].Name())
	}
}

func TestRecordInstrumentsAndCancellation(t *testing.T) {
	tel, reader, rec := setup(t)
	ctx := context.Background()
	_, done := tel.RecordStart(ctx, "billing", "orders", 3, 42)
	done("applied", nil)
	_, done = tel.RecordStart(ctx, "billing", "orders", 3, 43)
	done("cancelled", context.Canceled)
	_, done = tel.RecordStart(ctx, "billing", "orders", 3, 44)
	done("dead-lettered", errors.New("boom"))
	tel.RecordRetried(ctx, "billing", "orders")
	tel.ConsumerBackoff(ctx, "billing", 2*time.Second)
	m := collect(t, reader)
	for outcome, want := range map[string]int64{"applied": 1, "dead-lettered": 1, "retried": 1} {
		if got := sumFor(t, m["idem.consumer.records"], telemetry.KeyOutcome.String(outcome)); got != want {
			t.Errorf("%s = %d, want %d", outcome, got, want)
		}
	}
	g, ok := m["idem.consumer.retry_backoff"].(metricdata.Gauge[float64])
	if !ok || len(g.DataPoints) != 1 || g.DataPoints[0].Value != 2 {
		t.Errorf("retry_backoff = %+v, want 2s", m["idem.consumer.retry_backoff"])
	}
	spans := rec.Ended()
	if len(spans) != 3 {
		t.Fatalf("%d spans", len(spans))
	}
	// Cancellation is recorded as the outcome but is not a span error.
	if spans[1].Status().Code == codes.Error {
		t.Errorf("a cancelled record's span is marked as an error")
	}
	if spans[2].Status().Code != codes.Error {
		t.Errorf("a dead-lettered record's span is not marked as an error")
	}
}

func TestRelayAndLagGauges(t *testing.T) {
	tel, reader, _ := setup(t)
	ctx := context.Background()
	_, done := tel.RelayBatchStart(ctx)
	done(5, 2, 1, nil)
	tel.RelayLeader(ctx, true)
	unregister, err := tel.RegisterLag(func(context.Context) (telemetry.Lag, error) {
		return telemetry.Lag{Pending: 7, OldestPendingAge: 1500 * time.Millisecond, Parked: 2, DeadLetters: 3}, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	m := collect(t, reader)
	if got := sumFor(t, m["idem.relay.published"]); got != 5 {
		t.Errorf("published = %d", got)
	}
	if got := sumFor(t, m["idem.relay.parked"]); got != 1 {
		t.Errorf("parked = %d", got)
	}
	if g := m["idem.relay.leader"].(metricdata.Gauge[int64]); g.DataPoints[0].Value != 1 {
		t.Errorf("leader = %d", g.DataPoints[0].Value)
	}
	if g := m["idem.outbox.pending"].(metricdata.Gauge[int64]); g.DataPoints[0].Value != 7 {
		t.Errorf("pending = %d", g.DataPoints[0].Value)
	}
	if g := m["idem.outbox.oldest_pending_age"].(metricdata.Gauge[float64]); g.DataPoints[0].Value != 1.5 {
		t.Errorf("oldest age = %v", g.DataPoints[0].Value)
	}
	if g := m["idem.dead_letters"].(metricdata.Gauge[int64]); g.DataPoints[0].Value != 3 {
		t.Errorf("dead letters = %d", g.DataPoints[0].Value)
	}
	if err := unregister(); err != nil {
		t.Fatal(err)
	}
	if _, ok := collect(t, reader)["idem.outbox.pending"]; ok {
		t.Errorf("pending still reported after unregister")
	}
}

// A nil *Telemetry (a component built without instruments) records nothing
// and never panics.
func TestNilTelemetry(t *testing.T) {
	var tel *telemetry.Telemetry
	ctx, done := tel.HTTPStart(context.Background(), "e", "s")
	done("executed", nil)
	_, d2 := tel.RecordStart(ctx, "c", "t", 0, 0)
	d2("applied", nil)
	tel.RelayLeader(ctx, true)
}

// The record instruments' attribute sets are built once per consumer and
// topic (recordAttrs) and reused: each record still counts under its own
// consumer, topic and outcome, per record and per batch, an outcome outside
// the cached ones included, and the span is named after its topic.
func TestRecordAttributesPerConsumerAndTopic(t *testing.T) {
	tel, reader, rec := setup(t)
	ctx := context.Background()
	for range 2 {
		for _, c := range []struct{ consumer, topic string }{{"billing", "orders"}, {"billing", "refunds"}, {"shipping", "orders"}} {
			_, done := tel.RecordStart(ctx, c.consumer, c.topic, 0, 1)
			done("applied", nil)
			_, done = tel.RecordStart(ctx, c.consumer, c.topic, 0, 2)
			done("unknown", nil)
		}
	}
	_, done := tel.BatchStart(ctx, "shipping", "orders", 0, 3, 2)
	done([]string{"duplicate", "applied"}, nil)
	m := collect(t, reader)
	for _, c := range []struct {
		consumer, topic, outcome string
		want                     int64
	}{
		{"billing", "orders", "applied", 2}, {"billing", "refunds", "applied", 2}, {"shipping", "orders", "applied", 3},
		{"billing", "orders", "unknown", 2}, {"shipping", "orders", "duplicate", 1}, {"billing", "refunds", "duplicate", 0},
	} {
		if got := sumFor(t, m["idem.consumer.records"], telemetry.KeyConsumer.String(c.consumer), telemetry.KeyTopic.String(c.topic),
			telemetry.KeyOutcome.String(c.outcome)); got != c.want {
			t.Errorf("%s/%s/%s = %d, want %d", c.consumer, c.topic, c.outcome, got, c.want)
		}
	}
	h, ok := m["idem.consumer.duration"].(metricdata.Histogram[float64])
	if !ok {
		t.Fatalf("duration: %T", m["idem.consumer.duration"])
	}
	counts := map[string]uint64{}
	for _, dp := range h.DataPoints {
		c, _ := dp.Attributes.Value(telemetry.KeyConsumer)
		tp, _ := dp.Attributes.Value(telemetry.KeyTopic)
		counts[c.AsString()+"/"+tp.AsString()] += dp.Count
	}
	if want := map[string]uint64{"billing/orders": 4, "billing/refunds": 4, "shipping/orders": 6}; fmt.Sprint(counts) != fmt.Sprint(want) {
		t.Errorf("duration counts %v, want %v", counts, want)
	}
	names := map[string]int{}
	for _, s := range rec.Ended() {
		names[s.Name()]++
	}
	if want := map[string]int{"idem.consume orders": 9, "idem.consume refunds": 4}; fmt.Sprint(names) != fmt.Sprint(want) {
		t.Errorf("spans %v, want %v", names, want)
	}
}

// An HTTPEndpoint's span options and attribute sets are built once and
// reused: each operation still counts under its own endpoint and outcome
// (a cached one or not), its span has its own endpoint's name and
// attributes, waits count per endpoint, and a nil HTTPEndpoint records
// nothing.
func TestHTTPEndpointReused(t *testing.T) {
	tel, reader, rec := setup(t)
	ctx := context.Background()
	pay, refund := tel.HTTPEndpoint("POST /payments", "pay"), tel.HTTPEndpoint("POST /refunds", "refund")
	for range 2 {
		for _, e := range []*telemetry.HTTPEndpoint{pay, refund} {
			for _, outcome := range []string{"executed", "replayed", "409"} {
				_, done := e.Start(ctx)
				done(outcome, nil)
			}
		}
		_, done := pay.Start(ctx)
		done("503", errors.New("busy"))
	}
	pay.Waited(ctx)
	refund.Waited(ctx)
	refund.Waited(ctx)
	var none *telemetry.HTTPEndpoint
	_, done := none.Start(ctx)
	done("executed", nil)
	none.Waited(ctx)

	m := collect(t, reader)
	for _, c := range []struct {
		endpoint, outcome string
		want              int64
	}{
		{"POST /payments", "executed", 2}, {"POST /payments", "replayed", 2}, {"POST /payments", "409", 2}, {"POST /payments", "503", 2},
		{"POST /refunds", "executed", 2}, {"POST /refunds", "replayed", 2}, {"POST /refunds", "409", 2}, {"POST /refunds", "503", 0},
	} {
		if got := sumFor(t, m["idem.http.operations"], telemetry.KeyEndpoint.String(c.endpoint), telemetry.KeyOutcome.String(c.outcome)); got != c.want {
			t.Errorf("%s/%s = %d, want %d", c.endpoint, c.outcome, got, c.want)
		}
	}
	if got := sumFor(t, m["idem.http.key_waits"], telemetry.KeyEndpoint.String("POST /refunds")); got != 2 {
		t.Errorf("refund waits = %d, want 2", got)
	}
	if got := sumFor(t, m["idem.http.key_waits"], telemetry.KeyEndpoint.String("POST /payments")); got != 1 {
		t.Errorf("payment waits = %d, want 1", got)
	}
	h := m["idem.http.duration"].(metricdata.Histogram[float64])
	counts := map[string]uint64{}
	for _, dp := range h.DataPoints {
		e, _ := dp.Attributes.Value(telemetry.KeyEndpoint)
		o, _ := dp.Attributes.Value(telemetry.KeyOutcome)
		counts[e.AsString()+"/"+o.AsString()] += dp.Count
	}
	if want := map[string]uint64{"POST /payments/executed": 2, "POST /payments/replayed": 2, "POST /payments/409": 2, "POST /payments/503": 2,
		"POST /refunds/executed": 2, "POST /refunds/replayed": 2, "POST /refunds/409": 2}; fmt.Sprint(counts) != fmt.Sprint(want) {
		t.Errorf("duration counts %v, want %v", counts, want)
	}
	spans := rec.Ended()
	if len(spans) != 14 {
		t.Fatalf("%d spans, want 14", len(spans))
	}
	for _, s := range spans {
		attrs := attribute.NewSet(s.Attributes()...)
		e, _ := attrs.Value(telemetry.KeyEndpoint)
		sc, _ := attrs.Value(telemetry.KeyScope)
		o, _ := attrs.Value(telemetry.KeyOutcome)
		want := map[string]string{"POST /payments": "pay", "POST /refunds": "refund"}[e.AsString()]
		if s.Name() != "idem.http "+e.AsString() || sc.AsString() != want || want == "" || o.AsString() == "" {
			t.Errorf("span %q: endpoint %q scope %q outcome %q", s.Name(), e.AsString(), sc.AsString(), o.AsString())
		}
		if (o.AsString() == "503") != (s.Status().Code == codes.Error) {
			t.Errorf("span %q outcome %q: status %v", s.Name(), o.AsString(), s.Status())
		}
	}
}

// A record's span carries its kind, consumer, topic, partition, offset and
// outcome, in that order, whatever consumer and topic came before it (the
// consumer and topic options are cached per pair, and the last pair is
// checked first); and a Telemetry made on the global provider before the
// application sets one (New(nil, nil), the consumer's default) records its
// spans, with the same attributes, once it is set.
func TestRecordSpanAttributes(t *testing.T) {
	ctx := context.Background()
	type rec struct {
		consumer, topic string
		partition       int32
		offset          int64
		outcome         string
	}
	recs := []rec{
		{"billing", "orders", 3, 42, "applied"}, {"billing", "orders", 3, 43, "duplicate"},
		{"billing", "refunds", 0, 7, "applied"}, {"shipping", "orders", 1, 9, "dead-lettered"},
		{"billing", "orders", 3, 44, "cancelled"},
	}
	check := func(t *testing.T, tel *telemetry.Telemetry, spans *tracetest.SpanRecorder) {
		t.Helper()
		for _, r := range recs {
			_, done := tel.RecordStart(ctx, r.consumer, r.topic, r.partition, r.offset)
			done(r.outcome, nil)
		}
		ended := spans.Ended()
		if len(ended) != len(recs) {
			t.Fatalf("%d spans, want %d", len(ended), len(recs))
		}
		for i, r := range recs {
			s := ended[i]
			want := fmt.Sprint([]attribute.KeyValue{telemetry.KeyConsumer.String(r.consumer), telemetry.KeyTopic.String(r.topic),
				telemetry.KeyPartition.Int64(int64(r.partition)), telemetry.KeyOffset.Int64(r.offset), telemetry.KeyOutcome.String(r.outcome)})
			if got := fmt.Sprint(s.Attributes()); got != want {
				t.Errorf("span %d attributes %s, want %s", i, got, want)
			}
			if s.Name() != "idem.consume "+r.topic || s.SpanKind() != trace.SpanKindConsumer {
				t.Errorf("span %d: %q, kind %v", i, s.Name(), s.SpanKind())
			}
		}
	}
	t.Run("provider", func(t *testing.T) {
		spans := tracetest.NewSpanRecorder()
		tel, err := telemetry.New(sdkmetric.NewMeterProvider(), sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)))
		if err != nil {
			t.Fatal(err)
		}
		check(t, tel, spans)
	})
	t.Run("global set later", func(t *testing.T) {
		tel, err := telemetry.New(nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		_, done := tel.RecordStart(ctx, "billing", "orders", 0, 1) // no provider yet: recorded nowhere
		done("applied", nil)
		spans := tracetest.NewSpanRecorder()
		otel.SetTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)))
		check(t, tel, spans)
	})
}
