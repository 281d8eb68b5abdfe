// Package guardlane lends one worker goroutine to a run of calls made one
// after another by the same goroutine: the Kafka consumer's per-partition
// loop, whose records (or batches) idem runs each on a goroutine other than
// the loop's, in one hand-off, the user code called directly on it (to
// survive runtime.Goexit: the worker ends, the loop does not). Without a
// lane each call starts a goroutine, which begins with a small stack and
// grows it again in every handler that runs pgx.
//
// A lane belongs to the goroutine that made it (With) and lives until its
// stop function is called; its worker is started by the first call that
// uses it, from that call's goroutine, and ends at stop. Nothing is shared
// between lanes or kept after stop, so a lane made inside a
// testing/synctest bubble stays inside it, and no goroutine outlives the
// loop that made it (a goroutine-leak check sees none).
package guardlane

import (
	"context"
	"sync/atomic"
)

// Lane is one reusable worker goroutine. Its zero value is not usable; see
// With.
type Lane struct {
	busy   atomic.Bool   // a call holds the lane (Acquire)
	exited chan struct{} // the running worker's, closed when it ends; nil: none. Only the holder touches it.
	jobs   chan func()
	quit   chan struct{}
}

type ctxKey struct{}

// With returns ctx carrying a new lane, and the function that ends its
// worker. stop must be called once the calls that use ctx are done (the
// worker then ends as soon as it is idle); calls made with ctx after stop
// still run, each on a goroutine of its own.
func With(ctx context.Context) (context.Context, func()) {
	l := &Lane{jobs: make(chan func()), quit: make(chan struct{})}
	return context.WithValue(ctx, ctxKey{}, l), func() { close(l.quit) }
}

// From returns the lane ctx carries, or nil.
func From(ctx context.Context) *Lane {
	l, _ := ctx.Value(ctxKey{}).(*Lane)
	return l
}

// Acquire takes the lane for one call, reporting false when another call
// holds it (calls made concurrently with the same ctx): that call then runs
// on a goroutine of its own. A successful Acquire is followed by one or
// more Runs, each after the f of the one before is done (or its worker
// ended in it: runtime.Goexit), and one Release.
func (l *Lane) Acquire() bool {
	select {
	case <-l.quit:
		return false // stopped: no worker to hand to
	default:
	}
	return l.busy.CompareAndSwap(false, true)
}

// Run hands f to the lane's worker, starting one if none is running, and
// returns once the worker has taken it (f then runs on the worker; the
// caller waits for f's own signal that it is done). A worker that ended
// inside an earlier f (runtime.Goexit, which a recovered panic during it
// does not stop) is noticed by its exit, whatever f reported, and replaced.
func (l *Lane) Run(f func()) {
	for {
		if l.exited == nil {
			l.exited = make(chan struct{})
			go l.work(l.exited)
		}
		select {
		case l.jobs <- f:
			return
		case <-l.exited:
			l.exited = nil
		case <-l.quit: // stopped meanwhile, and the worker may have ended: f runs alone
			go f()
			return
		}
	}
}

// Release gives the lane back after the call's f is done.
func (l *Lane) Release() {
	l.busy.Store(false)
}

func (l *Lane) work(exited chan struct{}) {
	defer close(exited)
	for {
		select {
		case f := <-l.jobs:
			f()
		case <-l.quit:
			return
		}
	}
}
