// Package telemetry holds every OpenTelemetry instrument of the runtime, in
// one place, so names, units and attributes are defined once and documented
// once (the README's "Metrics and traces" table lists them).
//
// It depends on the OpenTelemetry API only. A component takes a
// metric.MeterProvider and a trace.TracerProvider (nil: the global ones,
// which are no-ops until the service installs an SDK), so idemgen never
// forces an SDK or an exporter on its users.
package telemetry

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of every meter and tracer.
const ScopeName = "github.com/idemgen/idemgen/runtime/idem"

// Attribute keys.
const (
	KeyEndpoint  = attribute.Key("idem.endpoint")
	KeyOutcome   = attribute.Key("idem.outcome")
	KeyScope     = attribute.Key("idem.key.scope")
	KeyConsumer  = attribute.Key("idem.consumer")
	KeyTopic     = attribute.Key("messaging.destination.name")
	KeyPartition = attribute.Key("messaging.kafka.destination.partition")
	KeyOffset    = attribute.Key("messaging.kafka.offset")
	KeyState     = attribute.Key("idem.state")
)

// Telemetry is the set of instruments of one component. Its methods are safe
// for concurrent use; a nil *Telemetry records nothing.
type Telemetry struct {
	tracer trace.Tracer
	meter  metric.Meter

	httpOps      metric.Int64Counter
	httpDuration metric.Float64Histogram
	httpWaits    metric.Int64Counter

	records        metric.Int64Counter
	recordDuration metric.Float64Histogram
	retryBackoff   metric.Float64Gauge
	storageWaits   metric.Int64Counter

	relayPublished metric.Int64Counter
	relayFailed    metric.Int64Counter
	relayParked    metric.Int64Counter
	relayLeader    metric.Int64Gauge
	relayBackoff   metric.Float64Gauge

	// recordAttrs caches a *recordAttrs per recordKey: what RecordStart
	// would otherwise build again for every record.
	recordAttrs sync.Map
	lastAttrs   atomic.Pointer[recordAttrs] // the one attrsFor returned last
}

// recordKey is a consumer and a topic it consumes.
type recordKey struct{ consumer, topic string }

// recordAttrs is what every record of one consumer and topic shares: the
// span name and the metric attribute sets, built once (an attribute set is
// sorted and allocated each time it is made).
type recordAttrs struct {
	key      recordKey
	spanName string
	kind     trace.SpanStartOption    // SpanKindConsumer
	ids      trace.SpanStartOption    // the consumer and topic attributes of the span
	duration metric.MeasurementOption // consumer, topic
	outcomes map[string]metric.MeasurementOption
}

// recordOutcomes are the outcome values RecordStart's finish function is
// given (idem.Outcome's names and "cancelled"); others are built per call.
var recordOutcomes = []string{"applied", "duplicate", "dead-lettered", "cancelled"}

// attrsFor returns the cached recordAttrs of consumer and topic.
// The last one returned is checked first: a consumer's records come from
// one handler and topic at a time, and a sync.Map lookup boxes its key (an
// allocation per record).
func (t *Telemetry) attrsFor(consumer, topic string) *recordAttrs {
	if a := t.lastAttrs.Load(); a != nil && a.key.consumer == consumer && a.key.topic == topic {
		return a
	}
	k := recordKey{consumer, topic}
	if a, ok := t.recordAttrs.Load(k); ok {
		t.lastAttrs.Store(a.(*recordAttrs))
		return a.(*recordAttrs)
	}
	a := &recordAttrs{
		key:      k,
		spanName: "idem.consume " + topic,
		kind:     trace.WithSpanKind(trace.SpanKindConsumer),
		ids:      trace.WithAttributes(KeyConsumer.String(consumer), KeyTopic.String(topic)),
		duration: metric.WithAttributeSet(attribute.NewSet(KeyConsumer.String(consumer), KeyTopic.String(topic))),
		outcomes: make(map[string]metric.MeasurementOption, len(recordOutcomes)),
	}
	for _, o := range recordOutcomes {
		a.outcomes[o] = a.outcome(consumer, topic, o)
	}
	v, _ := t.recordAttrs.LoadOrStore(k, a)
	t.lastAttrs.Store(v.(*recordAttrs))
	return v.(*recordAttrs)
}

// outcome returns the records counter's attributes for outcome.
func (a *recordAttrs) outcome(consumer, topic, outcome string) metric.MeasurementOption {
	if o, ok := a.outcomes[outcome]; ok {
		return o
	}
	return metric.WithAttributeSet(attribute.NewSet(KeyConsumer.String(consumer), KeyTopic.String(topic), KeyOutcome.String(outcome)))
}

