package idem

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
)

// Key identifies one idempotent operation: the scope (by default the wrapped
// function's qualified name), the principal the service derived from the
// request, and the client's Idempotency-Key.
type Key struct {
	Scope     string
	Principal string
	Key       string
}

// Derive returns a key for a downstream call named name, made from k alone:
// every retry of the same operation derives the same value, so a payment
// provider sees one key however often the operation is repeated. Derive it
// once, before any retry loop, and send it on every attempt.
func (k Key) Derive(name string) string {
	h := sha256.New()
	for _, s := range []string{k.Scope, k.Principal, k.Key, name} {
		// Length-prefixing keeps ("ab","c") and ("a","bc") apart.
		var n [8]byte
		for i, l := 0, uint64(len(s)); i < 8; i++ {
			n[i] = byte(l >> (8 * i))
		}
		h.Write(n[:])
		h.Write([]byte(s))
	}
	return hex.EncodeToString(h.Sum(nil))[:32]
}

type keyCtx struct{}
type headerCtx struct{}

// KeyFromContext returns the key of the idempotent operation running under
// ctx: for //idem:http, the request's key; for //idem:consume, the consumer
// context as Scope and the event id as Key. It reports false outside a
// wrapped function, and inside one whose endpoint allowed a request without
// a key.
func KeyFromContext(ctx context.Context) (Key, bool) {
	k, ok := ctx.Value(keyCtx{}).(Key)
	return k, ok
}

// ResponseHeader returns the header of the response being built for the
// //idem:http function running under ctx. Headers set here are sent; those on
// the HTTP allow-list (see HTTP.ReplayHeaders) are also stored and replayed.
// Outside a wrapped function it returns a fresh header that goes nowhere.
func ResponseHeader(ctx context.Context) http.Header {
	if h, ok := ctx.Value(headerCtx{}).(http.Header); ok {
		return h
	}
	return http.Header{}
}
