package idem_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/runtime/idem"
)

// downstream is a provider stand-in that records the keys it was sent.
type downstream struct {
	srv  *httptest.Server
	mu   sync.Mutex
	keys []string
}

func newDownstream(t *testing.T) *downstream {
	d := &downstream{}
	d.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		d.mu.Lock()
		d.keys = append(d.keys, r.Header.Get("Idempotency-Key"))
		d.mu.Unlock()
		w.WriteHeader(http.StatusCreated)
	}))
	t.Cleanup(d.srv.Close)
	return d
}

func (d *downstream) sent() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]string(nil), d.keys...)
}

func (d *downstream) call(ctx context.Context, c *http.Client) error {
	req, err := http.NewRequestWithContext(idem.WithCallName(ctx, "provider.charge"), http.MethodPost, d.srv.URL, strings.NewReader("{}"))
	if err != nil {
		return err
	}
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.Body.Close()
}

// An //idem:http operation that fails after its downstream call (rolled
// back) and is retried by its client sends the downstream service the same
// key both times: the key comes from the operation, not from the attempt.
func TestClientSameKeyAcrossOperationRuns(t *testing.T) {
	e := newEnv(t)
	d := newDownstream(t)
	client := idem.NewClient(nil, idem.ClientConfig{})
	runs := 0
	e.hook = func(ctx context.Context, _ pgx.Tx, _ chargeReq) error {
		runs++
		if err := d.call(ctx, client); err != nil {
			return err
		}
		if runs == 1 {
			return errors.New("crash after the provider call") // rolled back, key free
		}
		return nil
	}
	h := e.handler(idem.Endpoint{})
	if r := do(h, "op-1", `{"order":"o1","amount":5}`); r.status != http.StatusInternalServerError {
		t.Fatalf("first run: %d %s", r.status, r.body)
	}
	if r := do(h, "op-1", `{"order":"o1","amount":5}`); r.status != http.StatusCreated {
		t.Fatalf("second run: %d %s", r.status, r.body)
	}
	if r := do(h, "op-2", `{"order":"o2","amount":5}`); r.status != http.StatusCreated {
		t.Fatalf("another operation: %d %s", r.status, r.body)
	}
	keys := d.sent()
	want := idem.Key{Scope: "test.charge", Key: "op-1"}.Derive("provider.charge")
	if len(keys) != 3 || keys[0] != want || keys[1] != want {
		t.Fatalf("downstream saw keys %q; want %q twice (one operation, two runs), then another", keys, want)
	}
	if keys[2] == want {
		t.Fatal("a different operation sent the same key")
	}
}

// A consumed event: every delivery of one event id sends the same key;
// another event id sends another.
func TestClientKeyFromConsumedEvent(t *testing.T) {
	e := newEnv(t)
	d := newDownstream(t)
	client := idem.NewClient(nil, idem.ClientConfig{})
	fail := true
	handler := idem.Consume(idem.EventSpec[chargeReq]{Topic: "orders", Context: "billing"},
		func(ctx context.Context, _ pgx.Tx, _ chargeReq) error {
			if err := d.call(ctx, client); err != nil {
				return err
			}
			if fail {
				fail = false
				return errors.New("fails once after the call: rolled back, retried")
			}
			return nil
		})
	p, err := idem.NewProcessor(idem.NewStore(e.pool), idem.ProcessorConfig{Retry: idem.RetryPolicy{Initial: 1, Max: 1}})
	if err != nil {
		t.Fatal(err)
	}
	rec := func(id string) *idem.Record {
		return &idem.Record{Topic: "orders", Value: []byte(`{"order":"o1","amount":5}`),
			Headers: []idem.RecordHeader{{Key: idem.EventIDHeader, Value: []byte(id)}}}
	}
	for _, id := range []string{"evt-1", "evt-2"} {
		if out, err := p.Process(context.Background(), &handler, rec(id)); err != nil || out != idem.Applied {
			t.Fatalf("%s: %v %v", id, out, err)
		}
	}
	keys := d.sent()
	want := idem.Key{Scope: "billing", Key: "evt-1"}.Derive("provider.charge")
	if len(keys) != 3 || keys[0] != want || keys[1] != want || keys[2] == want {
		t.Fatalf("downstream saw %q; want %q twice (one event, two attempts), then another key", keys, want)
	}
}
