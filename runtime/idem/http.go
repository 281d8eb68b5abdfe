package idem

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemgen/idemgen/internal/crash"
	"github.com/idemgen/idemgen/runtime/internal/db"
	"github.com/idemgen/idemgen/runtime/internal/dbx"
	"github.com/idemgen/idemgen/runtime/internal/telemetry"
)

// Defaults for Endpoint and HTTPConfig fields left zero.
const (
	DefaultKeyHeader    = "Idempotency-Key"
	DefaultTTL          = 24 * time.Hour
	DefaultWait         = 5 * time.Second
	DefaultMaxBodyBytes = 1 << 20
	// DefaultConnCheckInterval is how often PostgreSQL checks, during a
	// statement, that the process holding a key is still connected.
	DefaultConnCheckInterval = time.Second
	// DefaultIdleInTransactionTimeout bounds how long a process frozen in
	// the middle of a transaction (an HTTP operation or a consumed record)
	// keeps its locks: PostgreSQL ends its session after this long without a
	// statement. Two minutes leaves room for downstream calls made inside
	// the operation.
	DefaultIdleInTransactionTimeout = 2 * time.Minute
	// DefaultFailureLogInterval is how long the log lines of a run of
	// failures of one kind (a database outage's 503s) are folded into one.
	DefaultFailureLogInterval = 10 * time.Second
	// MaxKeyLength is the longest Idempotency-Key accepted, in bytes.
	MaxKeyLength = 255

	rollbackTimeout = 5 * time.Second
	// answerSlack is how long past the wait the round trips before the
	// function (begin, claim) may take to come back: the claim's lock_timeout
	// ends at the wait, and this covers the network. A database that does not
	// answer by then (a partition, a stalled server) is a 503, and the
	// connection is closed, so nothing it was doing can commit.
	answerSlack = time.Second
	// A duplicate of a key in flight in another process polls for it, never
	// holding a connection between polls: from pollMin doubling to pollMax.
	pollMin = 10 * time.Millisecond
	pollMax = 200 * time.Millisecond
)

// DefaultReplayHeaders are the response headers stored and replayed besides
// Content-Type when HTTPConfig.ReplayHeaders is empty.
func DefaultReplayHeaders() []string { return []string{"Location"} }

// Endpoint describes one //idem:http operation. Generated code fills the
// fields the directive sets; zero fields mean the documented defaults.
type Endpoint struct {
	// Scope namespaces keys; generated code uses the function's qualified
	// name, so two operations never share a key.
	Scope string
	// Route is "METHOD /pattern" as given to http.ServeMux; the method is
	// enforced (405 otherwise). Empty, or a pattern without a method,
	// accepts any method.
	Route string
	// Status is the status code of a successful response (0: 200).
	Status int
	// TTL is how long a completed key is replayed (0: 24h). After it a key
	// counts as new.
	TTL time.Duration
	// KeyHeader names the request header carrying the key (empty:
	// Idempotency-Key).
	KeyHeader string
	// KeyOptional lets a request without the header run, in a transaction,
	// without idempotency. By default a missing key is a 400.
	KeyOptional bool
	// Wait bounds the whole wait before the function runs (0: 5s): for a
	// database connection, for a lock, and for a request in flight with the
	// same key. A duplicate whose first request finishes in time replays its
	// response; one still in flight after Wait is a 409 with Retry-After; a
	// connection or lock not had in time is a 503 with Retry-After. At most
	// PostgreSQL's largest lock_timeout (2^31-1 ms, about 24.8 days).
	Wait time.Duration
	// NoWait answers 409 at once when the same key is in flight, instead of
	// waiting for it. Connection and lock waits are still bounded by Wait.
	NoWait bool
}

// normalize validates ep and fills its defaults.
func (ep Endpoint) normalize() (Endpoint, error) {
	switch {
	case ep.Status == 0:
		ep.Status = http.StatusOK
	case ep.Status < 200 || ep.Status > 299:
		return ep, fmt.Errorf("status %d is not a 2xx", ep.Status)
	}
	switch {
	case ep.TTL == 0:
		ep.TTL = DefaultTTL
	case ep.TTL < 0:
		return ep, fmt.Errorf("negative TTL %v", ep.TTL)
	}
	if ep.KeyHeader == "" {
		ep.KeyHeader = DefaultKeyHeader
	}
	switch {
	case ep.Wait == 0:
		ep.Wait = DefaultWait
	case ep.Wait < 0:
		return ep, fmt.Errorf("negative Wait %v (set NoWait to answer 409 at once)", ep.Wait)
	case ep.Wait > maxIdleInTransactionTimeout:
		// The claim's lock_timeout is the time left of the wait: PostgreSQL
		// would refuse it with every claim (every keyed request a 503).
		return ep, fmt.Errorf("a Wait of %v is over PostgreSQL's maximum lock_timeout, %v", ep.Wait, maxIdleInTransactionTimeout)
	}
	return ep, nil
}

// method is the method ep.Route enforces, or "".
func (ep Endpoint) method() string {
	method, _, found := strings.Cut(ep.Route, " ")
	if !found || strings.HasPrefix(method, "/") {
		return ""
	}
	return method
}

// HTTPConfig configures the HTTP engine shared by all endpoints. NewHTTP
// validates and copies it; zero fields mean the documented defaults.
type HTTPConfig struct {
	// Principal returns who is calling. It runs for every request, with a
	// key or without, before the body is read: an error is answered with its
	// *Error status, or 401, and the function never runs. Keys and stored
	// responses are scoped per principal: one tenant never sees another's
	// response. The function reads it with PrincipalFromContext. Nil means a
	// single principal "". See MaxPrincipalLength for how it is stored.
	Principal func(*http.Request) (string, error)
	// MaxBodyBytes limits the request body (0: 1 MiB); larger is a 413.
	MaxBodyBytes int64
	// ReplayHeaders lists the response headers stored and replayed besides
	// Content-Type (empty: DefaultReplayHeaders, i.e. Location). Set-Cookie
	// is never stored.
	ReplayHeaders []string
	// NoReplayHeaders stores and replays no header but Content-Type.
	NoReplayHeaders bool
	// DisallowUnknownFields makes a request body with a field that Req does
	// not have a 400. By default unknown fields are ignored. Either way
	// field names match case-insensitively and a repeated field keeps its
	// last value, as encoding/json does.
	DisallowUnknownFields bool
	// TxOptions starts each transaction (default: read committed). A
	// custom BeginQuery costs a round trip per request: it is sent on its
	// own, where BEGIN is otherwise pipelined with the claim.
	TxOptions pgx.TxOptions
	// ConnCheckInterval is PostgreSQL's client_connection_check_interval for
	// the runtime's transactions (0: DefaultConnCheckInterval): a process
	// killed while its backend runs a statement (or waits on a lock) frees
	// its keys within this interval, not when the statement ends. A server
	// that cannot check (not Linux) is detected on first use and logged.
	ConnCheckInterval time.Duration
	// NoConnCheck leaves client_connection_check_interval as the session has
	// it.
	NoConnCheck bool
	// IdleInTransactionTimeout is PostgreSQL's
	// idle_in_transaction_session_timeout for the runtime's transactions (0:
	// DefaultIdleInTransactionTimeout). A process frozen mid-request (SIGSTOP,
	// a paused VM) keeps its connection open, so only this frees its key:
	// after it the server ends that session and rolls its work back, and a
	// retry elsewhere runs. It must be longer than the longest pause between
	// the function's own statements (a downstream call inside the operation).
	IdleInTransactionTimeout time.Duration
	// NoIdleInTransactionTimeout leaves idle_in_transaction_session_timeout
	// as the session has it.
	NoIdleInTransactionTimeout bool
	// Logger receives failures that are not the client's fault (default
	// slog.Default()).
	Logger *slog.Logger
	// FailureLogInterval folds the log lines of storage failures and busy
	// databases (503s), which during an outage come with every request: the
	// first is logged at once, the ones after it within the interval are
	// counted, and one line ("N more requests failed with ...") is logged
	// when the interval has passed. 0: DefaultFailureLogInterval; negative:
	// a line per request.
	FailureLogInterval time.Duration
	// MeterProvider and TracerProvider receive the engine's metrics and
	// spans (nil: the global providers, no-ops until the service installs
	// an OpenTelemetry SDK). See the README's "Metrics and traces".
	MeterProvider  metric.MeterProvider
	TracerProvider trace.TracerProvider
}

