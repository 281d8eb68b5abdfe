package idem

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// ClientConfig configures the downstream client returned by NewClient and
// NewTransport. The zero value is usable: every zero field takes its default.
type ClientConfig struct {
	// Retry bounds the attempts of one call and the capped exponential
	// backoff, with jitter, between them (defaults: 5 attempts, 100ms
	// doubling to 5s; see RetryPolicy).
	Retry RetryPolicy
	// RetryStatus reports whether a response status is worth another
	// attempt. Default: 408, 409, 425, 429 and every 5xx — the statuses a
	// server uses for "not now" (409 is what an idempotent server answers
	// while the same key is still in flight).
	RetryStatus func(status int) bool
	// MaxRetryAfter is the longest Retry-After the client waits for
	// (default 30s). A server asking for longer gets its response returned
	// to the caller instead: waiting less than it asked would not honour it.
	MaxRetryAfter time.Duration
	// KeyHeader is the request header that carries the key (default
	// Idempotency-Key).
	KeyHeader string
}

// ErrNoOperationKey is returned (wrapped) for an unsafe request that would
// go out without an idempotency key: no operation key in its context and no
// key header set by the caller. Sending it would make every retry of the
// operation a new charge at the provider.
var ErrNoOperationKey = errors.New("no operation key in the context and no key header on the request")

// ErrNoCallName is returned (wrapped) for an unsafe request made inside an
// operation without a call name (see WithCallName): two different calls of
// one operation must not share a key, and only the caller knows which
// calls are the same one.
var ErrNoCallName = errors.New("no call name: name the downstream call with idem.WithCallName")

type callNameCtx struct{}

// WithCallName names the downstream call made with ctx, e.g. "charge". The
// client derives the call's Idempotency-Key from the operation's key (see
// KeyFromContext) and this name, so the key is the same on every attempt and
// on every re-run of the operation after a crash or a rollback, and differs
// between differently named calls of one operation. Give each logical call
// of an operation its own name; repeat a name only for the same call.
func WithCallName(ctx context.Context, name string) context.Context {
	return context.WithValue(ctx, callNameCtx{}, name)
}

// NameRequest returns req with its context carrying the call name (see
// WithCallName).
func NameRequest(req *http.Request, name string) *http.Request {
	return req.WithContext(WithCallName(req.Context(), name))
}

// CallKey returns the Idempotency-Key the client sends for the call named
// name inside the operation running under ctx, and false outside one. It is
// KeyFromContext(ctx).Derive(name); services store it next to what the call
// created, to find the downstream record later.
func CallKey(ctx context.Context, name string) (string, bool) {
	k, ok := KeyFromContext(ctx)
	if !ok {
		return "", false
	}
	return k.Derive(name), true
}

// NewClient returns an *http.Client whose transport is NewTransport(base,
// cfg). Its errors are the standard *url.Error; when the request's context
// ends, that error's Err is ctx.Err() itself (errors.Is(err,
// context.Canceled) holds).
func NewClient(base http.RoundTripper, cfg ClientConfig) *http.Client {
	return &http.Client{Transport: NewTransport(base, cfg)}
}

// NewTransport returns an http.RoundTripper for calls made from inside an
// idempotent operation (an //idem:http function or an //idem:consume
// handler). base is the transport that sends each attempt
// (http.DefaultTransport if nil).
//
// For an unsafe method (POST, PUT, PATCH, DELETE) it sets the key header to
// KeyFromContext(ctx).Derive(name), name coming from WithCallName, unless
// the caller already set the header itself. The key is computed once per
// RoundTrip, before the first attempt, so every attempt carries the same
// one; and because it derives from the operation's key, a re-run of the
// operation (after a crash, a rollback, a redelivered event) sends it again
// and the downstream service applies the call once. An unsafe request with
// neither an operation key nor a caller's header is refused
// (ErrNoOperationKey), as is one without a call name (ErrNoCallName).
//
// Each call is retried per cfg on transport errors and on the statuses
// cfg.RetryStatus accepts, honouring Retry-After (delta-seconds or
// HTTP-date). A request whose body cannot be replayed (a Body and no
// GetBody) is sent once. A retry that the context's deadline would come
// before is not waited for: the last response (or the wrapped error) is
// returned at once. The body of a response that is retried is closed
// unread, so a server stalling it cannot hold the call. When the request's context ends — during an
// attempt or a backoff — RoundTrip returns ctx.Err() itself, never a
// response and never a wrapped error.
func NewTransport(base http.RoundTripper, cfg ClientConfig) http.RoundTripper {
	if base == nil {
		base = http.DefaultTransport
	}
	cfg.Retry = cfg.Retry.withDefaults()
	if cfg.RetryStatus == nil {
		cfg.RetryStatus = DefaultRetryStatus
	}
	if cfg.MaxRetryAfter <= 0 {
		cfg.MaxRetryAfter = 30 * time.Second
	}
	if cfg.KeyHeader == "" {
		cfg.KeyHeader = "Idempotency-Key"
	}
	return &transport{base: base, cfg: cfg}
}

// DefaultRetryStatus is ClientConfig.RetryStatus's default: 408 Request
// Timeout, 409 Conflict, 425 Too Early, 429 Too Many Requests and every 5xx.
func DefaultRetryStatus(status int) bool {
	switch status {
	case http.StatusRequestTimeout, http.StatusConflict, http.StatusTooEarly, http.StatusTooManyRequests:
		return true
	}
	return status >= 500 && status <= 599
}

