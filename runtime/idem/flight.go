package idem

import (
	"context"
	"sync"
	"time"
)

// flights gives each key one turn at a time in this process. A request
// holds its key's turn while it uses the database for that key; duplicates
// arriving meanwhile wait here, on a channel, holding no pooled connection
// and no transaction, and then replay (normally) with one short transaction
// each. So a retry storm on one key costs one connection, not one per
// duplicate, and cannot drain the pool for other endpoints.
type flights struct {
	mu sync.Mutex
	m  map[Key]*flight
	// waited, if set, is told about each request that has to wait for its
	// key's turn (the idem.http.key_waits counter).
	waited func(context.Context)
}

type flight struct {
	turn  chan struct{} // capacity 1: whoever sent into it holds the turn
	users int           // holders and waiters, guarded by flights.mu
}

// wait takes key's turn, waiting until deadline. It returns errInFlight
// when another request of this process still holds the turn then, or ctx's
// error. With noWait it never waits: it returns at once, with or without the
// turn (a request that does not wait holds a connection only for one
// attempt, so it needs no turn).
func (f *flights) wait(ctx context.Context, key Key, deadline time.Time, noWait bool) (release func(), err error) {
	f.mu.Lock()
	if f.m == nil {
		f.m = map[Key]*flight{}
	}
	fl := f.m[key]
	if fl == nil {
		fl = &flight{turn: make(chan struct{}, 1)}
		f.m[key] = fl
	}
	fl.users++
	f.mu.Unlock()

	leave := func() {
		f.mu.Lock()
		if fl.users--; fl.users == 0 {
			delete(f.m, key)
		}
		f.mu.Unlock()
	}
	release = func() { <-fl.turn; leave() }
	select {
	case fl.turn <- struct{}{}:
		return release, nil
	default:
	}
	if noWait {
		// Not waiting for the turn: one attempt without it tells whether
		// the holder is really running the key (409) or only replaying it.
		leave()
		return func() {}, nil
	}
	if f.waited != nil {
		f.waited(ctx)
	}
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case fl.turn <- struct{}{}:
		return release, nil
	case <-t.C:
		leave()
		return nil, errInFlight
	case <-ctx.Done():
		leave()
		return nil, ctx.Err()
	}
}