// HTTP serves //idem:http endpoints on a Store. Create it with NewHTTP; it
// is safe for concurrent use.
type HTTP struct {
	store     *Store
	principal func(*http.Request) (string, error)
	maxBody   int64
	replay    []string // canonical names, Content-Type first
	strict    bool
	txOptions pgx.TxOptions
	logger    *slog.Logger
	failures  *failureLog // the 503s of outages, folded
	// connCheckMS is the client_connection_check_interval in milliseconds,
	// 0 when off (configured so, or refused by the server).
	connCheckMS atomic.Int64
	idle        time.Duration // idle_in_transaction_session_timeout; 0: the session's
	flights     flights
	tel         *telemetry.Telemetry
}

// NewHTTP returns an HTTP engine on store configured by cfg, which it
// validates and copies.
func NewHTTP(store *Store, cfg HTTPConfig) (*HTTP, error) {
	if store == nil {
		return nil, errors.New("idem.NewHTTP: nil store")
	}
	h := &HTTP{store: store, principal: cfg.Principal, strict: cfg.DisallowUnknownFields, txOptions: cfg.TxOptions, logger: cfg.Logger}
	if strings.EqualFold(string(cfg.TxOptions.AccessMode), string(pgx.ReadOnly)) {
		// Every keyed request would run the function and then fail to
		// store its response, forever.
		return nil, errors.New("idem.NewHTTP: TxOptions.AccessMode is read only, but the response is stored in the function's transaction")
	}
	switch {
	case cfg.MaxBodyBytes == 0:
		h.maxBody = DefaultMaxBodyBytes
	case cfg.MaxBodyBytes < 0:
		return nil, fmt.Errorf("idem.NewHTTP: negative MaxBodyBytes %d", cfg.MaxBodyBytes)
	default:
		h.maxBody = cfg.MaxBodyBytes
	}
	names := cfg.ReplayHeaders
	switch {
	case cfg.NoReplayHeaders && len(names) > 0:
		return nil, errors.New("idem.NewHTTP: both NoReplayHeaders and ReplayHeaders are set")
	case cfg.NoReplayHeaders:
		names = nil
	case len(names) == 0:
		names = DefaultReplayHeaders()
	}
	h.replay = []string{"Content-Type"}
	for _, name := range names {
		name = http.CanonicalHeaderKey(name)
		if name == "" || name == "Set-Cookie" || slices.Contains(h.replay, name) {
			continue // Set-Cookie is never stored: a replay must not hand out a session
		}
		h.replay = append(h.replay, name)
	}
	switch {
	case cfg.NoConnCheck:
	case cfg.ConnCheckInterval < 0:
		return nil, fmt.Errorf("idem.NewHTTP: negative ConnCheckInterval %v (set NoConnCheck to leave it off)", cfg.ConnCheckInterval)
	case cfg.ConnCheckInterval > maxIdleInTransactionTimeout:
		return nil, fmt.Errorf("idem.NewHTTP: ConnCheckInterval %v is over PostgreSQL's maximum, %v", cfg.ConnCheckInterval, maxIdleInTransactionTimeout)
	case cfg.ConnCheckInterval == 0:
		h.connCheckMS.Store(DefaultConnCheckInterval.Milliseconds())
	default:
		h.connCheckMS.Store(max(cfg.ConnCheckInterval.Milliseconds(), 1))
	}
	switch {
	case cfg.NoIdleInTransactionTimeout:
	case cfg.IdleInTransactionTimeout < 0:
		return nil, fmt.Errorf("idem.NewHTTP: negative IdleInTransactionTimeout %v (set NoIdleInTransactionTimeout to leave it off)", cfg.IdleInTransactionTimeout)
	case cfg.IdleInTransactionTimeout > maxIdleInTransactionTimeout:
		// PostgreSQL would refuse the setting with every BEGIN: every
		// request a 503, forever.
		return nil, fmt.Errorf("idem.NewHTTP: IdleInTransactionTimeout %v is over PostgreSQL's maximum, %v", cfg.IdleInTransactionTimeout, maxIdleInTransactionTimeout)
	case cfg.IdleInTransactionTimeout == 0:
		h.idle = DefaultIdleInTransactionTimeout
	default:
		h.idle = cfg.IdleInTransactionTimeout
	}
	if h.logger == nil {
		h.logger = slog.Default()
	}
	if cfg.FailureLogInterval == 0 {
		cfg.FailureLogInterval = DefaultFailureLogInterval
	}
	h.failures = newFailureLog(h.logger, cfg.FailureLogInterval)
	h.tel = telemetry.Must(cfg.MeterProvider, cfg.TracerProvider)
	h.flights.waited = func(ctx context.Context) { endpointTel(ctx).Waited(ctx) }
	return h, nil
}

// Handle returns the http.Handler for one //idem:http function. For every
// request with a new key it runs, in one transaction: claim the key, call fn
// with the decoded JSON request (and its fields tagged path, query or header
// bound: see bind.go), store the response, commit. A repeated key
// with the same request replays the stored response without calling fn.
//
// Generated code calls it; call it by hand to wrap a function without the
// generator. It panics, as http.ServeMux.Handle does, on a nil h or an
// invalid ep: both are programming errors found at start-up.
func Handle[Req, Resp any](h *HTTP, ep Endpoint, fn func(context.Context, pgx.Tx, Req) (Resp, error)) http.Handler {
	if h == nil {
		panic("idem.Handle: nil *HTTP (create it with idem.NewHTTP)")
	}
	ep, err := ep.normalize()
	if err != nil {
		panic(fmt.Sprintf("idem.Handle %s: %v", ep.Scope, err))
	}
	method := ep.method()
	bind, err := newBinder(reflect.TypeFor[Req](), ep.Route)
	if err != nil {
		panic(fmt.Sprintf("idem.Handle %s: request binding: %v", ep.Scope, err))
	}
	name := ep.Route
	if name == "" {
		name = ep.Scope
	}
	tel := h.tel.HTTPEndpoint(name, ep.Scope)
	return endpointHandler{method: method, serve: func(w http.ResponseWriter, r *http.Request) {
		ctx, done := tel.Start(context.WithValue(r.Context(), endpointCtx{}, tel))
		r = r.WithContext(ctx)
		w = &statusRecorder{ResponseWriter: w}
		defer func() {
			rec := w.(*statusRecorder)
			if p := recover(); p != nil {
				// net/http recovers the panic and drops the response: the
				// client saw a failure, not an executed operation.
				if rec.status < 500 {
					rec.status = http.StatusInternalServerError
				}
				rec.replayed = false
				rec.err = fmt.Errorf("handler panicked: %v", p)
				done(rec.outcome())
				panic(p)
			}
			done(rec.outcome())
		}()
		if method != "" && r.Method != method {
			w.Header().Set("Allow", method)
			writeProblem(w, &Error{Status: http.StatusMethodNotAllowed,
				Detail: fmt.Sprintf("%s does not accept %s; use %s", r.URL.Path, r.Method, method)})
			return
		}
		in, perr := h.readRequest(w, r, ep)
		if perr != nil {
			writeProblem(w, perr)
			return
		}
		var req Req
		if perr := bind.decode(r, in, &req, h.strict); perr != nil {
			var bp *bindPanicError
			if errors.As(perr.Err, &bp) {
				h.logger.ErrorContext(ctx, "request binding: a bound type panicked on the request's value; answered 400",
					"type", bp.typ.String(), "panic", fmt.Sprint(bp.value), "stack", string(bp.stack), "detail", perr.Detail)
			}
			writeProblem(w, perr)
			return
		}
		call := func(ctx context.Context, tx pgx.Tx) (any, error) { return fn(ctx, tx, req) }
		out, err := h.serve(r.Context(), ep, in, call)
		if err != nil {
			err = h.functionCulprit(r.Context(), err)
			w.(*statusRecorder).err = err
			writeProblem(w, h.problemFor(r, ep, err))
			return
		}
		w.(*statusRecorder).replayed = out.replayed
		out.write(w)
	}}
}

