package benchkit

import (
	"os"
	"testing"
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
