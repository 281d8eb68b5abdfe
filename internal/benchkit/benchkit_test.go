package benchkit

import (
	"context"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/pgtest"
)

// ProcMemory reads this process's VmRSS and VmHWM, and the high-water mark
// grows by what the process touches.
func TestProcMemory(t *testing.T) {
	before, err := ProcMemory(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if before.RSS <= 0 || before.Peak < before.RSS {
		t.Fatalf("before: %+v", before)
	}
	const size = 64 << 20 // several times the test binary's own RSS
	buf := make([]byte, size)
	for i := 0; i < len(buf); i += 4096 {
		buf[i] = 1
	}
	after, err := ProcMemory(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if after.Peak-before.RSS < size*9/10 {
		t.Fatalf("after touching %d MiB: peak %.1f MiB, RSS before %.1f MiB", size>>20, MiB(after.Peak), MiB(before.RSS))
	}
	buf[len(buf)-1] = 2 // keep buf alive until here
	if _, err := ProcMemory(-1); err == nil {
		t.Fatal("no error for a process that does not exist")
	}
}

// A backend's CPU time is read in nanoseconds (schedstat), not in 10 ms
// clock ticks: a query burning a few milliseconds shows as a few
// milliseconds, where ticks read 0 or 10 ms.
func TestBackendCPUResolution(t *testing.T) {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, pgtest.BaseURL())
	if err != nil {
		t.Fatalf("connect to PostgreSQL (set DATABASE_URL): %v", err)
	}
	defer conn.Close(ctx)
	var pid int32
	if err := conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		before := ReadCPU([]int32{pid}).Server
		if _, err := conn.Exec(ctx, `SELECT count(*) FROM generate_series(1, 20000)`); err != nil {
			t.Fatal(err)
		}
		used := ReadCPU([]int32{pid}).Server - before
		if used <= 0 || used%clockTick == 0 {
			t.Fatalf("backend CPU for a short query: %v; want a positive figure finer than %v", used, clockTick)
		}
	}
}