// endpointHandler is the handler Handle returns. Its method lets
// HandleRoute's 405 leave out of Allow a method that ServeMux routes to it
// but that it refuses (HEAD, which ServeMux serves with a GET pattern).
type endpointHandler struct {
	method string // "" accepts any
	serve  http.HandlerFunc
}

func (e endpointHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) { e.serve(w, r) }

// endpointCtx carries the endpoint's instruments to serve and flights.
type endpointCtx struct{}

func endpointTel(ctx context.Context) *telemetry.HTTPEndpoint {
	e, _ := ctx.Value(endpointCtx{}).(*telemetry.HTTPEndpoint)
	return e
}

// statusRecorder remembers what Handle answered, for the outcome attribute:
// "executed", "replayed", or the status code of a problem.
type statusRecorder struct {
	http.ResponseWriter
	status   int
	replayed bool
	err      error
}

func (s *statusRecorder) WriteHeader(code int) {
	if s.status == 0 {
		s.status = code
	}
	s.ResponseWriter.WriteHeader(code)
}

// Unwrap lets http.ResponseController reach the real writer.
func (s *statusRecorder) Unwrap() http.ResponseWriter { return s.ResponseWriter }

func (s *statusRecorder) outcome() (string, error) {
	switch {
	case s.replayed:
		return "replayed", nil
	case s.status == 0 || s.status < 300:
		return "executed", nil
	}
	if s.status < 500 {
		// The client's mistake: an outcome, not a server span error (as
		// OpenTelemetry's HTTP conventions have it).
		return strconv.Itoa(s.status), nil
	}
	return strconv.Itoa(s.status), s.err
}

// request is what serve needs of an HTTP request, read and validated before
// any database work, so that a bad request stores nothing.
type request struct {
	principal   string
	key         *Key // nil: no key was sent and the endpoint allows that
	fingerprint []byte
	body        []byte
}

// response is a complete response, as sent and as stored.
type response struct {
	status   int
	header   http.Header
	body     []byte
	replayed bool
	// stored, when not nil, is the subset of header that run stored with
	// the key (replayHeaders), which the key's duplicates are answered.
	stored http.Header
}

func (o *response) write(w http.ResponseWriter) {
	h := w.Header()
	for k, v := range o.header {
		h[k] = v
	}
	if o.replayed {
		h.Set("Idempotent-Replayed", "true")
	}
	h.Set("Content-Length", strconv.Itoa(len(o.body)))
	w.WriteHeader(o.status)
	_, _ = w.Write(o.body)
}

// readRequest resolves the principal (for every request: authentication
// never depends on the key header), validates the key, reads the body under
// the size limit and checks its media type (binder.decode then decodes,
// binds and fingerprints it).
func (h *HTTP) readRequest(w http.ResponseWriter, r *http.Request, ep Endpoint) (*request, *Error) {
	in := &request{}
	if h.principal != nil {
		p, err := h.principal(r)
		if err != nil {
			var e *Error
			if errors.As(err, &e) {
				if !e.isFailure() {
					h.logger.ErrorContext(r.Context(), "Principal returned an *idem.Error whose status is not 4xx or 5xx", "status", e.Status, "err", err)
					return nil, &Error{Status: http.StatusInternalServerError, Err: err}
				}
				return nil, e
			}
			return nil, &Error{Status: http.StatusUnauthorized, Detail: err.Error(), Err: err}
		}
		in.principal = p
	}
	raw, present := r.Header[http.CanonicalHeaderKey(ep.KeyHeader)]
	switch {
	case !present && !ep.KeyOptional:
		return nil, &Error{Status: http.StatusBadRequest, Title: "Missing idempotency key",
			Detail: fmt.Sprintf("this operation requires the %s header", ep.KeyHeader)}
	case present:
		key, err := parseKey(raw)
		if err != nil {
			return nil, &Error{Status: http.StatusBadRequest, Title: "Malformed idempotency key",
				Detail: fmt.Sprintf("%s: %v", ep.KeyHeader, err)}
		}
		in.key = &Key{Scope: ep.Scope, Principal: in.principal, Key: key}
	}

	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, h.maxBody))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return nil, &Error{Status: http.StatusRequestEntityTooLarge,
				Detail: fmt.Sprintf("request body exceeds %d bytes", h.maxBody)}
		}
		return nil, &Error{Status: http.StatusBadRequest, Detail: "reading request body: " + err.Error()}
	}
	if ct := r.Header.Get("Content-Type"); len(body) > 0 && ct != "" && !isJSON(ct) {
		return nil, &Error{Status: http.StatusUnsupportedMediaType,
			Detail: fmt.Sprintf("the body must be JSON (application/json), not %q", ct)}
	}
	in.body = body
	return in, nil
}

// isJSON reports whether a Content-Type names JSON: application/json or a
// +json structured syntax suffix, any parameters.
func isJSON(contentType string) bool {
	if contentType == "application/json" {
		return true // what most clients send: no need to parse it
	}
	mt, _, err := mime.ParseMediaType(contentType)
	return err == nil && (mt == "application/json" || strings.HasPrefix(mt, "application/") && strings.HasSuffix(mt, "+json"))
}

// decodeJSON decodes exactly one JSON value into v.
func decodeJSON(body []byte, v any, strict bool) *Error {
	dec := json.NewDecoder(bytes.NewReader(body))
	if strict {
		dec.DisallowUnknownFields()
	}
	if err := dec.Decode(v); err != nil {
		return &Error{Status: http.StatusBadRequest, Title: "Invalid JSON body", Detail: err.Error()}
	}
	if _, err := dec.Token(); err != io.EOF {
		return &Error{Status: http.StatusBadRequest, Title: "Invalid JSON body", Detail: "unexpected data after the JSON value"}
	}
	return nil
}

// Errors serve uses to pick the response; they never reach the client as text.
var (
	// errInFlight: a request with the same key is being processed right now
	// (409).
	errInFlight = errors.New("a request with this key is in flight")
	// errElsewhere: the key is in flight in another transaction (another
	// process, or a request of this one that the local turn did not see);
	// serve polls for it.
	errElsewhere = errors.New("key in flight in another transaction")
	// errRetryClaim: the claim lost a serialization race with a request
	// that just finished; a new transaction will see its row.
	errRetryClaim = errors.New("claim must be retried")
	// errKeyRowExists wraps errRetryClaim when StoreNewKey met a row of the
	// key: the request's next attempts store with StoreKey (see attempt).
	errKeyRowExists = errors.New("StoreNewKey met a row of the key")
	errFingerprint  = errors.New("key reused with a different request")
	// errBusy: no connection, or a lock other than the key's, within the
	// wait (503 with Retry-After).
	errBusy          = errors.New("database busy")
	errNoAnswer      = errors.New("the database did not answer within the wait") // with errBusy: see unanswered
	errStorage       = errors.New("idempotency storage unavailable")
	errEncodeFailure = errors.New("encode response")
	// errFunctionMovedKeys: the function changed search_path so that
	// StoreKey would write into another idem_keys; nothing is stored (500).
	errFunctionMovedKeys = errors.New("the function changed search_path (or made a temporary idem_keys) so that idem_keys named another table than the one the key was claimed in: nothing was stored or committed (put search_path back before returning, or qualify your tables' names)")
	// errFunctionTempTable: a temporary table has a runtime table's name;
	// nothing is stored or committed (500).
	errFunctionTempTable = errors.New("the function made a temporary table named like one of the runtime's tables (idem_keys, idem_outbox, ...), which would hide it on this pooled connection: nothing was stored or committed")
	// errStoreRefused: StoreKey found no idem_keys it may write (42501
	// permission denied, or 42P01 when its schema is not visible): the
	// role in force when it ran, a SET ROLE the function left or the
	// database role's own rights, cannot write the table the claim read.
	// Nothing is stored or committed, and retrying will not help (500, not
	// 503).
	errStoreRefused = errors.New("the response could not be stored: idem_keys is not visible or not writable to the role in force (a SET ROLE the function left, or the database role's rights): nothing was stored or committed")
	// errFunctionEndedTx: the function committed or rolled back the
	// runtime's transaction itself; nothing is stored (500).
	errFunctionEndedTx = errors.New("the function ended its transaction itself (COMMIT or ROLLBACK): no response was stored, and its work may or may not have committed")
	// errFunctionTxAborted: a statement of the function failed and the
	// function returned success anyway; the transaction rolls back (500).
	errFunctionTxAborted = errors.New("the function returned success in an aborted transaction (a failed statement's error was swallowed): nothing was committed")
	// errCommitUnknown: the COMMIT was sent but no answer came back, so
	// whether it committed is unknown (503 saying so; the key makes the
	// retry safe: it replays a committed response or runs the function).
	errCommitUnknown = errors.New("commit outcome unknown")
	// errConnClosedUnderFunction: the function returned success on a
	// transaction whose connection is closed; no COMMIT was sent (503, or
	// 500 when the function's own context closed it: functionCulprit).
	errConnClosedUnderFunction = errors.New("the function returned on a transaction whose connection is closed: nothing was committed")
)