// New creates the instruments on mp and tp (nil: the global providers).
// Instrument creation errors are joined and returned with a usable
// Telemetry: OpenTelemetry returns a working no-op instrument on error.
func New(mp metric.MeterProvider, tp trace.TracerProvider) (*Telemetry, error) {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	m := mp.Meter(ScopeName)
	t := &Telemetry{tracer: tp.Tracer(ScopeName), meter: m}
	var errs []error
	ctr := func(name, unit, desc string) metric.Int64Counter {
		c, err := m.Int64Counter(name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		return c
	}
	hist := func(name, desc string) metric.Float64Histogram {
		h, err := m.Float64Histogram(name, metric.WithUnit("s"), metric.WithDescription(desc),
			metric.WithExplicitBucketBoundaries(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
		errs = append(errs, err)
		return h
	}
	fgauge := func(name, desc string) metric.Float64Gauge {
		g, err := m.Float64Gauge(name, metric.WithUnit("s"), metric.WithDescription(desc))
		errs = append(errs, err)
		return g
	}
	t.httpOps = ctr("idem.http.operations", "{operation}", "Idempotent HTTP operations by endpoint and outcome (executed, replayed, or the error status).")
	t.httpDuration = hist("idem.http.duration", "Duration of idempotent HTTP operations, replays included.")
	t.httpWaits = ctr("idem.http.key_waits", "{wait}", "Requests that found their key in flight and waited for it.")
	t.records = ctr("idem.consumer.records", "{record}", "Records by consumer and outcome (applied, duplicate, dead-lettered, retried).")
	t.recordDuration = hist("idem.consumer.duration", "Time to process one record, retries included.")
	t.retryBackoff = fgauge("idem.consumer.retry_backoff", "The backoff the consumer is waiting now, before retrying a record or the database (0 when not waiting).")
	t.storageWaits = ctr("idem.consumer.storage_waits", "{wait}", "Waits for the database caused by infrastructure errors; they use no retry budget.")
	t.relayPublished = ctr("idem.relay.published", "{event}", "Outbox events published and marked PUBLISHED.")
	t.relayFailed = ctr("idem.relay.failed", "{event}", "Outbox publish failures (the event stays PENDING and is retried).")
	t.relayParked = ctr("idem.relay.parked", "{event}", "Outbox events parked (permanent error or MaxAttempts).")
	g, err := m.Int64Gauge("idem.relay.leader", metric.WithUnit("1"), metric.WithDescription("1 while this relay holds the leader lease, else 0."))
	errs = append(errs, err)
	t.relayLeader = g
	t.relayBackoff = fgauge("idem.relay.backoff", "The backoff the relay is waiting now after a broker-wide outage (0 when not waiting).")
	return t, errors.Join(errs...)
}

// Must is New for callers that cannot fail: on an instrument error it still
// returns working instruments (OpenTelemetry's are no-ops on error) and
// reports the error through otel.Handle, as the SDK does.
func Must(mp metric.MeterProvider, tp trace.TracerProvider) *Telemetry {
	t, err := New(mp, tp)
	if err != nil {
		otel.Handle(err)
	}
	return t
}

// Meter returns the meter, for observable instruments a component registers
// itself (their callbacks read the database).
func (t *Telemetry) Meter() metric.Meter { return t.meter }

// HTTPEndpoint is what every operation of one endpoint shares: the span
// name, the span's start options and the metric attribute sets, built once
// per endpoint (an attribute set is sorted and allocated each time it is
// made), where HTTPStart would build them again for every request. A nil
// *HTTPEndpoint records nothing.
type HTTPEndpoint struct {
	t        *Telemetry
	endpoint string
	spanName string
	start    []trace.SpanStartOption
	waited   metric.MeasurementOption
	outcomes map[string]metric.MeasurementOption // read only once built
}

// httpOutcomes are the outcomes HTTPEndpoint builds attribute sets for in
// advance; others (error statuses) are built per call.
var httpOutcomes = []string{"executed", "replayed"}

// HTTPEndpoint returns the instruments of endpoint, whose keys have scope.
// Build it once per endpoint and reuse it; it is safe for concurrent use.
func (t *Telemetry) HTTPEndpoint(endpoint, scope string) *HTTPEndpoint {
	if t == nil {
		return nil
	}
	e := &HTTPEndpoint{
		t:        t,
		endpoint: endpoint,
		spanName: "idem.http " + endpoint,
		start: []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindServer),
			trace.WithAttributes(KeyEndpoint.String(endpoint), KeyScope.String(scope))},
		waited:   metric.WithAttributeSet(attribute.NewSet(KeyEndpoint.String(endpoint))),
		outcomes: make(map[string]metric.MeasurementOption, len(httpOutcomes)),
	}
	for _, o := range httpOutcomes {
		e.outcomes[o] = e.outcome(o)
	}
	return e
}

// outcome returns the attributes of the operations counter and the duration
// histogram for outcome.
func (e *HTTPEndpoint) outcome(outcome string) metric.MeasurementOption {
	if o, ok := e.outcomes[outcome]; ok {
		return o
	}
	return metric.WithAttributeSet(attribute.NewSet(KeyEndpoint.String(e.endpoint), KeyOutcome.String(outcome)))
}

// Start starts an operation span and returns the finish function, which
// records the outcome counter, the duration histogram and the span status.
func (e *HTTPEndpoint) Start(ctx context.Context) (context.Context, func(outcome string, err error)) {
	if e == nil {
		return ctx, func(string, error) {}
	}
	start := time.Now()
	ctx, span := e.t.tracer.Start(ctx, e.spanName, e.start...)
	return ctx, func(outcome string, err error) {
		attrs := e.outcome(outcome)
		e.t.httpOps.Add(ctx, 1, attrs)
		e.t.httpDuration.Record(ctx, time.Since(start).Seconds(), attrs)
		end(span, outcome, err)
	}
}

// Waited counts a request that found its key in flight.
func (e *HTTPEndpoint) Waited(ctx context.Context) {
	if e == nil {
		return
	}
	e.t.httpWaits.Add(ctx, 1, e.waited)
}

// HTTPStart starts an operation span of endpoint and returns the finish
// function, as HTTPEndpoint(endpoint, scope).Start does.
func (t *Telemetry) HTTPStart(ctx context.Context, endpoint, scope string) (context.Context, func(outcome string, err error)) {
	return t.HTTPEndpoint(endpoint, scope).Start(ctx)
}

// HTTPWaited counts a request of endpoint that found its key in flight.
func (t *Telemetry) HTTPWaited(ctx context.Context, endpoint string) {
	t.HTTPEndpoint(endpoint, "").Waited(ctx)
}

// RecordStart starts a record span and returns the finish function, which
// records the outcome counter, the duration and the span status.
func (t *Telemetry) RecordStart(ctx context.Context, consumer, topic string, partition int32, offset int64) (context.Context, func(outcome string, err error)) {
	if t == nil {
		return ctx, func(string, error) {}
	}
	start := time.Now()
	a := t.attrsFor(consumer, topic)
	// The same options, in the same order, as one WithAttributes of all
	// four: the kind and the consumer and topic attributes built once.
	ctx, span := t.tracer.Start(ctx, a.spanName, a.kind, a.ids,
		trace.WithAttributes(KeyPartition.Int64(int64(partition)), KeyOffset.Int64(offset)))
	return ctx, func(outcome string, err error) {
		t.records.Add(ctx, 1, a.outcome(consumer, topic, outcome))
		t.recordDuration.Record(ctx, time.Since(start).Seconds(), a.duration)
		end(span, outcome, err)
	}
}

// BatchStart starts a span for a batch of n records of one partition and
// returns the finish function, which counts each record's outcome (outcomes
// may be a prefix of the batch when it was cancelled) and records the
// batch's duration once per record, as the per-record histogram expects.
func (t *Telemetry) BatchStart(ctx context.Context, consumer, topic string, partition int32, firstOffset int64, n int) (context.Context, func(outcomes []string, err error)) {
	if t == nil {
		return ctx, func([]string, error) {}
	}
	start := time.Now()
	a := t.attrsFor(consumer, topic)
	ctx, span := t.tracer.Start(ctx, a.spanName, trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(KeyConsumer.String(consumer), KeyTopic.String(topic),
			KeyPartition.Int64(int64(partition)), KeyOffset.Int64(firstOffset),
			attribute.Int("messaging.batch.message_count", n)))
	return ctx, func(outcomes []string, err error) {
		per := time.Since(start).Seconds() / float64(max(len(outcomes), 1))
		for _, o := range outcomes {
			t.records.Add(ctx, 1, a.outcome(consumer, topic, o))
			t.recordDuration.Record(ctx, per, a.duration)
		}
		outcome := "done"
		if err != nil {
			outcome = "cancelled"
		}
		end(span, outcome, err)
	}
}

// RecordRetried counts one failed handler attempt that will be retried.
func (t *Telemetry) RecordRetried(ctx context.Context, consumer, topic string) {
	if t == nil {
		return
	}
	t.records.Add(ctx, 1, metric.WithAttributes(KeyConsumer.String(consumer), KeyTopic.String(topic), KeyOutcome.String("retried")))
}

// ConsumerBackoff sets the backoff gauge of consumer (0 when it stops
// waiting).
func (t *Telemetry) ConsumerBackoff(ctx context.Context, consumer string, d time.Duration) {
	if t == nil {
		return
	}
	t.retryBackoff.Record(ctx, d.Seconds(), metric.WithAttributes(KeyConsumer.String(consumer)))
}

// StorageWait counts one wait for the database after an infrastructure
// error.
func (t *Telemetry) StorageWait(ctx context.Context, consumer string) {
	if t == nil {
		return
	}
	t.storageWaits.Add(ctx, 1, metric.WithAttributes(KeyConsumer.String(consumer)))
}

// RelayBatchStart starts a relay batch span.
func (t *Telemetry) RelayBatchStart(ctx context.Context) (context.Context, func(published, failed, parked int, err error)) {
	if t == nil {
		return ctx, func(int, int, int, error) {}
	}
	ctx, span := t.tracer.Start(ctx, "idem.relay batch", trace.WithSpanKind(trace.SpanKindProducer))
	return ctx, func(published, failed, parked int, err error) {
		t.RelayCounts(ctx, published, failed, parked)
		span.SetAttributes(attribute.Int("idem.relay.published", published),
			attribute.Int("idem.relay.failed", failed), attribute.Int("idem.relay.parked", parked))
		outcome := "ok"
		if err != nil {
			outcome = "error"
		}
		end(span, outcome, err)
	}
}

// RelayCounts adds to the relay's counters.
func (t *Telemetry) RelayCounts(ctx context.Context, published, failed, parked int) {
	if t == nil {
		return
	}
	if published > 0 {
		t.relayPublished.Add(ctx, int64(published))
	}
	if failed > 0 {
		t.relayFailed.Add(ctx, int64(failed))
	}
	if parked > 0 {
		t.relayParked.Add(ctx, int64(parked))
	}
}

// RelayLeader sets the leader gauge.
func (t *Telemetry) RelayLeader(ctx context.Context, leader bool) {
	if t == nil {
		return
	}
	var v int64
	if leader {
		v = 1
	}
	t.relayLeader.Record(ctx, v)
}

// RelayBackoff sets the relay's outage backoff gauge.
func (t *Telemetry) RelayBackoff(ctx context.Context, d time.Duration) {
	if t == nil {
		return
	}
	t.relayBackoff.Record(ctx, d.Seconds())
}

// Lag is what the outbox-lag and failure-count gauges report, read cheaply
// (index-only) from the database by the callback the component gives.
type Lag struct {
	Pending          int64
	OldestPendingAge time.Duration
	Parked           int64
	DeadLetters      int64
}

// RegisterLag registers the observable gauges idem.outbox.pending,
// idem.outbox.oldest_pending_age, idem.outbox.parked and idem.dead_letters,
// read by read at each collection. The returned function unregisters them.
func (t *Telemetry) RegisterLag(read func(context.Context) (Lag, error)) (func() error, error) {
	m := t.meter
	pending, err1 := m.Int64ObservableGauge("idem.outbox.pending", metric.WithUnit("{event}"),
		metric.WithDescription("Outbox events waiting to be published (PENDING and PUBLISHING)."))
	age, err2 := m.Float64ObservableGauge("idem.outbox.oldest_pending_age", metric.WithUnit("s"),
		metric.WithDescription("Age of the oldest event waiting to be published (0 when none): the outbox lag."))
	parked, err3 := m.Int64ObservableGauge("idem.outbox.parked", metric.WithUnit("{event}"),
		metric.WithDescription("Outbox events parked and waiting for an operator."))
	dead, err4 := m.Int64ObservableGauge("idem.dead_letters", metric.WithUnit("{record}"),
		metric.WithDescription("Dead letters stored and waiting for an operator."))
	if err := errors.Join(err1, err2, err3, err4); err != nil {
		return nil, err
	}
	reg, err := m.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		lag, err := read(ctx)
		if err != nil {
			return err
		}
		o.ObserveInt64(pending, lag.Pending)
		o.ObserveFloat64(age, lag.OldestPendingAge.Seconds())
		o.ObserveInt64(parked, lag.Parked)
		o.ObserveInt64(dead, lag.DeadLetters)
		return nil
	}, pending, age, parked, dead)
	if err != nil {
		return nil, err
	}
	return reg.Unregister, nil
}

// end finishes span with outcome; an error that is the caller's going away
// (cancellation) is recorded but not marked as a span error.
func end(span trace.Span, outcome string, err error) {
	if span.IsRecording() { // a span that is not ignores it; the call boxed its argument
		span.SetAttributes(KeyOutcome.String(outcome))
	}
	if err != nil && !errors.Is(err, context.Canceled) {
		span.RecordError(err)
		span.SetStatus(codes.Error, outcome)
	}
	span.End()
}
