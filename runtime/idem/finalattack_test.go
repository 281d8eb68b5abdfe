package idem_test

import (
	"context"
	"net/http"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// A function that ends the runtime's transaction and chains a new one
// (COMMIT AND CHAIN, ROLLBACK AND CHAIN, or COMMIT then BEGIN) leaves the
// connection in a transaction, so the TxStatus check after the call does
// not see it: the key's advisory lock was released at the end of the first
// transaction, and the response would be stored in another transaction than
// the effect (after ROLLBACK AND CHAIN: a success replayed forever for an
// effect that was rolled back).
func TestFunctionChainingATransactionStoresNothing(t *testing.T) {
	ends := map[string]string{
		"ROLLBACK AND CHAIN": "ROLLBACK AND CHAIN",
		"COMMIT AND CHAIN":   "COMMIT AND CHAIN",
		"ROLLBACK; BEGIN":    "ROLLBACK; BEGIN",
	}
	opts := map[string]pgx.TxOptions{
		"pipelined":               {},
		"custom begin and commit": {BeginQuery: "BEGIN ISOLATION LEVEL READ COMMITTED", CommitQuery: "COMMIT"},
	}
	for name, sql := range ends {
		for oname, o := range opts {
			t.Run(name+"/"+oname, func(t *testing.T) {
				e := newEnv(t)
				e.cfg.TxOptions = o
				e.hook = func(ctx context.Context, tx pgx.Tx, _ chargeReq) error {
					_, err := tx.Exec(ctx, sql)
					return err
				}
				h := e.handler(idem.Endpoint{})
				r := do(h, "k-chain", body1)
				if r.status != http.StatusInternalServerError {
					t.Errorf("answer %d %s, want 500", r.status, r.body)
				}
				// (Under a custom BeginQuery the claim row ClaimKeyRow
				// wrote, already expired, is committed by the function's
				// own COMMIT AND CHAIN: not a response.)
				if n := pgtest.Count(t, e.pool, `SELECT count(*) FROM idem_keys WHERE expires_at > now()`); n != 0 {
					t.Errorf("%d live key rows stored for a function that ended the transaction itself, want 0", n)
				}
				// A retry is not answered by a stored success.
				if r := do(h, "k-chain", body1); r.status != http.StatusInternalServerError {
					t.Errorf("retry: answer %d %s, want 500 again (the function runs again)", r.status, r.body)
				}
			})
		}
	}
}