// serve runs one operation. With a key, in one transaction:
//
//  1. claim the key: take the key's advisory lock (the in-flight marker)
//     and insert the row (INSERT ... ON CONFLICT), never waiting on another
//     claim of the same key;
//  2. if the key was already completed: replay it (or 422 on a different
//     fingerprint), without calling the function;
//  3. call the function with the transaction;
//  4. store the response on the key row;
//  5. commit.
//
// A duplicate of a key in flight holds no connection while it waits: in this
// process it waits for its turn on the key (only one request per key at a
// time uses the database), and while the key is in flight elsewhere it polls
// with backoff, releasing its connection between polls. The whole wait
// (turn, pool, locks, polls) is bounded by ep.Wait.
//
// Any failure before the commit rolls everything back: no side effect, no
// stored key, and a retry runs the function again. A cancelled ctx is such a
// failure: it is returned as is and nothing commits.
func (h *HTTP) serve(ctx context.Context, ep Endpoint, in *request, call func(context.Context, pgx.Tx) (any, error)) (*response, error) {
	deadline := time.Now().Add(ep.Wait)
	if in.key == nil {
		tx, conn, c, err := h.begin(ctx, deadline, nil)
		if err != nil {
			return nil, err
		}
		defer conn.Release()
		defer endTx(ctx, tx) // after the commit this sends nothing (SessionCommit leaves tx unaware of it)
		return h.run(ctx, ep, in, tx, false, c, call)
	}
	stored := in.key.storageKey()
	turn, out, err := h.flights.wait(ctx, stored, in.fingerprint, deadline, ep.NoWait)
	if err != nil || out != nil {
		return out, err
	}
	defer turn.release()
	poll := pollMin
	rowSeen := false // a StoreNewKey of this request met a row of the key
	for polled := false; ; polled = true {
		out, err := h.attempt(ctx, ep, in, stored, deadline, rowSeen, call)
		if err == nil {
			// out is now the key's stored response: the duplicates waiting
			// for the turn answer it without touching the database.
			stored := out.stored
			if stored == nil {
				stored = h.replayHeaders(out.header)
			}
			turn.publish(&response{status: out.status, header: stored, body: out.body, replayed: true}, in.fingerprint)
		}
		switch {
		case errors.Is(err, errElsewhere):
			if ep.NoWait {
				return nil, errInFlight
			}
			if !polled {
				endpointTel(ctx).Waited(ctx) // in flight on another replica
			}
		case errors.Is(err, errRetryClaim):
			rowSeen = rowSeen || errors.Is(err, errKeyRowExists)
		case polled && errors.Is(err, errBusy) && pgCode(err) != "55P03" && !errors.Is(err, errNoAnswer) && !time.Now().Before(deadline):
			// The wait ran out during a poll for a key in flight elsewhere.
			// Not a lock_timeout (55P03): the claim never waits for the
			// key's own lock, so such a wait was for another one (a purge
			// holding the expired row this claim took over, a table lock),
			// and the key, claimed by this request, is not in flight: a 503,
			// as on the first attempt. Nor a database that did not answer
			// the poll's claim in time (errNoAnswer: a table lock that its
			// statements' first prepare on a connection waits for, before
			// the claim's lock_timeout is set; a blackhole): nobody knows
			// then whether the key is still in flight, and the database is
			// what failed, a 503.
			return nil, errInFlight
		default:
			return out, err
		}
		remaining := time.Until(deadline)
		if remaining <= 0 {
			if errors.Is(err, errElsewhere) {
				return nil, errInFlight
			}
			return nil, fmt.Errorf("%w: claim kept conflicting: %w", errBusy, err)
		}
		t := time.NewTimer(min(poll, remaining))
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		}
		poll = min(2*poll, pollMax)
	}
}

// attempt is one claim transaction: it runs the function (claimed), replays
// (a live row), or returns errElsewhere (in flight in another transaction).
func (h *HTTP) attempt(ctx context.Context, ep Endpoint, in *request, stored Key, deadline time.Time, rowSeen bool, call func(context.Context, pgx.Tx) (any, error)) (*response, error) {
	tx, conn, c, err := h.begin(ctx, deadline, &db.ClaimKeyParams{
		Scope: stored.Scope, Principal: stored.Principal, Key: stored.Key, LockID: stored.lockID(),
	})
	if err != nil {
		return nil, err
	}
	async := false
	defer func() {
		if !async {
			endTx(ctx, tx) // after a commit this sends nothing
			conn.Release()
		}
	}()
	if !c.claimed {
		if c.found && c.row.Live {
			// The claim read the row and wrote nothing (ClaimKey takes no
			// lock for a live row): the client gets its replay now, and the empty
			// transaction ends in the background, a round trip it need
			// not wait for. The connection returns to the pool after.
			async = true
			go func() {
				endTx(ctx, tx)
				conn.Release()
			}()
			return replay(ctx, c.row, in)
		}
		return nil, errElsewhere
	}
	crash.Point(ctx, "http.after-claim")
	// Under read committed the claim wrote nothing, and when GetKey (with a
	// snapshot taken after the key's lock) saw no row either, the response
	// is stored with a plain INSERT (StoreNewKey). A claim that saw a row
	// (an expired one, taken over) or wrote one (ClaimKeyRow, when the
	// snapshot predates the lock) leaves a row for StoreKey to replace.
	// rowSeen: an earlier attempt's StoreNewKey met a row that this claim
	// cannot see, which may be the function's own (it inserted its key's
	// row, expired): StoreKey, as before StoreNewKey, takes an expired one
	// over where StoreNewKey would fail again at every attempt until the
	// wait ran out.
	fresh := !c.found && !rowSeen && !c.rowChecked
	return h.run(ctx, ep, in, tx, fresh, c, call)
}

// claimResult is what a claim found: claimed, this transaction runs the
// key; otherwise found tells whether row, the key's row, exists (when it
// does not, the key is in flight in another transaction).
type claimResult struct {
	claimed, found bool
	// rowChecked: the claim ran ClaimKeyRow (its snapshot predates the
	// lock), which may have written a claim row for StoreKey to replace.
	rowChecked bool
	row        db.GetKeyRow
	// sent and answered time the round trip(s) that began the transaction
	// (see idleClock.began).
	sent, answered time.Time
}

