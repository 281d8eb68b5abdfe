package idem_test

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// traceID is a UUID-like type: it parses any case and prints lower case.
type traceID [4]byte

func (id *traceID) UnmarshalText(b []byte) error {
	if len(b) != 8 {
		return errors.New("want 8 hex digits")
	}
	_, err := hex.Decode(id[:], b)
	return err
}

func (id traceID) MarshalText() ([]byte, error) { return []byte(hex.EncodeToString(id[:])), nil }

// refundReq binds every kind: a path wildcard, a scalar and a repeated query
// parameter, headers (scalar and TextUnmarshaler), and the JSON body.
type refundReq struct {
	Order   int64    `path:"id"`
	DryRun  bool     `query:"dry_run"`
	Tags    []string `query:"tag"`
	Version uint16   `header:"X-Client-Version"`
	Trace   traceID  `header:"X-Trace"`
	Amount  int      `json:"amount"`
}

type refundResp struct {
	Req       refundReq `json:"req"`
	Principal string    `json:"principal"`
}

// bindEnv is a real HTTP server (ServeMux, HandleRoute) over a real schema,
// whose function records every call.
type bindEnv struct {
	srv   *httptest.Server
	calls atomic.Int64
	e     *env
}

func newBindEnv(t *testing.T) *bindEnv {
	e := newEnv(t)
	e.cfg.Principal = func(r *http.Request) (string, error) { return r.Header.Get("X-Tenant"), nil }
	b := &bindEnv{e: e}
	fn := func(ctx context.Context, tx pgx.Tx, req refundReq) (refundResp, error) {
		b.calls.Add(1)
		if _, err := tx.Exec(ctx, `INSERT INTO effects (order_id, amount) VALUES ($1, $2)`, fmt.Sprint(req.Order), req.Amount); err != nil {
			return refundResp{}, err
		}
		p, _ := idem.PrincipalFromContext(ctx)
		return refundResp{Req: req, Principal: p}, nil
	}
	h := e.engine()
	mux := http.NewServeMux()
	idem.HandleRoute(mux, "POST /orders/{id}/refund", idem.Handle(h, idem.Endpoint{Scope: "test.refund", Route: "POST /orders/{id}/refund"}, fn))
	idem.HandleRoute(mux, "GET /orders/{id}", idem.Handle(h, idem.Endpoint{Scope: "test.get", Route: "GET /orders/{id}", KeyOptional: true}, fn))
	b.srv = httptest.NewServer(mux)
	t.Cleanup(b.srv.Close)
	return b
}

// send makes a real HTTP request; header pairs are name, value.
func (b *bindEnv) send(t *testing.T, method, target, key, body string, header ...string) result {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, b.srv.URL+target, rd)
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Add(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return result{status: resp.StatusCode, header: resp.Header, body: out}
}

