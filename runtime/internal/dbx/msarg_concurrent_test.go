package dbx

import (
	"sync"
	"testing"
	"time"
)

// msArg (revcli) under concurrent first use of many (>64) distinct values:
// always ms(d), the cache bounded (at most a few past 64 under a race).
func TestMSArgConcurrent(t *testing.T) {
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 3000 {
				d := time.Duration((i*7919+g)%500) * time.Millisecond / 3 // sub-ms, 0, many values
				if i%5 == 0 {
					d = -d
				}
				if got, want := msArg(d).(string), ms(d); got != want {
					t.Errorf("msArg(%v) = %q, want %q", d, got, want)
					return
				}
			}
		}()
	}
	wg.Wait()
	n := 0
	msArgs.Range(func(k, v any) bool { n++; return v.(string) == ms(k.(time.Duration)) })
	t.Logf("cache entries %d, counter %d", n, msArgsLen.Load())
	if n > maxMSArgs+8 {
		t.Errorf("cache holds %d values", n)
	}
}
