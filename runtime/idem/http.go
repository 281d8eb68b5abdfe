package idem

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemgen/idemgen/internal/crash"
	"github.com/idemgen/idemgen/runtime/internal/db"
	"github.com/idemgen/idemgen/runtime/internal/dbx"
)

// Defaults for Endpoint and HTTP fields left zero.
const (
	DefaultKeyHeader    = "Idempotency-Key"
	DefaultTTL          = 24 * time.Hour
	DefaultWait         = 5 * time.Second
	DefaultMaxBodyBytes = 1 << 20
	// MaxKeyLength is the longest Idempotency-Key accepted, in bytes.
	MaxKeyLength = 255
	// NoWait as Endpoint.Wait answers 409 at once when the same key is in
	// flight, instead of waiting for it to finish and replaying its response.
	NoWait time.Duration = -1

	rollbackTimeout = 5 * time.Second
)

// Endpoint describes one //idem:http operation. Generated code fills every
// field from the directive; zero fields take the defaults above.
type Endpoint struct {
	// Scope namespaces keys; generated code uses the function's qualified
	// name, so two operations never share a key.
	Scope string
	// Route is "METHOD /pattern" as given to http.ServeMux; the method is
	// enforced (405 otherwise). Empty accepts any method.
	Route string
	// Status is the status code of a successful response (default 200).
	Status int
	// TTL is how long a completed key is replayed (default 24h). After it a
	// key counts as new.
	TTL time.Duration
	// KeyHeader names the request header carrying the key (default
	// Idempotency-Key).
	KeyHeader string
	// KeyOptional lets a request without the header run, in a transaction,
	// without idempotency. By default a missing key is a 400.
	KeyOptional bool
	// Wait bounds how long a request waits for an in-flight request with the
	// same key before answering 409 with Retry-After; when the first finishes
	// in time the waiter replays its response. Default 5s; NoWait answers 409
	// at once.
	Wait time.Duration
}

// HTTP serves //idem:http endpoints on a Store. Configure it before the first
// request; it is safe for concurrent use afterwards.
type HTTP struct {
	// Store holds the keys and runs the transactions.
	Store *Store
	// Principal returns who is calling, so keys (and stored responses) are
	// scoped per tenant: one principal can never replay another's response.
	// An error is answered with its *Error status, or 401. Nil means a single
	// principal "".
	Principal func(*http.Request) (string, error)
	// MaxBodyBytes limits the request body (default 1 MiB); larger is a 413.
	MaxBodyBytes int64
	// ReplayHeaders lists the response headers that are stored and replayed
	// besides Content-Type (default: Location). Set-Cookie is never stored.
	ReplayHeaders []string
	// TxOptions starts each transaction (default: read committed). Under
	// repeatable read or serializable a duplicate racing a commit may get 409.
	TxOptions pgx.TxOptions
	// Logger receives failures that are not the client's fault (default
	// slog.Default()).
	Logger *slog.Logger
}

// NewHTTP returns an HTTP with default settings on store.
func NewHTTP(store *Store) *HTTP { return &HTTP{Store: store} }

// Handle returns the http.Handler for one //idem:http function. For every
// request with a new key it runs, in one transaction: claim the key, call fn
// with the decoded JSON request, store the response, commit. A repeated key
// with the same request replays the stored response without calling fn.
//
// Generated code calls it; call it by hand to wrap a function without the
// generator.
func Handle[Req, Resp any](h *HTTP, ep Endpoint, fn func(context.Context, pgx.Tx, Req) (Resp, error)) http.Handler {
	ep = ep.withDefaults()
	method, _, _ := strings.Cut(ep.Route, " ")
	if strings.HasPrefix(method, "/") { // a route with no method
		method = ""
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if method != "" && r.Method != method {
			w.Header().Set("Allow", method)
			writeProblem(w, &Error{Status: http.StatusMethodNotAllowed})
			return
		}
		in, perr := h.readRequest(w, r, ep)
		if perr != nil {
			writeProblem(w, perr)
			return
		}
		var req Req
		if perr := decodeJSON(in.body, &req); perr != nil {
			writeProblem(w, perr)
			return
		}
		call := func(ctx context.Context, tx pgx.Tx) (any, error) { return fn(ctx, tx, req) }
		out, err := h.serve(r.Context(), ep, in, call)
		if err != nil {
			writeProblem(w, h.problemFor(r, ep, err))
			return
		}
		out.write(w)
	})
}

func (ep Endpoint) withDefaults() Endpoint {
	if ep.Status == 0 {
		ep.Status = http.StatusOK
	}
	if ep.TTL <= 0 {
		ep.TTL = DefaultTTL
	}
	if ep.KeyHeader == "" {
		ep.KeyHeader = DefaultKeyHeader
	}
	if ep.Wait == 0 {
		ep.Wait = DefaultWait
	}
	return ep
}