func decodeRefund(t *testing.T, r result) refundResp {
	t.Helper()
	if r.status != http.StatusOK {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	var out refundResp
	if err := json.Unmarshal(r.body, &out); err != nil {
		t.Fatalf("%s: %v", r.body, err)
	}
	return out
}

// The function receives every bound value, converted; a JSON member named
// like a bound field does not override the bound value.
func TestBindEveryKind(t *testing.T) {
	b := newBindEnv(t)
	got := decodeRefund(t, b.send(t, "POST", "/orders/42/refund?dry_run=true&tag=a&tag=b&other=x", "k1",
		`{"amount":5,"Order":7,"Version":9}`, "X-Client-Version", "3", "X-Trace", "DEADBEEF", "X-Tenant", "acme"))
	want := refundReq{Order: 42, DryRun: true, Tags: []string{"a", "b"}, Version: 3, Trace: traceID{0xde, 0xad, 0xbe, 0xef}, Amount: 5}
	if fmt.Sprint(got.Req) != fmt.Sprint(want) || got.Principal != "acme" {
		t.Fatalf("function received %+v (principal %q), want %+v (acme)", got.Req, got.Principal, want)
	}
	// Absent query parameters and headers are zero values; no body is
	// needed when the type binds fields.
	got = decodeRefund(t, b.send(t, "POST", "/orders/43/refund", "k2", ""))
	if fmt.Sprint(got.Req) != fmt.Sprint(refundReq{Order: 43}) {
		t.Fatalf("function received %+v, want only Order 43", got.Req)
	}
}

// A value that does not convert is a 400 problem naming the parameter, and
// nothing is stored or called.
func TestBindConversionFailureIs400(t *testing.T) {
	b := newBindEnv(t)
	for _, c := range []struct {
		target string
		header []string
		names  string
	}{
		{"/orders/abc/refund", nil, "path parameter id"},
		{"/orders/99999999999999999999/refund", nil, "path parameter id"},
		{"/orders/1/refund?dry_run=maybe", nil, "query parameter dry_run"},
		{"/orders/1/refund?dry_run=true&dry_run=false", nil, "query parameter dry_run"},
		{"/orders/1/refund", []string{"X-Client-Version", "-1"}, "header X-Client-Version"},
		{"/orders/1/refund", []string{"X-Client-Version", "70000"}, "header X-Client-Version"},
		{"/orders/1/refund", []string{"X-Trace", "not-hex!"}, "header X-Trace"},
	} {
		r := b.send(t, "POST", c.target, "k-"+c.target+strings.Join(c.header, ""), `{"amount":1}`, c.header...)
		wantProblem(t, r, http.StatusBadRequest)
		var p struct{ Detail string }
		if err := json.Unmarshal(r.body, &p); err != nil || !strings.HasPrefix(p.Detail, c.names+":") {
			t.Errorf("%s %v: detail %q, want it to name %s (%v)", c.target, c.header, p.Detail, c.names, err)
		}
	}
	if n := b.calls.Load(); n != 0 {
		t.Fatalf("function called %d times", n)
	}
	if n := b.e.keys(); n != 0 {
		t.Fatalf("%d keys stored", n)
	}
}

// The fingerprint covers exactly what the function receives: another path,
// bound query value or bound header with the same key is a 422; an unbound
// header or query parameter, or another spelling of the same value, replays.
func TestBindFingerprint(t *testing.T) {
	b := newBindEnv(t)
	const target, body = "/orders/42/refund?dry_run=true&tag=a&tag=b", `{"amount":5}`
	hdr := []string{"X-Client-Version", "3", "X-Trace", "deadbeef", "X-Tenant", "acme"}
	first := b.send(t, "POST", target, "fp", body, hdr...)
	decodeRefund(t, first)

	for _, c := range []struct {
		what, target string
		header       []string
	}{
		{"another path", "/orders/43/refund?dry_run=true&tag=a&tag=b", hdr},
		{"another bound query value", "/orders/42/refund?dry_run=false&tag=a&tag=b", hdr},
		{"another repeated value", "/orders/42/refund?dry_run=true&tag=a", hdr},
		{"reordered repeated values", "/orders/42/refund?dry_run=true&tag=b&tag=a", hdr},
		{"another bound header", target, []string{"X-Client-Version", "4", "X-Trace", "deadbeef", "X-Tenant", "acme"}},
		{"a bound header dropped", target, []string{"X-Trace", "deadbeef", "X-Tenant", "acme"}},
	} {
		t.Run(c.what, func(t *testing.T) {
			wantProblem(t, b.send(t, "POST", c.target, "fp", body, c.header...), http.StatusUnprocessableEntity)
		})
	}
	for _, c := range []struct {
		what, target string
		header       []string
	}{
		{"an unbound header", target, append([]string{"User-Agent", "retry/2", "X-Request-Id", "r-2"}, hdr...)},
		{"an unbound query parameter", target + "&utm=x", hdr},
		{"reordered parameters", "/orders/42/refund?tag=a&dry_run=true&tag=b", hdr},
		{"another spelling of the same values", "/orders/042/refund?dry_run=1&tag=a&tag=b", []string{"X-Client-Version", "03", "X-Trace", "DEADBEEF", "X-Tenant", "acme"}},
	} {
		t.Run(c.what, func(t *testing.T) {
			r := b.send(t, "POST", c.target, "fp", body, c.header...)
			if r.header.Get("Idempotent-Replayed") != "true" || string(r.body) != string(first.body) {
				t.Fatalf("%d %s, want a replay of %s", r.status, r.body, first.body)
			}
		})
	}
	if n := b.calls.Load(); n != 1 {
		t.Fatalf("function called %d times, want 1", n)
	}
}

// A GET route needs no body; the principal is available; with a key it
// replays, without one (key=optional) it runs each time.
func TestBindGetWithoutBody(t *testing.T) {
	b := newBindEnv(t)
	got := decodeRefund(t, b.send(t, "GET", "/orders/7?dry_run=true", "", "", "X-Tenant", "acme"))
	if got.Req.Order != 7 || !got.Req.DryRun || got.Principal != "acme" {
		t.Fatalf("GET without a key: %+v", got)
	}
	first := b.send(t, "GET", "/orders/8", "g1", "", "X-Tenant", "acme")
	decodeRefund(t, first)
	if r := b.send(t, "GET", "/orders/8", "g1", "", "X-Tenant", "acme"); r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("GET with a key repeated: %d %s, want a replay", r.status, r.body)
	}
	if n := b.calls.Load(); n != 2 {
		t.Fatalf("function called %d times, want 2", n)
	}
	if n := pgtest.Count(t, b.e.pool, `SELECT count(*) FROM effects`); n != 2 {
		t.Fatalf("%d effects, want 2", n)
	}
}

