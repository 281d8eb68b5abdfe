package idem_test

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemgen/idemgen/runtime/idem"
)

// metricSums collects reader and sums every Int64 counter's points by
// metric name and the value of attribute key (all points when key is "").
func metricSums(t *testing.T, reader *sdkmetric.ManualReader, name string, key attribute.Key) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				v, _ := dp.Attributes.Value(key)
				out[v.Emit()] += dp.Value
			}
		}
	}
	return out
}

// The HTTP engine reports each operation's outcome (executed, replayed, the
// problem's status), counts requests that waited for their key, and ends one
// span per operation carrying the endpoint and the outcome.
func TestHTTPTelemetry(t *testing.T) {
	e := newEnv(t)
	reader := sdkmetric.NewManualReader()
	spans := tracetest.NewSpanRecorder()
	e.cfg.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	e.cfg.TracerProvider = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	release := make(chan struct{})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	defer unblock()
	e.hook = func(_ context.Context, _ pgx.Tx, req chargeReq) error {
		if req.Order == "slow" {
			<-release
		}
		return nil
	}
	h := e.handler(idem.Endpoint{Wait: 30 * time.Second})

	if r := do(h, "k1", body1); r.status != http.StatusCreated {
		t.Fatalf("first: %d %s", r.status, r.body)
	}
	if r := do(h, "k1", body1); r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay: %d %s", r.status, r.body)
	}
	wantProblem(t, do(h, "k1", `{"order":"o-2","amount":1}`), http.StatusUnprocessableEntity)
	wantProblem(t, do(h, "", body1), http.StatusBadRequest)

	// A duplicate of an in-flight key waits for its turn, then replays.
	slow := `{"order":"slow","amount":1}`
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); do(h, "k2", slow) }()
	waitFor(t, func() bool { return e.calls.Load() == 2 })
	go func() { defer wg.Done(); do(h, "k2", slow) }()
	waitFor(t, func() bool { return metricSums(t, reader, "idem.http.key_waits", "")[""] == 1 })
	unblock()
	wg.Wait()

	got := metricSums(t, reader, "idem.http.operations", "idem.outcome")
	want := map[string]int64{"executed": 2, "replayed": 2, "422": 1, "400": 1}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("operations{outcome=%s} = %d, want %d (all: %v)", k, got[k], v, got)
		}
	}
	ended := spans.Ended()
	if len(ended) != 6 {
		t.Fatalf("%d spans, want 6", len(ended))
	}
	var errorSpans int
	for _, s := range ended {
		if s.Name() != "idem.http POST /charges" {
			t.Errorf("span %q", s.Name())
		}
		if s.Status().Code == codes.Error {
			errorSpans++
		}
	}
	if errorSpans != 0 {
		// 400 and 422 are the client's; they are outcomes, not span errors.
		t.Errorf("%d spans marked as errors, want 0", errorSpans)
	}
}

// A handler that panics is not an "executed" operation: net/http recovers
// the panic and drops the response, so the client saw a failure. The
// operation counts as a 500 and its span is an error (it counted as executed,
// with an OK span, because the outcome was read from a status never written).
// The panic itself still reaches net/http.
func TestHTTPTelemetryPanic(t *testing.T) {
	e := newEnv(t)
	reader := sdkmetric.NewManualReader()
	spans := tracetest.NewSpanRecorder()
	e.cfg.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	e.cfg.TracerProvider = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	e.hook = func(context.Context, pgx.Tx, chargeReq) error { panic("handler bug") }
	h := e.handler(idem.Endpoint{})
	func() {
		defer func() {
			if r := recover(); r != "handler bug" {
				t.Errorf("recovered %v, want the handler's panic to reach net/http", r)
			}
		}()
		do(h, "k1", body1)
	}()
	got := metricSums(t, reader, "idem.http.operations", "idem.outcome")
	if got["executed"] != 0 || got["500"] != 1 {
		t.Errorf("operations by outcome = %v, want one 500 and no executed", got)
	}
	ended := spans.Ended()
	if len(ended) != 1 || ended[0].Status().Code != codes.Error {
		t.Errorf("spans %v, want one with an error status", ended)
	}
}
