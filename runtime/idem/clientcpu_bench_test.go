package idem_test

import (
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/benchkit"
)

// BenchmarkHTTPClientCPU is the Go side of BenchmarkHTTPSideBySide, for
// profiling: the bare handler, the idempotent handler on a new key
// ("first") and on a completed key ("replay"), at 1 and 8 concurrent
// callers, on a pool of 8 connections. It reports the time per request,
// the process's allocations, and the CPU per request of this process
// (client_us) and of the pool's backends (server_us). Run:
//
//	go test ./runtime/idem -run '^$' -bench HTTPClientCPU -benchmem -count 3 -cpuprofile cpu.out
func BenchmarkHTTPClientCPU(b *testing.B) {
	hb := newHTTPBench(b, func(c *pgxpool.Config) { c.MaxConns = 8 })
	const replayKeys = 256
	for i := range replayKeys {
		hb.call(b, hb.idemH, fmt.Sprintf("r-%d", i))
	}
	pids, err := benchkit.BackendPIDs(b.Context(), hb.pool, 8)
	if err != nil {
		b.Fatal(err)
	}
	gen := time.Now().UnixNano() // keys new in every run (-count, b.Loop's rounds)
	var seq atomic.Int64
	kinds := []struct {
		name string
		op   func(i int64)
	}{
		{"bare", func(int64) { hb.call(b, hb.bare, "") }},
		{"first", func(i int64) { hb.call(b, hb.idemH, fmt.Sprintf("f-%d-%d", gen, i)) }},
		{"replay", func(i int64) { hb.call(b, hb.idemH, fmt.Sprintf("r-%d", i%replayKeys)) }},
	}
	for _, c := range []int{1, 8} {
		for _, k := range kinds {
			b.Run(fmt.Sprintf("c=%d/%s", c, k.name), func(b *testing.B) {
				for range 50 { // warm pgx's statement caches
					k.op(seq.Add(1))
				}
				b.ReportAllocs()
				b.ResetTimer()
				before, ru0 := benchkit.ReadCPU(pids), rusage()
				var left atomic.Int64
				left.Store(int64(b.N))
				var wg sync.WaitGroup
				for range c {
					wg.Go(func() {
						for left.Add(-1) >= 0 {
							k.op(seq.Add(1))
						}
					})
				}
				wg.Wait()
				b.StopTimer()
				used, ru1 := benchkit.ReadCPU(pids).Sub(before), rusage()
				b.ReportMetric(float64((ru1.Utime.Nano()-ru0.Utime.Nano())/1e3)/float64(b.N), "user_us/op")
				b.ReportMetric(float64((ru1.Stime.Nano()-ru0.Stime.Nano())/1e3)/float64(b.N), "sys_us/op")
				b.ReportMetric(float64(used.Client.Microseconds())/float64(b.N), "client_us/op")
				b.ReportMetric(float64(used.Server.Microseconds())/float64(b.N), "server_us/op")
			})
		}
	}
}

// rusage is this process's resource usage so far.
func rusage() syscall.Rusage {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return ru
}