// A type with no bound field and a body-carrying method still needs a JSON
// body (an empty POST is a 400, as before).
func TestBindEmptyBodyWithoutBinding(t *testing.T) {
	e := newEnv(t)
	h := e.handler(idem.Endpoint{})
	wantProblem(t, do(h, "empty", ""), http.StatusBadRequest)
	if e.calls.Load() != 0 || e.keys() != 0 {
		t.Fatalf("calls %d, keys %d", e.calls.Load(), e.keys())
	}
}

// Handle refuses, at start-up, binding tags it cannot honour: the same rules
// the generator checks at generation time.
func TestBindInvalidTagsPanic(t *testing.T) {
	type notWildcard struct {
		ID string `path:"order"`
	}
	type unsupported struct {
		Rate float64 `query:"rate"`
	}
	type unexported struct {
		id string `path:"id"`
	}
	type pathSlice struct {
		IDs []string `path:"id"`
	}
	type twoTags struct {
		ID string `path:"id" query:"id"`
	}
	type dup struct {
		A string `header:"x-a"`
		B string `header:"X-A"`
	}
	type inner struct {
		ID string `path:"id"`
	}
	type embedded struct {
		inner
		Amount int
	}
	cases := map[string]func(){
		"embedded tags":    func() { handleFor[embedded]() },
		"not a wildcard":   func() { handleFor[notWildcard]() },
		"unsupported type": func() { handleFor[unsupported]() },
		"unexported":       func() { handleFor[unexported]() },
		"path slice":       func() { handleFor[pathSlice]() },
		"two tags":         func() { handleFor[twoTags]() },
		"duplicate header": func() { handleFor[dup]() },
	}
	for name, f := range cases {
		t.Run(name, func(t *testing.T) {
			defer func() {
				if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "request binding") {
					t.Fatalf("recovered %v, want a request binding panic", r)
				}
			}()
			f()
		})
	}
}

func handleFor[Req any]() {
	h, err := idem.NewHTTP(idem.NewStore(nil), idem.HTTPConfig{})
	if err != nil {
		panic(err)
	}
	idem.Handle(h, idem.Endpoint{Scope: "s", Route: "POST /x/{id}"}, func(context.Context, pgx.Tx, Req) (struct{}, error) {
		return struct{}{}, nil
	})
}

func TestRouteWildcards(t *testing.T) {
	for route, want := range map[string]string{
		"POST /orders/{id}/items/{item}": "id item",
		"/files/{path...}":               "path",
		"GET example.com/{$}":            "",
		"GET /a/{x}/{$}":                 "x",
	} {
		if got := strings.Join(idem.RouteWildcards(route), " "); got != want {
			t.Errorf("RouteWildcards(%q) = %q, want %q", route, got, want)
		}
	}
}

type noteReq struct {
	ID   string `path:"id"`
	Note string `query:"note"`
}

// Bound bytes PostgreSQL refuses (a NUL, invalid UTF-8) are the client's: 422,
// nothing stored, the key free for a corrected request. And two values that
// differ only in invalid UTF-8 are two requests (the canonical encoding is
// not JSON, which would turn both into U+FFFD).
func TestBindUnstorableAndInvalidUTF8(t *testing.T) {
	e := newEnv(t)
	var calls atomic.Int64
	fn := func(ctx context.Context, tx pgx.Tx, req noteReq) (noteReq, error) {
		calls.Add(1)
		_, err := tx.Exec(ctx, `INSERT INTO effects (order_id, amount) VALUES ($1, 1)`, req.ID)
		return req, err
	}
	mux := http.NewServeMux()
	idem.HandleRoute(mux, "POST /notes/{id}", idem.Handle(e.engine(), idem.Endpoint{Scope: "test.notes", Route: "POST /notes/{id}"}, fn))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	post := func(target, key string) result {
		req, err := http.NewRequest(http.MethodPost, srv.URL+target, nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return result{status: resp.StatusCode, header: resp.Header, body: body}
	}
	wantProblem(t, post("/notes/a%00b", "nul"), http.StatusUnprocessableEntity)
	wantProblem(t, post("/notes/a%ffb", "utf8"), http.StatusUnprocessableEntity)
	if n := e.keys(); n != 0 || e.effects() != 0 {
		t.Fatalf("%d keys, %d effects after refused values", n, e.effects())
	}
	// The key is free: the corrected request runs.
	if r := post("/notes/ab", "nul"); r.status != http.StatusOK {
		t.Fatalf("corrected request: %d %s", r.status, r.body)
	}

	if r := post("/notes/x?note=%ff", "note"); r.status != http.StatusOK {
		t.Fatalf("first: %d %s", r.status, r.body)
	}
	wantProblem(t, post("/notes/x?note=%fe", "note"), http.StatusUnprocessableEntity)
	if r := post("/notes/x?note=%ff", "note"); r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("same bytes again: %d %s, want a replay", r.status, r.body)
	}
	if n := calls.Load(); n != 4 {
		t.Fatalf("function called %d times, want 4", n)
	}
}