type transport struct {
	base http.RoundTripper
	cfg  ClientConfig
}

// CloseIdleConnections closes the base transport's idle connections, if it
// has any to close, so http.Client.CloseIdleConnections reaches them (the
// client only asks its own Transport).
func (t *transport) CloseIdleConnections() {
	if c, ok := t.base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// unsafeMethod reports whether method may change state at the server, so a retry
// needs a key to be safe.
func unsafeMethod(method string) bool {
	switch method {
	case "", http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return false
	}
	return true
}

func (t *transport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	// The request belongs to the caller: attempts go out on a clone carrying
	// the key, fixed here, once, before the loop (the seed's lesson).
	out := req.Clone(ctx)
	if unsafeMethod(req.Method) && out.Header.Get(t.cfg.KeyHeader) == "" {
		key, err := t.callKey(ctx)
		if err != nil {
			closeBody(req)
			return nil, fmt.Errorf("idem: %s %s: %w", req.Method, req.URL.Redacted(), err)
		}
		out.Header.Set(t.cfg.KeyHeader, key)
	}
	replayable := req.Body == nil || req.Body == http.NoBody || req.GetBody != nil

	for attempt := 1; ; attempt++ {
		if attempt > 1 {
			out = out.Clone(ctx)
			if req.GetBody != nil {
				body, err := req.GetBody()
				if err != nil {
					return nil, fmt.Errorf("idem: %s %s: replay the body for attempt %d: %w", req.Method, req.URL.Redacted(), attempt, err)
				}
				out.Body = body
			}
		}
		resp, err := t.base.RoundTrip(out)
		if ctx.Err() != nil {
			// Whatever the attempt returned, the caller has gone: hand back
			// its cancellation unchanged, never a response it gave up on.
			if resp != nil {
				resp.Body.Close()
			}
			return nil, ctx.Err()
		}
		last := attempt >= t.cfg.Retry.MaxAttempts || !replayable
		var wait time.Duration
		if err != nil {
			if !replayable {
				return nil, fmt.Errorf("idem: %s %s (not retried: the body cannot be replayed, set GetBody): %w", req.Method, req.URL.Redacted(), err)
			}
			if last {
				return nil, fmt.Errorf("idem: %s %s: attempt %d of %d: %w", req.Method, req.URL.Redacted(), attempt, t.cfg.Retry.MaxAttempts, err)
			}
			wait = t.cfg.Retry.backoff(attempt)
		} else {
			if last || !t.cfg.RetryStatus(resp.StatusCode) {
				return resp, nil
			}
			wait = t.cfg.Retry.backoff(attempt)
			if after, ok := retryAfter(resp.Header.Get("Retry-After"), time.Now()); ok {
				if after > t.cfg.MaxRetryAfter {
					return resp, nil // the server asked for longer than we may wait
				}
				wait = max(wait, after)
			}
			if deadlineBefore(ctx, wait) {
				// The caller's deadline ends the wait before the retry:
				// the server's answer now, not a context error later.
				return resp, nil
			}
			// Closed unread: draining it could block for as long as the
			// server stalls its body (no timeout covers a body), and a
			// retry is worth a new connection.
			resp.Body.Close()
		}
		if err != nil && deadlineBefore(ctx, wait) {
			return nil, fmt.Errorf("idem: %s %s: attempt %d of %d (not retried: the context's deadline comes first): %w", req.Method, req.URL.Redacted(), attempt, t.cfg.Retry.MaxAttempts, err)
		}
		if err := sleep(ctx, wait); err != nil {
			return nil, err
		}
	}
}

// callKey is the key of the call under ctx: the operation's key derived with
// the call's name.
func (t *transport) callKey(ctx context.Context) (string, error) {
	k, ok := KeyFromContext(ctx)
	if !ok {
		return "", ErrNoOperationKey
	}
	name, _ := ctx.Value(callNameCtx{}).(string)
	if name == "" {
		return "", ErrNoCallName
	}
	return k.Derive(name), nil
}

// deadlineBefore reports whether ctx's deadline comes before a wait of d
// would end, so the attempt after it could never be made.
func deadlineBefore(ctx context.Context, d time.Duration) bool {
	dl, ok := ctx.Deadline()
	return ok && time.Until(dl) < d
}

// closeBody closes a request body RoundTrip will not send, as the
// RoundTripper contract requires.
func closeBody(req *http.Request) {
	if req.Body != nil {
		req.Body.Close()
	}
}

// retryAfter parses a Retry-After value (RFC 9110 §10.2.3): delay-seconds
// or an HTTP-date, relative to now. A date in the past means "now".
func retryAfter(v string, now time.Time) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	const maxSecs = int64(365 * 24 * time.Hour / time.Second) // no Duration overflow
	if secs, err := strconv.ParseInt(v, 10, 64); err == nil {
		if secs < 0 {
			return 0, false
		}
		return time.Duration(min(secs, maxSecs)) * time.Second, true
	} else if errors.Is(err, strconv.ErrRange) && v[0] != '-' {
		// More seconds than an int64 holds is still "much later", not
		// garbage to ignore: ignoring it would retry at once.
		return time.Duration(maxSecs) * time.Second, true
	}
	at, err := http.ParseTime(v)
	if err != nil {
		return 0, false
	}
	return max(at.Sub(now), 0), true
}
