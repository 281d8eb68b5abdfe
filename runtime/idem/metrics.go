package idem

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.opentelemetry.io/otel/metric"

	"github.com/idemgen/idemgen/runtime/internal/db"
	"github.com/idemgen/idemgen/runtime/internal/telemetry"
)

// lagQueryTimeout bounds the read behind one collection of the store's
// gauges: a metrics scrape must never hang on a database that does not
// answer.
const lagQueryTimeout = 2 * time.Second

// RegisterMetrics registers the store's observable gauges on mp (nil: the
// global MeterProvider): idem.outbox.pending, idem.outbox.oldest_pending_age
// (the outbox lag), idem.outbox.parked and idem.dead_letters. Each collection
// reads them with one query served by partial indexes. Call it once per
// process (for example next to the relay); the returned function unregisters
// them.
func (s *Store) RegisterMetrics(mp metric.MeterProvider) (unregister func() error, err error) {
	tel, err := telemetry.New(mp, nil)
	if err != nil {
		return nil, fmt.Errorf("register store metrics: %w", err)
	}
	unregister, err = tel.RegisterLag(func(ctx context.Context) (telemetry.Lag, error) {
		ctx, cancel := context.WithTimeout(ctx, lagQueryTimeout)
		defer cancel()
		row, err := db.New(s.pool).OutboxLag(ctx)
		if err != nil {
			return telemetry.Lag{}, fmt.Errorf("read outbox lag: %w", err)
		}
		return telemetry.Lag{
			Pending:          row.Pending,
			OldestPendingAge: time.Duration(row.OldestPendingSeconds * float64(time.Second)),
			Parked:           row.Parked,
			DeadLetters:      row.DeadLetters,
		}, nil
	})
	if err != nil {
		return nil, errors.Join(errors.New("register store metrics"), err)
	}
	return unregister, nil
}
