package idem_test

import (
	"context"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/runtime/idem"
)

// What the function reads of its context (one node, opCtx, holds the
// response header, the principal and the key): the key with the principal as
// Principal returned it, only when the request has one; the principal with
// or without a key; the request context's own values and cancellation
// reaching the function and contexts it derives.
func TestFunctionContext(t *testing.T) {
	e := newEnv(t)
	e.cfg.Principal = func(r *http.Request) (string, error) { return r.Header.Get("X-Tenant"), nil }
	type ctxKey struct{}
	type seen struct {
		key          idem.Key
		keyed        bool
		principal    string
		hasPrincipal bool
		value        any
		cancelled    bool
	}
	got := make(chan seen, 1)
	waiting := make(chan struct{})
	e.hook = func(ctx context.Context, _ pgx.Tx, req chargeReq) error {
		var s seen
		s.key, s.keyed = idem.KeyFromContext(ctx)
		s.principal, s.hasPrincipal = idem.PrincipalFromContext(ctx)
		s.value = ctx.Value(ctxKey{})
		if req.Order == "cancel" {
			derived, stop := context.WithCancel(ctx)
			defer stop()
			close(waiting)
			select {
			case <-derived.Done():
				s.cancelled = errors.Is(derived.Err(), context.Canceled)
			case <-time.After(10 * time.Second):
			}
		}
		got <- s
		return nil
	}
	tenant := func(r *http.Request) { r.Header.Set("X-Tenant", "tenant-1") }
	ctx := context.WithValue(context.Background(), ctxKey{}, "outer")

	r := doCtx(ctx, e.handler(idem.Endpoint{}), "k-1", body1, tenant)
	s := <-got
	if r.status != http.StatusCreated || !s.keyed || s.key != (idem.Key{Scope: "test.charge", Principal: "tenant-1", Key: "k-1"}) ||
		s.principal != "tenant-1" || !s.hasPrincipal || s.value != "outer" {
		t.Errorf("keyed request: %d, %+v", r.status, s)
	}
	if r.header.Get("Location") == "" {
		t.Errorf("ResponseHeader's Location not sent: %v", r.header)
	}

	r = doCtx(ctx, e.handler(idem.Endpoint{KeyOptional: true}), "", body1, tenant)
	s = <-got
	if r.status != http.StatusCreated || s.keyed || s.principal != "tenant-1" || !s.hasPrincipal || s.value != "outer" {
		t.Errorf("request without a key: %d, %+v", r.status, s)
	}
	if r.header.Get("Location") == "" {
		t.Errorf("ResponseHeader's Location not sent without a key: %v", r.header)
	}

	cctx, cancel := context.WithCancel(ctx)
	done := make(chan result, 1)
	go func() { done <- doCtx(cctx, e.handler(idem.Endpoint{}), "k-cancel", `{"order":"cancel","amount":1}`) }()
	<-waiting
	cancel()
	s = <-got
	<-done
	if !s.cancelled {
		t.Errorf("a context derived from the function's was not cancelled with the request: %+v", s)
	}
}