// begin acquires a connection within deadline and begins a transaction on
// it with the engine's settings. With claim, the claim runs in the same
// round trip (the transaction's lock_timeout is the time left until
// deadline, restored before the function runs) and its result is returned;
// a claim that takes over an expired row locks it in one more round trip,
// under what is left of that lock_timeout, and its failures (a lock_timeout,
// a broken connection) are classified as the claim's own.
// The caller releases conn after ending tx. Errors are classified:
// errBusy (the wait ran out), errRetryClaim (a serialization conflict), or
// a storage failure.
func (h *HTTP) begin(ctx context.Context, deadline time.Time, claim *db.ClaimKeyParams) (pgx.Tx, *pgxpool.Conn, claimResult, error) {
	doing := "begin"
	if claim != nil {
		doing = "begin and claim key"
	}
	retries := 0
	for {
		actx, cancel := context.WithDeadline(ctx, deadline)
		conn, err := h.store.pool.Acquire(actx)
		waited := actx.Err() != nil // the wait ran out (ctx's own end is seen below)
		cancel()
		if err != nil {
			if ctxErr := ctx.Err(); ctxErr != nil {
				return nil, nil, claimResult{}, ctxErr
			}
			if waited && errors.Is(err, context.DeadlineExceeded) {
				return nil, nil, claimResult{}, fmt.Errorf("%w: no database connection free within the wait: %w", errBusy, err)
			}
			// Any other failure is the database's, a deadline that ended
			// within the wait included: the pool's connect timeout
			// (pgconn's ConnectTimeout) on a database that does not
			// answer, a deadline of a pool hook's own. Not the wait, nor
			// the request's end.
			return nil, nil, claimResult{}, storageErr(ctx, "acquire connection", err)
		}
		check := h.connCheckMS.Load()
		s := dbx.Settings{ConnCheck: time.Duration(check) * time.Millisecond, Idle: h.idle}
		if claim != nil {
			s.LockTimeout = max(time.Until(deadline), time.Millisecond)
		}
		bctx, cancel := answerBound(ctx, deadline)
		sent := time.Now()
		tx, c, err := h.beginOn(bctx, conn.Conn(), s, claim)
		c.sent, c.answered = sent, time.Now()
		err = unanswered(ctx, bctx, doing, err)
		cancel()
		if err == nil {
			return tx, conn, c, nil
		}
		if tx != nil {
			rollback(ctx, tx) // a refused setting or claim left it aborted
		}
		dead := conn.Conn().IsClosed()
		conn.Release()
		if dead && ctx.Err() == nil && !errors.Is(err, errBusy) && time.Now().Before(deadline) &&
			retries < int(h.store.pool.Config().MaxConns) {
			// The connection broke under the batch: most often a pooled
			// one whose session had already ended (a failover, a
			// terminated backend) while it sat idle for less than the
			// pool's ping threshold. Nothing this batch did can have
			// committed (it holds no COMMIT), so another try on another
			// connection is safe. A failover ends every pooled session at
			// once, and the next idle connection may be dead too: each
			// dead one leaves the pool as it is released, so after at
			// most MaxConns tries the pool dials a new one. The deadline
			// bounds the whole.
			retries++
			continue
		}
		if check > 0 && connCheckRefused(err) && h.connCheckMS.CompareAndSwap(check, 0) {
			h.logger.WarnContext(ctx, "PostgreSQL refuses client_connection_check_interval; a killed process frees its keys only when its statement ends",
				"err", err)
			continue
		}
		if errors.Is(err, errBusy) {
			return nil, nil, claimResult{}, err
		}
		switch pgCode(err) {
		case "55P03": // lock_timeout: not our key's lock, which is never waited on
			return nil, nil, claimResult{}, fmt.Errorf("%w: claim waited for a table or row lock past the wait bound: %w", errBusy, err)
		case "40001", "40P01":
			if claim != nil {
				return nil, nil, claimResult{}, errRetryClaim
			}
		}
		return nil, nil, claimResult{}, storageErr(ctx, doing, err)
	}
}

// beginOn begins the transaction on conn and runs the claim, if any: in one
// pipelined round trip, or in two when TxOptions has a custom BeginQuery
// (which may hold several statements, see dbx.Pipelined); the takeover of
// an expired row adds one (dbx.BeginClaim). On error tx, when
// not nil, is still to be rolled back.
func (h *HTTP) beginOn(ctx context.Context, conn *pgx.Conn, s dbx.Settings, claim *db.ClaimKeyParams) (tx pgx.Tx, c claimResult, err error) {
	if dbx.Pipelined(h.txOptions) {
		if claim == nil {
			tx, err = dbx.Begin(ctx, conn, h.txOptions, s)
			return tx, c, err
		}
		tx, c.claimed, c.found, c.rowChecked, c.row, err = dbx.BeginClaim(ctx, conn, h.txOptions, s, *claim)
		return tx, c, err
	}
	start := time.Now()
	tx, err = conn.BeginTx(ctx, dbx.BoundedBegin(h.txOptions, s.LockTimeout, s.ConnCheck, s.Idle))
	if err != nil || claim == nil {
		return tx, c, err
	}
	c.rowChecked = dbx.SnapshotBeforeClaim(h.txOptions)
	c.claimed, c.found, c.row, err = dbx.ClaimKeyRestore(ctx, tx, c.rowChecked, s.LockTimeout, start, *claim)
	return tx, c, err
}

// endTx rolls tx back unless its connection is already out of a
// transaction (StoreKeyCommit committed it in the same round trip as the
// response, which tx does not know): a ROLLBACK then would be a round trip
// for nothing.
func endTx(ctx context.Context, tx pgx.Tx) {
	if c := tx.Conn(); c != nil && c.PgConn().TxStatus() == 'I' {
		return
	}
	rollback(ctx, tx)
}

// answerBound returns ctx bounded for a round trip of the runtime's own
// before the function runs: it must come back within the wait plus
// answerSlack.
func answerBound(ctx context.Context, deadline time.Time) (context.Context, context.CancelFunc) {
	return context.WithDeadline(ctx, deadline.Add(answerSlack))
}

// unanswered turns err into errBusy when bctx, answerBound's context, ran out
// while ctx did not: the database did not answer in time (pgx has closed the
// connection, so whatever the server was doing rolls back). Other errors,
// including ctx's own cancellation, pass through.
func unanswered(ctx, bctx context.Context, doing string, err error) error {
	if err != nil && ctx.Err() == nil && bctx.Err() != nil {
		return fmt.Errorf("%w: %s: %w: %w", errBusy, doing, errNoAnswer, err)
	}
	return err
}

// connCheckRefused reports a server that cannot set
// client_connection_check_interval (a platform without the check, or a
// server older than 14).
func connCheckRefused(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "22023" || pgErr.Code == "42704") &&
		strings.Contains(pgErr.Message, "client_connection_check_interval")
}

// run calls the function in tx, stores its response on the claimed key (if
// any) and commits. fresh: the claim saw no row of the key and wrote none
// (see StoreNewKey).
func (h *HTTP) run(ctx context.Context, ep Endpoint, in *request, tx pgx.Tx, fresh bool, began claimResult, call func(context.Context, pgx.Tx) (any, error)) (*response, error) {
	header := http.Header{}
	ctx = &opCtx{Context: ctx, header: header, principal: in.principal, key: in.key}
	called := time.Now()
	ftx := clockTx(tx, called)
	clock := ftx.clock
	if !began.sent.IsZero() {
		clock.began(began.sent, began.answered)
	}
	result, err := call(ctx, ftx)
	returned := time.Now()
	idle := clock.idle(returned) // the function's longest idle stretch, monotonic
	if err != nil {
		cerr := classifyFunctionError(ctx, tx, err)
		if errors.Is(cerr, errStorage) {
			// A closed connection: the function's own context may have
			// closed it (ownCtxCause), or its transaction's lowered idle
			// timeout (idleWindow), decided in functionCulprit.
			return nil, withWindow(suspect(cerr, idle, 0, ownCtxCause(ctx, tx, clock, err), clock.ran(returned.Sub(called))), handlerWindow(clock, returned))
		}
		return nil, suspectIdle(cerr, idle, 0)
	}
	if cause := ownCtxCause(ctx, tx, clock, nil); cause != nil {
		// Returned success on a connection its own context closed: the
		// COMMIT would be sent nowhere, and its failure answered "Outcome
		// unknown" although nothing was sent.
		return nil, suspect(storageErr(ctx, "function's transaction", errConnClosedUnderFunction), idle, 0, cause, clock.ran(returned.Sub(called)))
	}
	if tx.Conn().IsClosed() {
		// Returned success on a closed connection: nothing can commit, and
		// nothing was sent ("Outcome unknown" was false). Judged as the
		// call that closed it, whose error the function swallowed (a
		// 25P03 of its own idling is its failure: a 500), else a 503.
		if end := clock.ended(); end != nil {
			cerr := storageErr(ctx, "function's transaction", fmt.Errorf("%w: %w", errSwallowedConnEnd, end.err))
			return nil, withWindow(suspectIdle(cerr, idle, 0), end.window)
		}
		return nil, storageErr(ctx, "function's transaction", errConnClosedUnderFunction)
	}
	commitAt := time.Now()
	out, err := h.commit(ctx, ep, in, tx, fresh, result, header)
	if err != nil {
		// The runtime's time since the function returned counts up to the
		// COMMIT's answer (see idleCulprit).
		failed := time.Now()
		return nil, withWindow(suspectIdle(err, idle, failed.Sub(returned)), clock.windowAt(returned, commitAt, failed))
	}
	return out, nil
}

