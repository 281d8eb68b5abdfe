package idem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// problemFor's answer to an error wrapping a context's error depends on
// whose context ended: the request's (cancelled) is the cancellation's 503;
// with the request alive, a deadline of the runtime's own under a storage
// failure (a round trip bounded by a timeout, as the consumer's
// StorageTimeout bounds its own) is the storage failure's 503, and one
// of the function's own its 500. The runtime's special cases that may wrap
// a context error keep their answers either way.
func TestProblemForContextErrors(t *testing.T) {
	deadline := fmt.Errorf("timeout: %w", context.DeadlineExceeded)
	cases := []struct {
		name      string
		err       error
		cancelled bool // the request's context
		status    int
		detail    string // a part of it
		retry     bool   // Retry-After
		logged    string // a part of the log, "" for none
	}{
		{"storage, runtime's deadline", fmt.Errorf("%w: store response: %w", errStorage, deadline), false,
			http.StatusServiceUnavailable, "storage unavailable", true, "idempotency storage failed"},
		{"storage, request cancelled", fmt.Errorf("%w: store response: %w", errStorage, context.Canceled), true,
			http.StatusServiceUnavailable, "request cancelled", false, ""},
		{"function's deadline", fmt.Errorf("payment provider: %w", deadline), false,
			http.StatusInternalServerError, "not the request's", false, "idempotent handler failed"},
		{"function's cancel", fmt.Errorf("fan-out: %w", context.Canceled), false,
			http.StatusInternalServerError, "not the request's", false, "idempotent handler failed"},
		{"function's error, request cancelled", fmt.Errorf("payment provider: %w", context.Canceled), true,
			http.StatusServiceUnavailable, "request cancelled", false, ""},
		{"request's own deadline", context.DeadlineExceeded, true,
			http.StatusServiceUnavailable, "request cancelled", false, ""},
		{"commit unknown", fmt.Errorf("%w: %w", errCommitUnknown, deadline), false,
			http.StatusServiceUnavailable, "outcome is unknown", true, "commit outcome unknown"},
		{"commit unknown, request cancelled", fmt.Errorf("%w: %w", errCommitUnknown, context.Canceled), true,
			http.StatusServiceUnavailable, "outcome is unknown", true, "commit outcome unknown"},
		{"busy", fmt.Errorf("%w: no database connection free within the wait: %w", errBusy, context.DeadlineExceeded), false,
			http.StatusServiceUnavailable, "database was busy", true, "database busy"},
		{"other error", errors.New("boom"), false,
			http.StatusInternalServerError, "", false, "idempotent handler failed"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var logs bytes.Buffer // FailureLogInterval -1: every failure logged at once
			h, err := NewHTTP(NewStore(nil), HTTPConfig{Logger: slog.New(slog.NewTextHandler(&logs, nil)), FailureLogInterval: -1})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if c.cancelled {
				cancel()
			}
			r := httptest.NewRequestWithContext(ctx, http.MethodPost, "/charges", nil)
			r.Header.Set(DefaultKeyHeader, "k")
			p := h.problemFor(r, Endpoint{Scope: "s", KeyHeader: DefaultKeyHeader}, c.err)
			if p.Status != c.status || !strings.Contains(p.Detail, c.detail) || (p.RetryAfter > 0) != c.retry {
				t.Errorf("%v: %d %q (Retry-After %v); want %d with %q, Retry-After %v", c.err, p.Status, p.Detail, p.RetryAfter, c.status, c.detail, c.retry)
			}
			if !errors.Is(p, c.err) {
				t.Errorf("the answer's cause %v does not hold %v", p.Err, c.err)
			}
			switch l := logs.String(); {
			case c.logged == "" && l != "":
				t.Errorf("logged:\n%s\nwant nothing", l)
			case !strings.Contains(l, c.logged):
				t.Errorf("log:\n%s\nwant %q", l, c.logged)
			}
		})
	}
}
