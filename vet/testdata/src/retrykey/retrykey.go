package retrykey

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/google/uuid"
	"github.com/idemgen/idemgen/runtime/idem"
)

var client = &http.Client{}

// The seed's mistake: each attempt is a new request with no key.
func chargeNoKey(ctx context.Context, body []byte) error {
	for attempt := 0; attempt < 3; attempt++ {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://pay/charge", bytes.NewReader(body))
		if err != nil {
			return err
		}
		resp, err := client.Do(req) // want `retry loop sends POST without an Idempotency-Key header: if a response is lost the retry runs the operation again \(double charge\); create a key once before the loop`
		if err == nil {
			resp.Body.Close()
			return nil
		}
		time.Sleep(500 * time.Millisecond)
	}
	return fmt.Errorf("charge failed")
}

// http.Post cannot carry a key at all.
func chargePost(body []byte) error {
	for range 3 {
		resp, err := http.Post("http://pay/charge", "application/json", bytes.NewReader(body)) // want `retry loop sends POST with http Post, which cannot carry an Idempotency-Key`
		if err != nil {
			continue
		}
		resp.Body.Close()
		return nil
	}
	return fmt.Errorf("charge failed")
}

// A key made per attempt is as bad as none. Fixed by moving the statement.
func chargeKeyPerAttempt(ctx context.Context, body []byte) error {
	for attempt := 0; attempt < 3; attempt++ {
		key := uuid.NewString()
		req, _ := http.NewRequestWithContext(ctx, "PUT", "http://pay/charge", bytes.NewReader(body))
		req.Header.Set("Idempotency-Key", key) // want `retry loop creates the Idempotency-Key of its PUT inside the loop`
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			return nil
		}
	}
	return fmt.Errorf("charge failed")
}

// The same, inline. Fixed by naming the expression above the loop.
func chargeKeyInline(ctx context.Context, body []byte) error {
	for attempt := 0; attempt < 3; attempt++ {
		req, _ := http.NewRequestWithContext(ctx, "PATCH", "http://pay/charge", bytes.NewReader(body))
		req.Header.Set("Idempotency-Key", "pay-"+uuid.NewString()) // want `retry loop creates the Idempotency-Key of its PATCH inside the loop`
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			return nil
		}
	}
	return fmt.Errorf("charge failed")
}

// A key made of the attempt number changes each attempt too; no mechanical fix.
func chargeKeyFromAttempt(ctx context.Context, orderID string, body []byte) error {
	for attempt := 0; attempt < 3; attempt++ {
		req, _ := http.NewRequestWithContext(ctx, "DELETE", "http://pay/charge", bytes.NewReader(body))
		req.Header.Set("Idempotency-Key", fmt.Sprintf("%s-%d", orderID, attempt)) // want `retry loop creates the Idempotency-Key of its DELETE inside the loop`
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			return nil
		}
	}
	return fmt.Errorf("charge failed")
}

// Silenced deliberately.
func chargeIgnored(ctx context.Context, body []byte) error {
	for {
		req, _ := http.NewRequestWithContext(ctx, "POST", "http://pay/charge", bytes.NewReader(body))
		//idemvet:ignore retrykey the provider deduplicates by order id in the body
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			return nil
		}
		time.Sleep(time.Second)
	}
}

// True negatives.

// The seed's correct version: the key is created once, before the loop.
func chargeStableKey(ctx context.Context, body []byte) error {
	key := uuid.NewString()
	for attempt := 0; attempt < 3; attempt++ {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://pay/charge", bytes.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Idempotency-Key", key)
		resp, err := client.Do(req)
		if err == nil {
			resp.Body.Close()
			return nil
		}
		time.Sleep(500 * time.Millisecond)
	}
	return fmt.Errorf("charge failed")
}

// A key derived from the operation, inside the loop, is stable.
func chargeDerivedKey(ctx context.Context, orderID string, body []byte) error {
	for attempt := 0; attempt < 3; attempt++ {
		key := "order-" + orderID
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://pay/charge", bytes.NewReader(body))
		req.Header.Set("Idempotency-Key", key)
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			return nil
		}
		time.Sleep(time.Second)
	}
	return fmt.Errorf("charge failed")
}

// One new operation per item: a fresh key each is right, and no key is not
// a retry problem.
func chargeEach(ctx context.Context, orders []string) {
	for _, o := range orders {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://pay/charge/"+o, nil)
		req.Header.Set("Idempotency-Key", uuid.NewString())
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
		}
	}
}

// GET is safe to retry.
func poll(ctx context.Context) {
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://pay/status", nil)
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			return
		}
		time.Sleep(time.Second)
	}
}

// A loop that does not retry (no wait, no continue, no attempt counter).
func drain(ctx context.Context, next func() ([]byte, bool)) {
	for {
		body, ok := next()
		if !ok {
			return
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://pay/ingest", bytes.NewReader(body))
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
		}
	}
}

// A RoundTripper retried without a key is the same mistake.
func roundTrip(ctx context.Context, rt http.RoundTripper) error {
	for attempt := 0; attempt < 3; attempt++ {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://pay/charge", nil)
		if resp, err := rt.RoundTrip(req); err == nil { // want `retry loop sends POST without an Idempotency-Key header`
			return resp.Body.Close()
		}
	}
	return fmt.Errorf("charge failed")
}

// A request for idem's client (idem.NewClient): the client sets a key derived
// from the operation on every attempt, so a loop around it is not reported.
func idemClient(ctx context.Context, provider *http.Client) error {
	cctx := idem.WithCallName(ctx, "provider.charge")
	for attempt := 0; attempt < 3; attempt++ {
		req, _ := http.NewRequestWithContext(cctx, http.MethodPost, "http://pay/charge", nil)
		if resp, err := provider.Do(req); err == nil {
			return resp.Body.Close()
		}
		time.Sleep(time.Second)
	}
	return fmt.Errorf("charge failed")
}