// commit encodes the function's result, stores it on the claimed key (if
// any) and commits tx.
func (h *HTTP) commit(ctx context.Context, ep Endpoint, in *request, tx pgx.Tx, fresh bool, result any, header http.Header) (*response, error) {
	crash.Point(ctx, "http.after-call")
	body, err := json.Marshal(result)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errEncodeFailure, err)
	}
	header.Set("Content-Type", "application/json")
	out := &response{status: ep.Status, header: header, body: body}

	if err := ctx.Err(); err != nil {
		// A function that ignored cancellation must not commit: the caller
		// (a client that hung up, or shutdown) has been told nothing
		// happened.
		return nil, err
	}
	// The function must leave its transaction open and healthy: one that
	// ended it (COMMIT, ROLLBACK, pgx's own Commit or Rollback, a reflexive
	// defer tx.Rollback) has had its work committed or rolled back outside
	// the key, and storing the response now would record, outside any
	// transaction, an answer for work that may never have happened; one that
	// swallowed a failed statement has an aborted transaction that cannot
	// commit. Both are the function's bug (500), never a retry to invite.
	switch tx.Conn().PgConn().TxStatus() {
	case 'I':
		return nil, errFunctionEndedTx
	case 'E':
		return nil, errFunctionTxAborted
	}
	if in.key == nil {
		crash.Point(ctx, "http.before-commit")
		var err error
		if dbx.Pipelined(h.txOptions) && h.txOptions.CommitQuery == "" {
			// RestoreSession, then COMMIT: what the function changed in the
			// session does not outlive the transaction (see RestoreSession).
			err = dbx.SessionCommit(ctx, tx)
		} else {
			err = tx.Commit(ctx)
		}
		if err != nil {
			if pgCode(err) == "22P02" && strings.Contains(err.Error(), tempShadow) {
				return nil, fmt.Errorf("%w: %w", errFunctionTempTable, err)
			}
			if pgCode(err) != "" && !errors.Is(err, dbx.ErrCommit) {
				// RestoreSession failed (a statement_timeout the function
				// set, say): the COMMIT was skipped, nothing committed.
				return nil, storageErr(ctx, "commit", err)
			}
			if (pgCode(err) == "" && !errors.Is(err, pgx.ErrTxCommitRollback)) || sessionEnded(err) {
				// No answer, or the session ended where it was due: the
				// COMMIT may have gone through (see the keyed case below).
				return nil, fmt.Errorf("%w: %w", errCommitUnknown, storageErr(ctx, "commit", err))
			}
			if refused := commitRefused(ctx, tx, err); refused != nil {
				return nil, refused
			}
			return nil, storageErr(ctx, "commit", err)
		}
	} else {
		stored := in.key.storageKey()
		out.stored = h.replayHeaders(header)
		headers, err := encodeHeaders(out.stored)
		if err != nil {
			return nil, fmt.Errorf("%w: headers: %w", errEncodeFailure, err)
		}
		crash.Point(ctx, "http.before-commit")
		// The response is stored and the transaction committed in one
		// round trip; a failed store skips the COMMIT (the transaction
		// rolls back).
		err = dbx.StoreKeyCommit(ctx, tx, h.txOptions.CommitQuery, fresh, db.StoreKeyParams{
			Scope: stored.Scope, Principal: stored.Principal, Key: stored.Key, Fingerprint: in.fingerprint,
			StatusCode: int32(out.status), Headers: headers, Body: body, TtlSeconds: ep.TTL.Seconds(),
		})
		switch c := pgCode(err); {
		case err == nil:
		case c == "" && !errors.Is(err, pgx.ErrTxCommitRollback):
			// No answer from the server (the connection broke, or ctx
			// ended and pgx gave up on it) while the COMMIT was on its way
			// or running: it may have committed. Saying "nothing was done"
			// could be false; a retry with the key is right either way.
			return nil, fmt.Errorf("%w: %w", errCommitUnknown, storageErr(ctx, "store response and commit", err))
		case errors.Is(err, dbx.ErrCommit) && sessionEnded(err):
			// The server ended the session (FATAL) where the COMMIT's
			// answer was due: it may have ended it after committing (a
			// shutdown or a terminate while a synchronous commit waits for
			// its standby: "already committed locally"). Unknown, as above.
			return nil, fmt.Errorf("%w: %w", errCommitUnknown, storageErr(ctx, "commit", err))
		case c == "23505" && !errors.Is(err, dbx.ErrCommit) && keyRowConflict(err):
			// StoreNewKey met a row of the key, committed by something that
			// did not take the key's lock, or written by the function
			// itself: nothing committed; retried as below, storing with
			// StoreKey from now on (see attempt).
			return nil, fmt.Errorf("%w: %w", errRetryClaim, errKeyRowExists)
		case c == "40001" || c == "40P01":
			// Nothing committed: the key was completed by another
			// transaction after this one's snapshot (StoreKey; StoreNewKey
			// reports it as a unique violation of the key's row, above), or the
			// COMMIT lost a serialization race. The next attempt replays
			// or runs the function again.
			return nil, errRetryClaim
		case errors.Is(err, dbx.ErrCommit):
			if refused := commitRefused(ctx, tx, err); refused != nil {
				return nil, refused
			}
			return nil, storageErr(ctx, "commit", err)
		case c == "22P02" && strings.Contains(err.Error(), keysMoved):
			// The function changed what idem_keys names (search_path, SET
			// LOCAL or not): the response would be stored where the next
			// claim does not look. Nothing committed, and the rollback
			// undoes the change on the pooled connection.
			return nil, fmt.Errorf("%w: %w", errFunctionMovedKeys, err)
		case c == "22P02" && strings.Contains(err.Error(), tempShadow):
			return nil, fmt.Errorf("%w: %w", errFunctionTempTable, err)
		case (c == "42501" || c == "42P01") && !errors.Is(err, dbx.ErrCommit):
			return nil, fmt.Errorf("%w: %w", errStoreRefused, err)
		case c == "22P02" && strings.Contains(err.Error(), notClaimingTx):
			// The function ended the claiming transaction and began
			// another (COMMIT AND CHAIN, ROLLBACK AND CHAIN): TxStatus
			// cannot tell, StoreKey can (see its comment).
			return nil, errFunctionEndedTx
		case strings.HasPrefix(c, "22") || c == "54000":
			// PostgreSQL refused a header the function set: its bug (500),
			// not a storage failure to retry forever.
			return nil, fmt.Errorf("store response headers: %w", err)
		default:
			return nil, storageErr(ctx, "store response", err)
		}
	}
	crash.Point(ctx, "http.after-commit")
	return out, nil
}

