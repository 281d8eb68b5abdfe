package idem_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// A member frozen mid-record (here: its handler stops issuing statements, as
// a SIGSTOPped process does) holds the processed-event row of its open
// transaction. The member that took its partition over must not wait for it
// to wake up: after IdleInTransactionTimeout the server ends the frozen
// session, the other member applies the record, and the frozen one, when it
// resumes, finds a dead transaction and then a duplicate. One effect.
func TestFrozenMemberLosesItsRecord(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	newProc := func() *idem.Processor {
		p, err := idem.NewProcessor(store, idem.ProcessorConfig{
			Retry:                    idem.RetryPolicy{MaxAttempts: 3, Initial: time.Millisecond, Max: 2 * time.Millisecond},
			Outage:                   idem.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond},
			IdleInTransactionTimeout: 500 * time.Millisecond,
		})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	release := make(chan struct{})
	var frozenCalls atomic.Int64
	frozen := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		if frozenCalls.Add(1) == 1 {
			<-release // frozen: no statement for as long as the test says
		}
		return insertEffect(ctx, tx, e)
	})
	healthy := handler(insertEffect)
	rec := &idem.Record{Topic: "events", Value: []byte(`{"id":"e-frozen","amount":7}`)}

	type result struct {
		o   idem.Outcome
		err error
	}
	frozenDone := make(chan result, 1)
	go func() {
		o, err := newProc().Process(context.Background(), &frozen, rec)
		frozenDone <- result{o, err}
	}()
	waitFor(t, func() bool { return frozenCalls.Load() == 1 })

	// The partition's new owner processes the same record. It blocks on the
	// frozen member's uncommitted processed-event row until the server ends
	// that session.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	start := time.Now()
	o, err := newProc().Process(ctx, &healthy, rec)
	if err != nil || o != idem.Applied {
		close(release)
		t.Fatalf("new owner: %v %v, want applied while the other member is frozen", o, err)
	}
	t.Logf("applied by the new owner %v after it started", time.Since(start).Round(10*time.Millisecond))

	close(release) // the frozen member wakes up
	r := <-frozenDone
	if r.err != nil || r.o != idem.Duplicate {
		t.Fatalf("woken member: %v %v, want duplicate", r.o, r.err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
}
