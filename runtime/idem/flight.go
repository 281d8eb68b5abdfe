package idem

import (
	"bytes"
	"context"
	"sync"
	"time"
)

// flights gives each key one turn at a time in this process. A request
// holds its key's turn while it uses the database for that key; duplicates
// arriving meanwhile wait here, on a channel, holding no pooled connection
// and no transaction. When the holder has the key's stored response (it ran
// the function and committed, or replayed), it publishes it, and every
// duplicate waiting then, or arriving while any is still waiting, answers
// it as a replay at once, with no database work at all. So a retry storm on
// one key costs one connection, not one per duplicate, cannot drain the pool
// for other endpoints, and is never told "still in flight" (409) for a key
// that has completed.
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
	done  chan struct{} // closed when stored is set
	// stored is the key's stored response, as a replay, once a holder has
	// it; fingerprint is the request it answers. Set once, before done
	// closes, under flights.mu.
	stored      *response
	fingerprint []byte
}

// turn is a held turn on a key, or nil when the request goes without one
// (NoWait while another holds it).
type turn struct {
	f   *flights
	fl  *flight
	key Key
}

// release gives the turn back.
func (t *turn) release() {
	if t == nil {
		return
	}
	<-t.fl.turn
	t.f.leave(t.key, t.fl)
}

// publish makes out, the key's stored response for a request with
// fingerprint, the answer of the duplicates waiting for the key.
func (t *turn) publish(out *response, fingerprint []byte) {
	if t == nil {
		return
	}
	t.f.mu.Lock()
	defer t.f.mu.Unlock()
	if t.fl.stored == nil {
		t.fl.stored, t.fl.fingerprint = out, fingerprint
		close(t.fl.done)
	}
}

// replayOf answers a duplicate with fingerprint from a published stored
// response: the replay, or errFingerprint for a different request.
func replayOf(fl *flight, fingerprint []byte) (*response, error) {
	if !bytes.Equal(fl.fingerprint, fingerprint) {
		return nil, errFingerprint
	}
	return fl.stored, nil
}

func (f *flights) leave(key Key, fl *flight) {
	f.mu.Lock()
	if fl.users--; fl.users == 0 {
		delete(f.m, key)
	}
	f.mu.Unlock()
}

// wait takes key's turn, waiting until deadline. It returns the turn; or,
// when a holder of the turn has published the key's stored response, the
// replay for fingerprint (out, or errFingerprint) without the turn. It
// returns errInFlight when another request of this process still holds the
// turn at deadline, or ctx's error. With noWait it never waits: it returns
// at once, with the turn, the published replay, or neither (t nil: a request
// that does not wait holds a connection only for one attempt, so it needs no
// turn).
func (f *flights) wait(ctx context.Context, key Key, fingerprint []byte, deadline time.Time, noWait bool) (t *turn, out *response, err error) {
	f.mu.Lock()
	if f.m == nil {
		f.m = map[Key]*flight{}
	}
	fl := f.m[key]
	if fl == nil {
		fl = &flight{turn: make(chan struct{}, 1), done: make(chan struct{})}
		f.m[key] = fl
	}
	fl.users++
	f.mu.Unlock()

	published := func() (*turn, *response, error) {
		f.leave(key, fl)
		out, err := replayOf(fl, fingerprint)
		return nil, out, err
	}
	// took is called with the turn held: a holder may have published
	// before handing it over.
	took := func() (*turn, *response, error) {
		select {
		case <-fl.done:
			<-fl.turn
			return published()
		default:
			return &turn{f: f, fl: fl, key: key}, nil, nil
		}
	}
	select {
	case <-fl.done:
		return published()
	case fl.turn <- struct{}{}:
		return took()
	default:
	}
	if noWait {
		// Not waiting for the turn: one attempt without it tells whether
		// the holder is really running the key (409) or only replaying it.
		f.leave(key, fl)
		return nil, nil, nil
	}
	if f.waited != nil {
		f.waited(ctx)
	}
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	select {
	case <-fl.done:
		return published()
	case fl.turn <- struct{}{}:
		return took()
	case <-timer.C:
		f.leave(key, fl)
		return nil, nil, errInFlight
	case <-ctx.Done():
		f.leave(key, fl)
		return nil, nil, ctx.Err()
	}
}