// classifyFunctionError maps an error of the wrapped function: an *Error is
// the function's choice; a dead connection is a storage failure (503); a
// value PostgreSQL refused to store (invalid text, a NUL, a number out of
// range, an index row too large) came from the request, so it is the
// client's (422); a lock or serialization conflict is transient (503 with
// Retry-After). Anything else is the function's own failure (500).
func classifyFunctionError(ctx context.Context, tx pgx.Tx, err error) error {
	var e *Error
	if errors.As(err, &e) {
		return err
	}
	if cerr := cancelledByCtx(ctx, err); cerr != nil {
		return cerr
	}
	if tx.Conn().IsClosed() {
		// The function failed because the database connection died under
		// it: a storage failure (503, retry later), not a bug (500).
		return storageErr(ctx, "function's transaction", err)
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return err
	}
	switch {
	case strings.HasPrefix(pgErr.Code, "22") || pgErr.Code == "54000":
		return &Error{Status: http.StatusUnprocessableEntity, Title: "Value not storable",
			Detail: "the request holds a value the database cannot store: " + pgErr.Message, Err: err}
	case pgErr.Code == "40001" || pgErr.Code == "40P01" || pgErr.Code == "55P03":
		return fmt.Errorf("%w: the function's statement conflicted with another transaction: %w", errBusy, err)
	case pgErr.Code == "57014":
		// Not the request's cancellation (cancelledByCtx, above): the
		// server cancelled the function's statement (statement_timeout, an
		// operator's pg_cancel_backend, or a context of the function's own
		// on a pool whose context watcher sends a cancel request,
		// pgconn.CancelRequestContextWatcherHandler: the connection stays
		// open and the error holds no context error, so the runtime cannot
		// tell which), as it will again on a retry. The consumer charges it
		// to the record (errStatementCancelled).
		return &Error{Status: http.StatusInternalServerError, Title: "Statement cancelled", Err: err,
			Detail: "a statement of the function was cancelled by the database (statement_timeout, an operator, or a deadline or cancellation of the function's own, not the request's, on a pool that sends cancel requests); nothing was done"}
	}
	return err
}

// functionCulprit resolves a *handlerSuspect in err, the failure of
// serve, once serve has returned the request's connection to the pool
// (reading the session's timeout, or checking that the database answers,
// must not wait for it), by the consumer's rules (handlerCulprit):
//
//   - the server ended the session because the function held its
//     transaction idle past idle_in_transaction_session_timeout
//     (idleCulprit): a 500 saying so, never a 503 "storage unavailable;
//     retry later" (a retry idles again) nor "Outcome unknown" (25P03 ends
//     an idle transaction, so nothing committed);
//   - a context of the function's own (a deadline or cancel it set) ended
//     one of its statements, and pgx closed the connection to end it
//     (ownCtxCause), while the database answers: a 500 saying so, never a
//     503 "request cancelled" (the request was not) nor "storage
//     unavailable" (a retry ends the same way). When the database does not
//     answer, the function's deadline fired because of it: a 503 "storage
//     unavailable; retry later".
//
// Either way the transaction rolled back, the key's claim with it: the key
// is free. Otherwise the error as it was: a session ended after a function
// never idle that long itself (its time went into its own statements over
// a slow network, or the process froze in the runtime) stays the storage
// failure it was.
func (h *HTTP) functionCulprit(ctx context.Context, err error) error {
	var s *handlerSuspect
	if !errors.As(err, &s) {
		return err
	}
	if ctx.Err() != nil {
		return s.err
	}
	if pgCode(s.err) == idleEnded && s.idle >= h.idle {
		if ie := idleCulprit(s.err, s.idle, s.after, idleTimeout(ctx, h.store.pool, h.idle, idleReadBound)); ie != nil {
			return &Error{Status: http.StatusInternalServerError, Title: "Transaction idle too long", Err: fmt.Errorf("function: %w", ie),
				Detail: "the function kept its database transaction idle longer than the database allows (idle_in_transaction_session_timeout); the database ended it and nothing was done"}
		}
	}
	if s.window != nil {
		// The function's transaction lowered its idle timeout and the
		// function idled most of the window (see idleWindow): its doing.
		// Anything less clear stays a 503: the client's retry is the
		// bound here.
		timeout, known := idleTimeoutKnown(ctx, h.store.pool, h.idle, idleReadBound)
		if known && s.window.verdict(timeout) == windowHandler && dbAnswers(ctx, h.store.pool, idleReadBound, s.window.handler) == answers {
			var pgErr *pgconn.PgError
			if errors.As(s.err, &pgErr) {
				return &Error{Status: http.StatusInternalServerError, Title: "Transaction idle too long",
					Err:    fmt.Errorf("function: %w", &loweredIdleError{window: *s.window, timeout: timeout, swallowed: errors.Is(s.err, errSwallowedConnEnd), err: pgErr}),
					Detail: "the function lowered idle_in_transaction_session_timeout in its database transaction and kept it idle longer than that; the database ended it and nothing was done"}
			}
		}
		if ctx.Err() != nil {
			return s.err
		}
	}
	if s.ownCtx == nil {
		return s.err
	}
	if dbAnswers(ctx, h.store.pool, idleReadBound, s.ran) == answers {
		return &Error{Status: http.StatusInternalServerError, Title: "Statement ended by the function's own context", Err: fmt.Errorf("function: %w", &ownCtxError{err: s.ownCtx}),
			Detail: "a context of the function's own (a deadline or cancellation it set, not the request's) ended one of its statements, which closed its database connection; the transaction rolled back and nothing was done"}
	}
	if ctx.Err() != nil {
		return s.err
	}
	// A storage failure saying why: the database does not answer, and its
	// silence fired the function's context (named here).
	return fmt.Errorf("%w: the function's transaction: its connection closed, and the database does not answer: %s", errStorage, s.ownCtx)
}

// idleReadBound bounds the read of the session's
// idle_in_transaction_session_timeout (see idleTimeout) on the HTTP path.
const idleReadBound = 5 * time.Second

// commitRefused returns err, the failure of the COMMIT of a function that
// succeeded, as the function's own error when the database answered and
// refused the function's writes: a DEFERRABLE INITIALLY DEFERRED unique or
// foreign-key constraint (23505, 23503) or a deferred constraint trigger
// raising an exception, checked only at COMMIT. Such a COMMIT rolled back
// (the key's claim and its transaction-scoped lock with it) and fails the
// same way on every retry: answered 503 "storage unavailable; retry later",
// it invited retries that could never succeed and looked like an outage. It
// is classified as the same error returned by the function's own statement
// would be (classifyFunctionError: 500, or 422 for a value PostgreSQL
// refused), with the consumer's test of a COMMIT refused by the handler's
// writes (commitRefusedByWrites). It returns nil for a failure of the
// database's: a dead connection or a session the server ended (the caller
// has already answered those "Outcome unknown"), or an outage SQLSTATE
// (isOutageError: 57014, 57P01, 53100, ...; 40001 and 40P01 of the keyed
// path are retried before this is asked).
func commitRefused(ctx context.Context, tx pgx.Tx, err error) error {
	if !commitRefusedByWrites(tx, err) {
		return nil
	}
	return classifyFunctionError(ctx, tx, fmt.Errorf("commit refused the function's writes: %w", err))
}

// keyRowConflict reports a unique violation in idem_keys: the key's row,
// which StoreNewKey found written by another transaction (or by the
// function). The table is checked, not the constraint's name:
// idem_keys_pkey is only PostgreSQL's default, and an idem_keys made again
// beside an older one renamed aside (whose index keeps that name) has
// idem_keys_pkey1. StoreNewKey inserts into idem_keys only, so its unique
// violations are idem_keys' unless a trigger of the user's writes elsewhere.
func keyRowConflict(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.TableName == "idem_keys"
}

// notClaimingTx is in the message of StoreKey's failure when it runs in
// another transaction than the one that claimed the key.
const notClaimingTx = "idem: not the transaction that claimed the key"

// keysMoved is in the message of StoreKey's (StoreNewKey's) failure when
// idem_keys names another table than it did when the key was claimed.
const keysMoved = "idem: the function made idem_keys name another table"

