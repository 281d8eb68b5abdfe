package idem_test

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/benchkit"
	"github.com/idemgen/idemgen/internal/faultproxy"
)

// remoteHop is the time BenchmarkHTTPRemoteDB's proxy holds every chunk,
// each way (faultproxy.PreciseLatency): a round trip to the database about
// 0.5 ms longer than on loopback (measured and printed with the rows),
// about what a database in another zone of the same region adds.
const remoteHop = 200 * time.Microsecond

// BenchmarkHTTPRemoteDB is BenchmarkHTTPSideBySide's bare and first
// requests with PostgreSQL a network hop away: the pool (8 connections, as
// there) connects through a faultproxy that holds every chunk, each way,
// for remoteHop (PreciseLatency). On loopback the Go client and PostgreSQL share the
// machine's 2 cores and throughput at 64 workers is bound by CPU, where a
// first request's extra statements and key row cost the most; with the
// database across a network a request also holds its connection for its
// round trips, three for either kind. The proxy's own CPU is counted in
// the client's. Rows: latency at 1 worker, throughput at 64. Run:
//
//	go run ./cmd/idembench -only http-remote
//	go test ./runtime/idem -run '^$' -bench HTTPRemoteDB -benchtime 1x
func BenchmarkHTTPRemoteDB(b *testing.B) {
	var px *faultproxy.Proxy
	hb := newHTTPBench(b, func(c *pgxpool.Config) {
		c.MaxConns = 8
		px = faultproxy.New(b, net.JoinHostPort(c.ConnConfig.Host, strconv.Itoa(int(c.ConnConfig.Port))))
		host, port, err := net.SplitHostPort(px.Addr())
		if err != nil {
			b.Fatal(err)
		}
		p, _ := strconv.Atoi(port)
		c.ConnConfig.Host, c.ConnConfig.Port, c.ConnConfig.Fallbacks = host, uint16(p), nil
	})
	px.PreciseLatency(remoteHop)
	rtt := addedRTT(b, hb.pool, px.Target())
	pids, err := benchkit.BackendPIDs(context.Background(), hb.pool, 8)
	if err != nil {
		b.Fatal(err)
	}
	rounds := benchkit.Pick(2, 6)
	for _, c := range []int{1, 64} {
		n := benchkit.Pick(map[int]int{1: 300, 64: 1200}, map[int]int{1: 1000, 64: 6000})[c]
		r := hb.rounds(b, pids, c, n, rounds, []string{"bare", "first"}, noReplayKeys)
		sec := fmt.Sprintf("HTTP c=%d, database a hop away", c)
		detail := fmt.Sprintf("%s; bare %.0f/s p50 %.2fms p99 %.2fms; first %.0f/s p50 %.2fms p99 %.2fms", rtt,
			r.thr["bare"], benchkit.Ms(r.p50["bare"]), benchkit.Ms(r.p99["bare"]), r.thr["first"], benchkit.Ms(r.p50["first"]), benchkit.Ms(r.p99["first"]))
		if c == 1 {
			benchkit.Emit(benchkit.Row{Section: sec, Name: "first/bare latency p50", Unit: "ratio",
				Value: float64(r.p50["first"]) / float64(r.p50["bare"]), Detail: detail})
			continue
		}
		per := func(k string) float64 {
			return float64((r.cpu[k].Client + r.cpu[k].Server).Microseconds()) / float64(n*rounds)
		}
		benchkit.Emit(benchkit.Row{Section: sec, Name: "first/bare throughput", Unit: "ratio",
			Value: r.thr["first"] / r.thr["bare"], Detail: detail})
		benchkit.Emit(benchkit.Row{Section: sec, Name: "first/bare CPU per request", Unit: "ratio",
			Value: per("first") / per("bare"), Detail: fmt.Sprintf("µs of CPU per request, client (with the proxy) + PostgreSQL backends: bare %.0f, first %.0f", per("bare"), per("first"))})
	}
}

// addedRTT describes the round trip pool's proxy adds: the p50 of 300
// `SELECT 1` on a connection of pool (through the proxy) and on a
// connection of the same configuration to target (PostgreSQL, directly).
func addedRTT(b *testing.B, pool *pgxpool.Pool, target string) string {
	ctx := context.Background()
	p50 := func(q interface {
		Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
	}) time.Duration {
		var ds []time.Duration
		for range 300 {
			t := time.Now()
			if _, err := q.Exec(ctx, "SELECT 1"); err != nil {
				b.Fatal(err)
			}
			ds = append(ds, time.Since(t))
		}
		return benchkit.Percentile(ds, 0.5)
	}
	cfg := pool.Config().ConnConfig.Copy()
	host, port, err := net.SplitHostPort(target)
	if err != nil {
		b.Fatal(err)
	}
	pn, _ := strconv.Atoi(port)
	cfg.Host, cfg.Port = host, uint16(pn)
	direct, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer direct.Close(ctx)
	proxied, err := pool.Acquire(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer proxied.Release()
	d, x := p50(direct), p50(proxied)
	return fmt.Sprintf("round trip +%.2fms (SELECT 1 p50 %.2fms through the proxy, %.2fms direct)", benchkit.Ms(x-d), benchkit.Ms(x), benchkit.Ms(d))
}
