//go:build !linux

package faultproxy

import "time"

// holdFor is time.Sleep where PreciseLatency has no finer clock.
func holdFor(d time.Duration) { time.Sleep(d) }
