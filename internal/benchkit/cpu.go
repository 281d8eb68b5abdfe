package benchkit

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// CPU is CPU time (user + system) used so far: by this process (the
// client: the handlers, pgx, the benchmark's goroutines) and by a set of
// PostgreSQL backends (the server side of one pool's connections), read
// from getrusage and /proc/<pid>/schedstat (see procCPU). Other sessions'
// backends are not counted, so other work on a shared server does not
// pollute it.
type CPU struct {
	Client, Server time.Duration
}

// Sub is c − d.
func (c CPU) Sub(d CPU) CPU { return CPU{Client: c.Client - d.Client, Server: c.Server - d.Server} }

// ReadCPU reads the CPU time of this process and of the backends pids
// (PostgreSQL backends: one thread each, see procCPU). getrusage counts in
// microseconds, a backend's schedstat in nanoseconds (in 10 ms clock ticks
// where the kernel has no schedstat: measure over enough work).
func ReadCPU(pids []int32) CPU {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	c := CPU{Client: time.Duration(ru.Utime.Nano() + ru.Stime.Nano())}
	for _, pid := range pids {
		c.Server += procCPU(pid)
	}
	return c
}

// clockTick is the unit of /proc/<pid>/stat's times (USER_HZ, 100 on Linux).
const clockTick = 10 * time.Millisecond

// procCPU is the CPU time backend pid has used, 0 if it cannot be read:
// from /proc/<pid>/schedstat (nanoseconds on the CPU) when the kernel has
// it, else utime + stime from /proc/<pid>/stat, in clock ticks of 10 ms.
// The ticks were too coarse for the server-CPU rows: a block of 1,000
// transactions of ~100 µs of backend CPU is ~10 ticks, ±1 each end. A
// backend is one thread, so its schedstat (the thread's) is the process's;
// not so for a multi-threaded process, which this is not for.
func procCPU(pid int32) time.Duration {
	if d, ok := schedCPU(pid); ok {
		return d
	}
	return statCPU(pid)
}

// schedCPU is the first field of /proc/<pid>/schedstat: time spent on the
// CPU, in nanoseconds.
func schedCPU(pid int32) (time.Duration, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(int(pid)) + "/schedstat")
	if err != nil {
		return 0, false
	}
	f := bytes.Fields(b)
	if len(f) < 1 {
		return 0, false
	}
	ns, err := strconv.ParseInt(string(f[0]), 10, 64)
	if err != nil {
		return 0, false
	}
	return time.Duration(ns), true
}

// statCPU is utime + stime of process pid from /proc/<pid>/stat, 0 if it
// cannot be read.
func statCPU(pid int32) time.Duration {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(int(pid)) + "/stat")
	if err != nil {
		return 0
	}
	// The command name (field 2) is in parentheses and may hold spaces;
	// utime and stime are fields 14 and 15, the 12th and 13th after it.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0
	}
	f := bytes.Fields(b[i+1:])
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseInt(string(f[11]), 10, 64)
	s, _ := strconv.ParseInt(string(f[12]), 10, 64)
	return time.Duration(u+s) * clockTick
}

// BackendPIDs fills pool up to n connections (acquiring n at once) and
// returns their backends' process ids, for ReadCPU. The server must be on
// this machine.
func BackendPIDs(ctx context.Context, pool *pgxpool.Pool, n int) ([]int32, error) {
	conns := make([]*pgxpool.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	pids := make([]int32, 0, n)
	for range n {
		c, err := pool.Acquire(ctx)
		if err != nil {
			return nil, err
		}
		conns = append(conns, c)
		var pid int32
		if err := c.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			return nil, fmt.Errorf("backend pid: %w", err)
		}
		pids = append(pids, pid)
	}
	return pids, nil
}
