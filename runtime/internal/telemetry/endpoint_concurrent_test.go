package telemetry_test

import (
	"context"
	"sync"
	"testing"

	"github.com/idemgen/idemgen/runtime/internal/telemetry"
)

// Cached endpoints (revcli) used concurrently from their first use, spans
// adding attributes of their own: each span has its endpoint's name and
// attributes only, and the counts add up per endpoint.
func TestHTTPEndpointConcurrent(t *testing.T) {
	tel, reader, rec := setup(t)
	eps := map[string]*telemetry.HTTPEndpoint{
		"POST /a": tel.HTTPEndpoint("POST /a", "scope.a"),
		"POST /b": tel.HTTPEndpoint("POST /b", "scope.b"),
		"same":    tel.HTTPEndpoint("same", "scope.c"),
	}
	var wg sync.WaitGroup
	for _, e := range eps {
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range 50 {
					ctx, done := e.Start(context.Background())
					e.Waited(ctx)
					done([]string{"executed", "replayed", "409"}[i%3], nil)
				}
			}()
		}
	}
	wg.Wait()
	spans := rec.Ended()
	if len(spans) != 3*8*50 {
		t.Fatalf("%d spans", len(spans))
	}
	for _, s := range spans {
		var ep, scope string
		n := 0
		for _, kv := range s.Attributes() {
			switch kv.Key {
			case telemetry.KeyEndpoint:
				ep = kv.Value.AsString()
				n++
			case telemetry.KeyScope:
				scope = kv.Value.AsString()
				n++
			}
		}
		if n != 2 || s.Name() != "idem.http "+ep || eps[ep] == nil || scope != map[string]string{"POST /a": "scope.a", "POST /b": "scope.b", "same": "scope.c"}[ep] {
			t.Errorf("span %q attrs %v", s.Name(), s.Attributes())
		}
	}
	m := collect(t, reader)
	for ep := range eps {
		if got := sumFor(t, m["idem.http.key_waits"], telemetry.KeyEndpoint.String(ep)); got != 400 {
			t.Errorf("%s waits %d", ep, got)
		}
		for o, want := range map[string]int64{"executed": 8 * 17, "replayed": 8 * 17, "409": 8 * 16} {
			if got := sumFor(t, m["idem.http.operations"], telemetry.KeyEndpoint.String(ep), telemetry.KeyOutcome.String(o)); got != want {
				t.Errorf("%s %s: %d operations, want %d", ep, o, got, want)
			}
		}
	}
}
