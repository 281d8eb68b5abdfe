package main

import (
	"fmt"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/idemgen/idemgen/runtime/idem"
)

// metricsHandler is what serves /metrics; nil until setupMetrics ran (demo
// and the single-purpose commands do not serve metrics).
var metricsHandler http.Handler

// setupMetrics installs an OpenTelemetry SDK whose reader is a Prometheus
// exporter, as the global MeterProvider: the runtime's components use the
// global provider when their config names none, so this one call
// instruments the HTTP engine, the consumers and the relay. The store's
// gauges (outbox lag, parked events, dead letters) are registered too.
// The runtime itself depends on the OpenTelemetry API only; the SDK and the
// exporter are the service's choice, made here.
func setupMetrics(store *idem.Store) (stop func(), err error) {
	reg := prometheus.NewRegistry()
	exporter, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		return nil, fmt.Errorf("metrics: prometheus exporter: %w", err)
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter))
	otel.SetMeterProvider(mp)
	unregister, err := store.RegisterMetrics(mp)
	if err != nil {
		return nil, err
	}
	metricsHandler = promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
	return func() { _ = unregister() }, nil
}
