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
// from getrusage and /proc/<pid>/stat. Other sessions' backends are not
// counted, so other work on a shared server does not pollute it.
type CPU struct {
	Client, Server time.Duration
}

// Sub is c − d.
func (c CPU) Sub(d CPU) CPU { return CPU{Client: c.Client - d.Client, Server: c.Server - d.Server} }

// ReadCPU reads the CPU time of this process and of the backends pids.
// /proc counts in clock ticks (10 ms): measure over enough work.
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

// procCPU is utime + stime of process pid, 0 if it cannot be read.
func procCPU(pid int32) time.Duration {
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
