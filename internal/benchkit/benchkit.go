// Package benchkit is what the side-by-side benchmarks share: the rows they
// emit for cmd/idembench's table, the long-mode switch, a dialer that counts
// PostgreSQL round trips on the wire, and percentiles.
package benchkit

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Prefix starts every row line a benchmark prints; cmd/idembench collects
// the lines that carry it.
const Prefix = "IDEMBENCH "

// Row is one line of the table: a measured Value (a ratio when Unit is
// "ratio"), the target if there is one, and the raw figures it was
// computed from.
type Row struct {
	Section string  `json:"section"`
	Name    string  `json:"name"`
	Value   float64 `json:"value"`
	Unit    string  `json:"unit"`
	Target  string  `json:"target,omitempty"`
	Detail  string  `json:"detail,omitempty"`
}

// Emit prints r for cmd/idembench. Benchmarks print rather than only
// ReportMetric because a table row needs text (target, detail).
func Emit(r Row) {
	b, err := json.Marshal(r)
	if err != nil {
		panic(err) // a Row always marshals
	}
	fmt.Println(Prefix + string(b))
}

// Long reports whether the long mode is on (IDEMBENCH_LONG set): more
// rounds, and the figures at 1M rows of history.
func Long() bool { return os.Getenv("IDEMBENCH_LONG") != "" }

// Pick returns short or long by the mode.
func Pick[T any](short, long T) T {
	if Long() {
		return long
	}
	return short
}

// RoundTrips counts client→server round trips on the connections dialed
// through Dial: a turnaround is a read that follows a write. A pipelined
// batch (several messages written, then the answers read) is one round trip,
// which is what it costs in latency.
type RoundTrips struct{ n atomic.Int64 }

// Count is the number of round trips so far.
func (rt *RoundTrips) Count() int64 { return rt.n.Load() }

// Dial is a pgconn DialFunc whose connections count their round trips in rt.
func (rt *RoundTrips) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return &countingConn{Conn: c, rt: rt}, nil
}

type countingConn struct {
	net.Conn
	rt *RoundTrips
	mu sync.Mutex
	// wrote: the last operation was a write, so the next read is the
	// answer to it (a turnaround).
	wrote bool
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	c.wrote = true
	c.mu.Unlock()
	return c.Conn.Write(p)
}

func (c *countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.mu.Lock()
		if c.wrote {
			c.wrote = false
			c.rt.n.Add(1)
		}
		c.mu.Unlock()
	}
	return n, err
}

// Percentile returns the q-quantile (0..1) of ds, sorting ds.
func Percentile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	i := int(q * float64(len(ds)))
	return ds[min(i, len(ds)-1)]
}

// Ms is d in milliseconds.
func Ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// History is how many rows of history (completed keys, processed events,
// published outbox rows) the HTTP, consumer and relay benchmarks put in
// their tables before measuring: none in short mode, 1M in long mode, so
// that the long run's figures are the ones at scale.
func History() int { return Pick(0, 1_000_000) }

// HistoryLabel is appended to a section name: "" or " (1M history)".
func HistoryLabel() string {
	if n := History(); n > 0 {
		return fmt.Sprintf(" (%dk history)", n/1000)
	}
	return ""
}

// Memory is a process's resident set as /proc/<pid>/status reports it
// (Linux): now (VmRSS) and its high-water mark since the process started
// (VmHWM), in bytes.
type Memory struct{ RSS, Peak int64 }

// ProcMemory reads the resident set of process pid.
func ProcMemory(pid int) (Memory, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return Memory{}, fmt.Errorf("read memory of process %d: %w", pid, err)
	}
	var m Memory
	var seen int
	for _, line := range strings.Split(string(b), "\n") {
		name, value, ok := strings.Cut(line, ":")
		if !ok || (name != "VmRSS" && name != "VmHWM") {
			continue
		}
		var kB int64
		if _, err := fmt.Sscanf(strings.TrimSpace(value), "%d kB", &kB); err != nil {
			return Memory{}, fmt.Errorf("read memory of process %d: %s: %w", pid, line, err)
		}
		if name == "VmRSS" {
			m.RSS = kB << 10
		} else {
			m.Peak = kB << 10
		}
		seen++
	}
	if seen != 2 {
		return Memory{}, fmt.Errorf("read memory of process %d: no VmRSS and VmHWM in its status", pid)
	}
	return m, nil
}

// MiB is n bytes in mebibytes.
func MiB(n int64) float64 { return float64(n) / (1 << 20) }