// request is what serve needs of an HTTP request, read and validated before
// any database work, so that a bad request stores nothing.
type request struct {
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

// readRequest validates the key, resolves the principal, reads the body under
// the size limit and fingerprints the request.
func (h *HTTP) readRequest(w http.ResponseWriter, r *http.Request, ep Endpoint) (*request, *Error) {
	in := &request{}
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
		principal := ""
		if h.Principal != nil {
			p, err := h.Principal(r)
			if err != nil {
				var e *Error
				if errors.As(err, &e) {
					return nil, e
				}
				return nil, &Error{Status: http.StatusUnauthorized, Detail: err.Error(), Err: err}
			}
			principal = p
		}
		in.key = &Key{Scope: ep.Scope, Principal: principal, Key: key}
	}

	limit := h.MaxBodyBytes
	if limit <= 0 {
		limit = DefaultMaxBodyBytes
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return nil, &Error{Status: http.StatusRequestEntityTooLarge,
				Detail: fmt.Sprintf("request body exceeds %d bytes", limit)}
		}
		return nil, &Error{Status: http.StatusBadRequest, Detail: "reading request body: " + err.Error()}
	}
	in.body = body

	// The fingerprint binds a key to one request: the same key with another
	// method, target or body is a client bug (422), not a retry.
	f := sha256.New()
	fmt.Fprintf(f, "%s\x00%s\x00", r.Method, r.URL.RequestURI())
	f.Write(body)
	in.fingerprint = f.Sum(nil)
	return in, nil
}

// parseKey accepts the key as a bare token (as Stripe and most clients send
// it) or as an RFC 8941 sf-string (as the IETF draft writes it).
func parseKey(values []string) (string, error) {
	if len(values) != 1 {
		return "", errors.New("send exactly one key")
	}
	k := values[0]
	if len(k) >= 2 && k[0] == '"' && k[len(k)-1] == '"' {
		k = k[1 : len(k)-1]
	}
	switch {
	case k == "":
		return "", errors.New("key is empty")
	case len(k) > MaxKeyLength:
		return "", fmt.Errorf("key is %d bytes; at most %d are allowed", len(k), MaxKeyLength)
	}
	for i := 0; i < len(k); i++ {
		if c := k[i]; c < 0x21 || c > 0x7e {
			return "", fmt.Errorf("key has a byte 0x%02x at offset %d; only visible ASCII is allowed", c, i)
		}
	}
	return k, nil
}

// decodeJSON decodes exactly one JSON value into v.
func decodeJSON(body []byte, v any) *Error {
	dec := json.NewDecoder(bytes.NewReader(body))
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
	errInFlight      = errors.New("a request with this key is in flight")
	errFingerprint   = errors.New("key reused with a different request")
	errStorage       = errors.New("idempotency storage unavailable")
	errEncodeFailure = errors.New("encode response")
)

// serve runs one operation. In order, in one transaction:
//
//  1. claim the key (INSERT ... ON CONFLICT). A concurrent duplicate waits on
//     our uncommitted index entry, bounded by ep.Wait;
//  2. if the key was already completed: replay it (or 422 on a different
//     fingerprint), without calling the function;
//  3. call the function with the transaction;
//  4. store the response on the key row;
//  5. commit.
//
// Any failure before the commit rolls everything back: no side effect, no
// stored key, and a retry runs the function again. A cancelled ctx is such a
// failure: it is returned as is and nothing commits.
func (h *HTTP) serve(ctx context.Context, ep Endpoint, in *request, call func(context.Context, pgx.Tx) (any, error)) (*response, error) {
	opts := h.TxOptions
	if in.key != nil {
		opts = dbx.BoundedBegin(opts, ep.Wait) // BEGIN and the claim's wait bound: one round trip
	}
	tx, err := h.Store.pool.BeginTx(ctx, opts)
	if err != nil {
		return nil, storageErr(ctx, "begin", err)
	}
	defer rollback(ctx, tx) // after Commit this is a no-op

	if in.key != nil {
		claimed, row, err := dbx.ClaimKeyRestore(ctx, tx, db.ClaimKeyParams{
			Scope: in.key.Scope, Principal: in.key.Principal, Key: in.key.Key,
			Fingerprint: in.fingerprint, TtlSeconds: ep.TTL.Seconds(),
		})
		if err != nil {
			if isBusy(err) {
				return nil, errInFlight
			}
			return nil, storageErr(ctx, "claim key", err)
		}
		if !claimed {
			return replay(ctx, row, in)
		}
		crash.Point(ctx, "http.after-claim")
		ctx = context.WithValue(ctx, keyCtx{}, *in.key)
	}

	header := http.Header{}
	ctx = context.WithValue(ctx, headerCtx{}, header)
	result, err := call(ctx, tx)
	if err != nil {
		var e *Error
		if !errors.As(err, &e) && tx.Conn().IsClosed() {
			// The function failed because the database connection died under
			// it: a storage failure (503, retry later), not a bug (500).
			return nil, storageErr(ctx, "function's transaction", err)
		}
		return nil, err
	}
	crash.Point(ctx, "http.after-call")
	body, err := json.Marshal(result)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errEncodeFailure, err)
	}
	header.Set("Content-Type", "application/json")
	out := &response{status: ep.Status, header: header, body: body}

	if in.key != nil {
		stored, err := json.Marshal(h.replayHeaders(header))
		if err != nil {
			return nil, fmt.Errorf("%w: headers: %w", errEncodeFailure, err)
		}
		if _, err := db.New(tx).CompleteKey(ctx, db.CompleteKeyParams{
			StatusCode: int32(out.status), Headers: stored, Body: body,
			Scope: in.key.Scope, Principal: in.key.Principal, Key: in.key.Key,
		}); err != nil {
			return nil, storageErr(ctx, "store response", err)
		}
	}
	// A function that ignored cancellation must not commit: the caller (a
	// client that hung up, or shutdown) has been told nothing happened.
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	crash.Point(ctx, "http.before-commit")
	if err := tx.Commit(ctx); err != nil {
		return nil, storageErr(ctx, "commit", err)
	}
	crash.Point(ctx, "http.after-commit")
	return out, nil
}

