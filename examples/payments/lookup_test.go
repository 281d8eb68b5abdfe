package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/idemgen/idemgen/internal/pgtest"
)

// GET /orders/{order}/charges binds the order from the path, needs no body
// and no key; with a key, a retry replays the first answer, and the same key
// for another order is a 422.
func TestOrderChargesRoute(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	if err := createTables(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	mux, err := newMux(pool)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mux)
	defer srv.Close()
	get := func(path, key string) (int, OrderCharges, http.Header) {
		t.Helper()
		req, err := http.NewRequest(http.MethodGet, srv.URL+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		var out OrderCharges
		if resp.StatusCode == http.StatusOK {
			if err := json.Unmarshal(body, &out); err != nil {
				t.Fatalf("%s: %v", body, err)
			}
		}
		return resp.StatusCode, out, resp.Header
	}
	pgtest.Exec(t, pool, `INSERT INTO charges (order_id, amount, currency, provider_key) VALUES ('o-1', 100, 'EUR', 'pk-1')`)

	if code, out, _ := get("/orders/o-1/charges", ""); code != http.StatusOK || out != (OrderCharges{OrderID: "o-1", Charges: 1}) {
		t.Fatalf("without a key: %d %+v", code, out)
	}
	if code, out, _ := get("/orders/o-1/charges", "look-1"); code != http.StatusOK || out.Charges != 1 {
		t.Fatalf("with a key: %d %+v", code, out)
	}
	pgtest.Exec(t, pool, `INSERT INTO charges (order_id, amount, currency, provider_key) VALUES ('o-1', 100, 'EUR', 'pk-2')`)
	if code, out, h := get("/orders/o-1/charges", "look-1"); code != http.StatusOK || out.Charges != 1 || h.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry with the key: %d %+v replayed=%q, want the first answer replayed", code, out, h.Get("Idempotent-Replayed"))
	}
	if code, _, _ := get("/orders/o-2/charges", "look-1"); code != http.StatusUnprocessableEntity {
		t.Fatalf("the key for another order: %d, want 422", code)
	}
	if code, out, _ := get("/orders/o-1/charges", ""); code != http.StatusOK || out.Charges != 2 {
		t.Fatalf("without a key, after the second charge: %d %+v", code, out)
	}
}
