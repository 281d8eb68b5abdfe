// Package provider is the payment provider the payments example charges:
// another company's service, as far as the payments service knows. It is a
// separate HTTP server with its own tables (provider_*, see schema.sql) that
// applies a charge once per Idempotency-Key, as Stripe does, and counts every
// raw call it receives, so the example can show the seed's double
// protection: however often the service retried or was killed, the provider
// received calls ≥ charges applied = 1 per order.
//
// POST /charges with an Idempotency-Key header and a JSON ChargeRequest
// answers 201 and the Charge the first time, and 200 with the same Charge
// and Idempotent-Replayed: true for every later call with that key. The same
// key with a different charge is 422; no key is 400.
package provider

import (
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/examples/payments/provider/providerdb"
	"github.com/idemgen/idemgen/internal/crash"
)

//go:embed schema.sql
var schema string

// ChargeRequest is the body of POST /charges.
type ChargeRequest struct {
	OrderID  string `json:"order_id"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
}

// Charge is a charge the provider applied: the answer to POST /charges.
type Charge struct {
	ID             int64     `json:"id"`
	IdempotencyKey string    `json:"idempotency_key"`
	OrderID        string    `json:"order_id"`
	Amount         int64     `json:"amount"`
	Currency       string    `json:"currency"`
	CreatedAt      time.Time `json:"created_at"`
}

// Migrate creates the provider's tables if they do not exist.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("create provider tables: acquire: %w", err)
	}
	defer conn.Release()
	if _, err := conn.Conn().PgConn().Exec(ctx, schema).ReadAll(); err != nil {
		return fmt.Errorf("create provider tables: %w", err)
	}
	return nil
}

// Server is the provider's HTTP side and its storage.
type Server struct {
	pool   *pgxpool.Pool
	logger *slog.Logger

	mu   sync.Mutex
	lose map[string]bool // orders whose next applied charge loses its response
}

// New returns a provider storing in pool's provider_* tables (see Migrate).
func New(pool *pgxpool.Pool, logger *slog.Logger) *Server {
	if logger == nil {
		logger = slog.Default()
	}
	return &Server{pool: pool, logger: logger, lose: map[string]bool{}}
}

// Handler serves POST /charges.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", s.charge)
	return mux
}

// Counts returns how many calls the provider received for an order and how
// many charges it applied for it.
func (s *Server) Counts(ctx context.Context, orderID string) (calls, charges int64, err error) {
	q := providerdb.New(s.pool)
	if calls, err = q.CountCalls(ctx, orderID); err != nil {
		return 0, 0, fmt.Errorf("count provider calls for %s: %w", orderID, err)
	}
	if charges, err = q.CountCharges(ctx, orderID); err != nil {
		return 0, 0, fmt.Errorf("count provider charges for %s: %w", orderID, err)
	}
	return calls, charges, nil
}

// LoseNextResponse makes the next call that applies a charge for orderID
// drop its connection after the charge committed, without answering: the
// network losing the response, the case the seed's retry loop gets wrong.
func (s *Server) LoseNextResponse(orderID string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lose[orderID] = true
}

func (s *Server) takeLose(orderID string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	lose := s.lose[orderID]
	delete(s.lose, orderID)
	return lose
}

func (s *Server) charge(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	var req ChargeRequest
	raw, err := io.ReadAll(io.LimitReader(r.Body, 64<<10))
	if err != nil {
		answer(w, http.StatusBadRequest, map[string]string{"error": "body: " + err.Error()})
		return
	}
	// Checked on the raw bytes: encoding/json would turn invalid UTF-8 into
	// U+FFFD and charge an order id the caller never sent.
	if !utf8.Valid(raw) {
		answer(w, http.StatusBadRequest, map[string]string{"error": "body: not valid UTF-8"})
		return
	}
	if err := json.Unmarshal(raw, &req); err != nil {
		answer(w, http.StatusBadRequest, map[string]string{"error": "body: " + err.Error()})
		return
	}
	key := r.Header.Get("Idempotency-Key")
	if !storable(req.OrderID) || !storable(req.Currency) || !visibleASCII(key) {
		// Bytes PostgreSQL refuses (NUL, invalid UTF-8) are the caller's
		// mistake, not an outage: 400, and not counted, since they cannot be
		// stored.
		answer(w, http.StatusBadRequest, map[string]string{"error": "order_id and currency must be UTF-8 without NUL, the Idempotency-Key visible ASCII"})
		return
	}
	q := providerdb.New(s.pool)
	// Counted first and committed on its own: a retry, a replay, a refused
	// or a failed call is still a call.
	if err := q.RecordCall(ctx, providerdb.RecordCallParams{IdempotencyKey: key, OrderID: req.OrderID}); err != nil {
		s.unavailable(w, r, "record call", err)
		return
	}
	switch {
	case key == "" || len(key) > 255:
		answer(w, http.StatusBadRequest, map[string]string{"error": "an Idempotency-Key of 1-255 bytes is required"})
		return
	case req.OrderID == "" || req.Amount <= 0 || len(req.Currency) != 3:
		answer(w, http.StatusUnprocessableEntity, map[string]string{"error": "order_id, a positive amount and a 3-letter currency are required"})
		return
	}
	row, err := q.ApplyCharge(ctx, providerdb.ApplyChargeParams{
		IdempotencyKey: key, OrderID: req.OrderID, Amount: req.Amount, Currency: req.Currency,
	})
	applied := err == nil
	if errors.Is(err, pgx.ErrNoRows) { // the key was used before: replay
		row, err = q.GetCharge(ctx, key)
	}
	if err != nil {
		s.unavailable(w, r, "apply charge", err)
		return
	}
	if !applied && (row.OrderID != req.OrderID || row.Amount != req.Amount || row.Currency != req.Currency) {
		answer(w, http.StatusUnprocessableEntity, map[string]string{"error": "Idempotency-Key already used for a different charge"})
		return
	}
	ch := Charge{ID: row.ID, IdempotencyKey: row.IdempotencyKey, OrderID: row.OrderID,
		Amount: row.Amount, Currency: row.Currency, CreatedAt: row.CreatedAt.Time}
	if applied {
		// The charge is committed and the caller does not know yet: a
		// provider dying here, or a response lost on the way, is what makes
		// a retry without the same key charge twice.
		crash.Point(ctx, "provider.after-apply")
		if s.takeLose(req.OrderID) {
			if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
				conn.Close()
				return
			}
		}
		answer(w, http.StatusCreated, ch)
		return
	}
	w.Header().Set("Idempotent-Replayed", "true")
	answer(w, http.StatusOK, ch)
}

// storable reports whether PostgreSQL accepts s as text.
func storable(s string) bool {
	return utf8.ValidString(s) && !strings.ContainsRune(s, 0)
}

// visibleASCII reports whether s has only visible ASCII bytes, as an
// Idempotency-Key must.
func visibleASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

func (s *Server) unavailable(w http.ResponseWriter, r *http.Request, what string, err error) {
	s.logger.ErrorContext(r.Context(), "provider: "+what, "err", err)
	w.Header().Set("Retry-After", "1")
	answer(w, http.StatusServiceUnavailable, map[string]string{"error": "storage unavailable"})
}

func answer(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
