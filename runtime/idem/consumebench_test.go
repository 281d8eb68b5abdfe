package idem_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/benchkit"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/internal/guardlane"
)

// BenchmarkProcessRecord is the per-record consumer path without a broker:
// one new record at a time through Process on a one-connection pool
// ("idempotent"), against the same INSERT in a BEGIN │ INSERT │ COMMIT
// transaction ("bare"). With nothing else in the process its figures are
// steadier than the side-by-side consumer benchmark's (go run
// ./cmd/idembench -only consumer), which shares two cores with an
// in-process broker: it reports the time per record, the client's
// allocations, and the CPU per record of this process (client_us) and of
// the connection's backend (server_us). Run:
//
//	go test ./runtime/idem -run '^$' -bench BenchmarkProcessRecord -benchmem -count 5
func BenchmarkProcessRecord(b *testing.B) {
	pool := pgtest.PoolConfig(b, func(c *pgxpool.Config) { c.MaxConns = 1 })
	ctx := context.Background()
	if err := idem.Migrate(ctx, pool); err != nil {
		b.Fatal(err)
	}
	pgtest.Exec(b, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
	pids, err := benchkit.BackendPIDs(ctx, pool, 1)
	if err != nil {
		b.Fatal(err)
	}
	cpu := func(b *testing.B, run func(i int)) {
		for i := range 50 { // warm pgx's statement cache and the plans
			run(-1 - i)
		}
		b.ReportAllocs()
		b.ResetTimer()
		before := benchkit.ReadCPU(pids)
		for i := 0; b.Loop(); i++ {
			run(i)
		}
		used := benchkit.ReadCPU(pids).Sub(before)
		b.ReportMetric(float64(used.Client.Microseconds())/float64(b.N), "client_us/op")
		b.ReportMetric(float64(used.Server.Microseconds())/float64(b.N), "server_us/op")
	}
	b.Run("bare", func(b *testing.B) {
		gen := time.Now().UnixNano() // ids new in every run (-count, b.Loop's rounds)
		cpu(b, func(i int) {
			id := fmt.Sprintf("bare-%d-%d", gen, i)
			if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, amount) VALUES ($1, $2)`, id, 1)
				return err
			}); err != nil {
				b.Fatal(err)
			}
		})
	})
	b.Run("idempotent", func(b *testing.B) {
		p, err := idem.NewProcessor(idem.NewStore(pool), idem.ProcessorConfig{})
		if err != nil {
			b.Fatal(err)
		}
		h := handler(insertEffect)
		// As kafka.Consumer's partition loop: its handler calls share one
		// worker goroutine (guardlane).
		lane, stop := guardlane.With(ctx)
		defer stop()
		gen := time.Now().UnixNano() // ids new in every run (-count, b.Loop's rounds)
		cpu(b, func(i int) {
			rec := &idem.Record{Topic: "events", Offset: int64(i), Value: fmt.Appendf(nil, `{"id":"rec-%d-%d","amount":1}`, gen, i)}
			if o, err := p.Process(lane, &h, rec); err != nil || o != idem.Applied {
				b.Fatalf("%v, %v", o, err)
			}
		})
	})
}