// tempShadow is in the message of the failure of the statement sent before
// the runtime's COMMIT (StoreKey, StoreNewKey, CheckOwnTransaction,
// RestoreSession) when a temporary table has the name of one of the
// runtime's tables: the temporary schema comes first in every search_path.
const tempShadow = "idem: a temporary table hides a table of the runtime"

// cancelledByCtx returns ctx's error wrapping err when ctx has ended and
// err is the server's 57014 (query_canceled): with a pool whose context
// watcher sends a cancel request (pgconn.CancelRequestContextWatcherHandler)
// instead of closing the connection, a client that goes away during the
// function's statement or its COMMIT gets "canceling statement due to user
// request", a statement error on a healthy connection. The transaction
// rolled back; it is the request's cancellation (context.Canceled kept),
// not the function's failure (500) nor a storage outage. nil otherwise.
func cancelledByCtx(ctx context.Context, err error) error {
	if ctxErr := ctx.Err(); ctxErr != nil && pgCode(err) == "57014" {
		return fmt.Errorf("%w: %w", ctxErr, err)
	}
	return nil
}

// sessionEnded reports an error with which the server ended the session
// (severity FATAL or PANIC), as opposed to one that ended a statement or a
// transaction.
func sessionEnded(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Severity == "FATAL" || pgErr.Severity == "PANIC")
}

// pgCode is the SQLSTATE of err, or "".
func pgCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// replay answers a request whose key is already completed, from the row the
// claim read.
func replay(ctx context.Context, row db.GetKeyRow, in *request) (*response, error) {
	if !bytes.Equal(row.Fingerprint, in.fingerprint) {
		return nil, errFingerprint
	}
	var header http.Header
	if string(row.Headers) == jsonbOnlyHeaders || string(row.Headers) == jsonOnlyHeaders {
		// What json.Unmarshal gives, without its reflection.
		header = http.Header{"Content-Type": {"application/json"}}
	} else {
		header = http.Header{}
		if err := json.Unmarshal(row.Headers, &header); err != nil {
			return nil, storageErr(ctx, "decode stored headers", err)
		}
	}
	return &response{status: int(row.StatusCode), header: header, body: row.Body, replayed: true}, nil
}

// replayHeaders is the stored subset of header: Content-Type and the
// allow-list, never Set-Cookie.
func (h *HTTP) replayHeaders(header http.Header) http.Header {
	out := http.Header{}
	for _, name := range h.replay {
		if v, ok := header[name]; ok {
			out[name] = v
		}
	}
	return out
}

// jsonOnlyHeaders is json.Marshal of the stored headers of most responses:
// Content-Type, which run sets, alone.
const jsonOnlyHeaders = `{"Content-Type":["application/json"]}`

// jsonbOnlyHeaders is jsonOnlyHeaders as GetKey reads it back from
// idem_keys.headers: a jsonb column, which PostgreSQL prints in its own
// form (a space after each colon and comma), not as it was written.
const jsonbOnlyHeaders = `{"Content-Type": ["application/json"]}`

// encodeHeaders is json.Marshal(header) as a string, the stored form of a
// response's headers, without reflection over the map for the common
// jsonOnlyHeaders.
func encodeHeaders(header http.Header) (string, error) {
	if v := header["Content-Type"]; len(header) == 1 && len(v) == 1 && v[0] == "application/json" {
		return jsonOnlyHeaders, nil
	}
	b, err := json.Marshal(header)
	return string(b), err
}

// problemFor maps an error of serve or of the wrapped function to a response.
func (h *HTTP) problemFor(r *http.Request, ep Endpoint, err error) *Error {
	var e *Error
	switch {
	case errors.As(err, &e) && !e.isFailure():
		// A failure answered as a success (200) or a redirect would tell the
		// client that what was rolled back happened; an invalid code would
		// make net/http panic and drop the connection.
		h.logger.ErrorContext(r.Context(), "function returned an *idem.Error whose status is not 4xx or 5xx", "scope", ep.Scope, "status", e.Status, "err", err)
		return &Error{Status: http.StatusInternalServerError, Err: err}
	case errors.As(err, &e):
		if e.Status >= 500 {
			h.logger.ErrorContext(r.Context(), "idempotent handler failed", "scope", ep.Scope, "status", e.Status, "err", err)
		}
		return e
	case errors.Is(err, errInFlight):
		return &Error{Status: http.StatusConflict, Title: "Request in flight", RetryAfter: time.Second,
			Detail: "a request with this idempotency key is still being processed; retry later"}
	case errors.Is(err, errFingerprint):
		return &Error{Status: http.StatusUnprocessableEntity, Title: "Idempotency key reused",
			Detail: "this idempotency key was used with a different request"}
	case errors.Is(err, errCommitUnknown): // before the context cases: it may wrap ctx's error
		h.logger.ErrorContext(r.Context(), "commit outcome unknown", "scope", ep.Scope, "err", err)
		detail := "the connection to the database broke while committing, so the outcome is unknown; retry with the same idempotency key: a committed request is replayed, not run again"
		if _, keyed := r.Header[http.CanonicalHeaderKey(ep.KeyHeader)]; !keyed {
			detail = "the connection to the database broke while committing, so the outcome is unknown; the request had no idempotency key, so a retry may run it a second time"
		}
		return &Error{Status: http.StatusServiceUnavailable, Title: "Outcome unknown", RetryAfter: time.Second, Err: err, Detail: detail}
	case errors.Is(err, errBusy): // before the context cases: it may wrap the wait's own deadline
		h.failures.log(r.Context(), slog.LevelWarn, "database busy", ep.Scope, err)
		return &Error{Status: http.StatusServiceUnavailable, Title: "Database busy", RetryAfter: time.Second, Err: err,
			Detail: "the database was busy (no connection or a lock within the wait); nothing was done, retry later"}
	case isCtxErr(err) && r.Context().Err() != nil:
		// The request's context ended: the client is gone, or the server is
		// shutting down (ServeHTTP cancels the requests left at the drain
		// deadline through BaseContext; http.Server.Close's closed
		// connections cancel theirs). The transaction rolled back, so a
		// retry is safe. Only then: a context error under a live request
		// is a deadline or cancel of the runtime's or the function's own,
		// and the client is still waiting for the truth (below).
		return &Error{Status: http.StatusServiceUnavailable, Detail: "request cancelled; nothing was done", Err: err}
	case errors.Is(err, errStorage):
		// Also when its cause is a deadline that is not the request's (the
		// pool's connect timeout): the database did not answer.
		h.failures.log(r.Context(), slog.LevelError, "idempotency storage failed", ep.Scope, err)
		return &Error{Status: http.StatusServiceUnavailable, Detail: "storage unavailable; nothing was done, retry later", Err: err, RetryAfter: time.Second}
	case isCtxErr(err):
		// The request alive, the runtime's own context errors classified
		// above: a context of the function's own (its deadline on a call
		// to a third party, a cancel of its own) ended its work, and it
		// returned that error. Its failure, as any other error it returns
		// (the consumer charges it to the record likewise); the function
		// that wants another status (a 504 for an upstream's timeout)
		// returns an *Error.
		h.logger.ErrorContext(r.Context(), "idempotent handler failed", "scope", ep.Scope, "err", err)
		return &Error{Status: http.StatusInternalServerError, Title: "Function's own context ended", Err: err,
			Detail: "a context of the function's own (a deadline or cancellation it set, not the request's) ended its work; the transaction rolled back and nothing was done"}
	default:
		h.logger.ErrorContext(r.Context(), "idempotent handler failed", "scope", ep.Scope, "err", err)
		return &Error{Status: http.StatusInternalServerError, Err: err}
	}
}

// storageErr marks err as a storage failure (503, fail closed), unless it is
// the context's own cancellation, which passes through untouched.
func storageErr(ctx context.Context, doing string, err error) error {
	if ctxErr := ctx.Err(); ctxErr != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
		return ctxErr
	}
	if cerr := cancelledByCtx(ctx, err); cerr != nil {
		return cerr
	}
	return fmt.Errorf("%w: %s: %w", errStorage, doing, err)
}
