package kafka

import "time"

// WorkerHolds reports what the worker of a partition of c's running Run
// holds: the records it took last (applying them while busy), the records
// queued behind them, and whether its partition is paused; ok is false when
// the partition has no worker.
func WorkerHolds(c *Consumer, topic string, partition int32) (taken, queued int, busy, paused, ok bool) {
	r := c.running.Load()
	if r == nil {
		return 0, 0, false, false, false
	}
	r.mu.Lock()
	w := r.workers[topicPartition{topic, partition}]
	r.mu.Unlock()
	if w == nil {
		return 0, 0, false, false, false
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.taken, len(w.queued), w.busy, w.paused, true
}

// SetBeforePurge makes c's Run call fn just before it purges a re-created
// topic from its client. Set it before Run.
func SetBeforePurge(c *Consumer, fn func(topic string)) { c.beforePurge = fn }

// SetStuckWarnAfter sets how long a partition may do no record before it is
// reported stuck, for the Runs started after it; restore sets it back.
func SetStuckWarnAfter(d time.Duration) (restore func()) {
	old := stuckWarnAfter.Swap(int64(d))
	return func() { stuckWarnAfter.Store(old) }
}

// StopWait is how long a revoke, a loss or a shutdown waits for a cancelled
// partition worker before abandoning it.
func StopWait() time.Duration { return time.Duration(stopWait.Load()) }

// SetStopWait sets how long a revoke, a loss or a shutdown waits for a
// cancelled partition worker, for the stops after it; restore sets it back.
// Only for tests that do not run in parallel: the others read StopWait.
func SetStopWait(d time.Duration) (restore func()) {
	old := stopWait.Swap(int64(d))
	return func() { stopWait.Store(old) }
}

// SetFetchBackoffFloor makes the poll loop wait at least d after a poll
// whose fetches failed and returned nothing, for the waits after it;
// restore sets it back. Only for tests that do not run in parallel.
func SetFetchBackoffFloor(d time.Duration) (restore func()) {
	old := fetchBackoffFloor.Swap(int64(d))
	return func() { fetchBackoffFloor.Store(old) }
}