// replay answers a request whose key is already completed, from the row the
// claim read.
func replay(ctx context.Context, row db.GetKeyRow, in *request) (*response, error) {
	if !bytes.Equal(row.Fingerprint, in.fingerprint) {
		return nil, errFingerprint
	}
	header := http.Header{}
	if err := json.Unmarshal(row.Headers, &header); err != nil {
		return nil, storageErr(ctx, "decode stored headers", err)
	}
	return &response{status: int(row.StatusCode), header: header, body: row.Body, replayed: true}, nil
}

// replayHeaders is the stored subset of header: Content-Type and the
// allow-list, never Set-Cookie.
func (h *HTTP) replayHeaders(header http.Header) http.Header {
	allow := h.ReplayHeaders
	if allow == nil {
		allow = []string{"Location"}
	}
	out := http.Header{}
	for _, name := range append([]string{"Content-Type"}, allow...) {
		name = http.CanonicalHeaderKey(name)
		if v, ok := header[name]; ok && name != "Set-Cookie" {
			out[name] = v
		}
	}
	return out
}

// problemFor maps an error of serve or of the wrapped function to a response.
func (h *HTTP) problemFor(r *http.Request, ep Endpoint, err error) *Error {
	var e *Error
	switch {
	case errors.As(err, &e):
		return e
	case errors.Is(err, errInFlight):
		return &Error{Status: http.StatusConflict, Title: "Request in flight", RetryAfter: time.Second,
			Detail: "a request with this idempotency key is still being processed; retry later"}
	case errors.Is(err, errFingerprint):
		return &Error{Status: http.StatusUnprocessableEntity, Title: "Idempotency key reused",
			Detail: "this idempotency key was used with a different request"}
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		// The client is gone or the server is shutting down; the transaction
		// rolled back, so a retry is safe.
		return &Error{Status: http.StatusServiceUnavailable, Detail: "request cancelled; nothing was done", Err: err}
	case errors.Is(err, errStorage):
		h.logger().ErrorContext(r.Context(), "idempotency storage failed", "scope", ep.Scope, "err", err)
		return &Error{Status: http.StatusServiceUnavailable, Detail: "storage unavailable; nothing was done, retry later", Err: err, RetryAfter: time.Second}
	default:
		h.logger().ErrorContext(r.Context(), "idempotent handler failed", "scope", ep.Scope, "err", err)
		return &Error{Status: http.StatusInternalServerError, Err: err}
	}
}

func (h *HTTP) logger() *slog.Logger {
	if h.Logger != nil {
		return h.Logger
	}
	return slog.Default()
}

// storageErr marks err as a storage failure (503, fail closed), unless it is
// the context's own cancellation, which passes through untouched.
func storageErr(ctx context.Context, doing string, err error) error {
	if ctxErr := ctx.Err(); ctxErr != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
		return ctxErr
	}
	return fmt.Errorf("%w: %s: %w", errStorage, doing, err)
}

// isBusy reports a claim that gave up waiting for a concurrent holder of the
// same key: lock_timeout, or a serialization failure under a stricter
// isolation level.
func isBusy(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "55P03" || pgErr.Code == "40001")
}
