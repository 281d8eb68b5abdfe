// Service-shaped retry loops found by review (vetfix): each EXPECT is a
// finding, each NOEXPECT a pattern that must stay silent.
package retrykeyservice

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/google/uuid"
)

var client = &http.Client{}

// R1 EXPECT: range-int retry, key per attempt.
func r1(ctx context.Context, body []byte) error {
	for attempt := range 3 {
		_ = attempt
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://p/c", bytes.NewReader(body))
		req.Header.Set("Idempotency-Key", uuid.NewString()) // want `retry loop creates the Idempotency-Key of its POST inside the loop`
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			return nil
		}
	}
	return errors.New("x")
}

// R2 EXPECT: for {} with break, no key, counter incremented in body.
func r2(ctx context.Context, body []byte) error {
	tries := 0
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://p/c", bytes.NewReader(body))
		resp, err := client.Do(req) // want `retry loop sends POST without an Idempotency-Key header`
		if err == nil {
			resp.Body.Close()
			break
		}
		tries++
		if tries > 3 {
			return err
		}
	}
	return nil
}

// R3 EXPECT: goto retry, no key.
func r3(ctx context.Context, body []byte) error {
	attempt := 0
retry:
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://p/c", bytes.NewReader(body))
	resp, err := client.Do(req) // want `retry loop sends POST without an Idempotency-Key header`
	if err != nil {
		attempt++
		if attempt < 3 {
			time.Sleep(time.Second)
			goto retry
		}
		return err
	}
	return resp.Body.Close()
}

// retryDo is a retry helper, like avast/retry-go's retry.Do.
func retryDo(fn func() error, attempts int) error {
	var err error
	for range attempts {
		if err = fn(); err == nil {
			return nil
		}
	}
	return err
}

// R4 EXPECT: retry helper with closure, key made in closure.
func r4(ctx context.Context, body []byte) error {
	return retryDo(func() error {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://p/c", bytes.NewReader(body))
		req.Header.Set("Idempotency-Key", uuid.NewString()) // want `retry loop creates the Idempotency-Key of its POST inside the loop`
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		return resp.Body.Close()
	}, 3)
}

// R4b NOEXPECT: closure with key created outside.
func r4b(ctx context.Context, body []byte) error {
	key := uuid.NewString()
	return retryDo(func() error {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://p/c", bytes.NewReader(body))
		req.Header.Set("Idempotency-Key", key)
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		return resp.Body.Close()
	}, 3)
}

type op struct{ key string }

// R5 NOEXPECT: key in struct field, created once.
func r5(ctx context.Context, o *op, body []byte) error {
	for attempt := 0; attempt < 3; attempt++ {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://p/c", bytes.NewReader(body))
		req.Header.Set("Idempotency-Key", o.key)
		if resp, err := client.Do(req); err == nil {
			return resp.Body.Close()
		}
		time.Sleep(time.Second)
	}
	return errors.New("x")
}

// R5b EXPECT: struct field reassigned per attempt.
func r5b(ctx context.Context, o *op, body []byte) error {
	for attempt := 0; attempt < 3; attempt++ {
		o.key = uuid.NewString()
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://p/c", bytes.NewReader(body))
		req.Header.Set("Idempotency-Key", o.key) // want `retry loop assigns a new value to the Idempotency-Key of its POST inside the loop`
		if resp, err := client.Do(req); err == nil {
			return resp.Body.Close()
		}
		time.Sleep(time.Second)
	}
	return errors.New("x")
}

// R6 EXPECT: created before the loop, reassigned in it under a condition.
func r6(ctx context.Context, body []byte) error {
	key := uuid.New()
	for attempt := 0; attempt < 3; attempt++ {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://p/c", bytes.NewReader(body))
		req.Header.Set("Idempotency-Key", key.String()) // want `retry loop assigns a new value to the Idempotency-Key of its POST inside the loop`
		resp, err := client.Do(req)
		if err == nil && resp.StatusCode < 500 {
			return resp.Body.Close()
		}
		if err != nil {
			key = uuid.New()
		}
	}
	return errors.New("x")
}

// R6b NOEXPECT: lazy init in the loop is stable.
func r6b(ctx context.Context, body []byte) error {
	var key string
	for attempt := 0; attempt < 3; attempt++ {
		if key == "" {
			key = uuid.NewString()
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://p/c", bytes.NewReader(body))
		req.Header.Set("Idempotency-Key", key)
		if resp, err := client.Do(req); err == nil {
			return resp.Body.Close()
		}
	}
	return errors.New("x")
}

// R7 EXPECT(body): request built outside and reused; body consumed after the first attempt.
func r7(ctx context.Context, body []byte) error {
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://p/c", bytes.NewReader(body))
	req.Header.Set("Idempotency-Key", uuid.NewString())
	for attempt := 0; attempt < 3; attempt++ {
		if resp, err := client.Do(req); err == nil { // want `retry loop sends the same POST request, built before the loop, on every attempt: the first attempt consumes its body`
			return resp.Body.Close()
		}
		time.Sleep(time.Second)
	}
	return errors.New("x")
}

// R8 EXPECT: method variable.
func r8(ctx context.Context, body []byte) error {
	method := http.MethodPost
	for attempt := 0; attempt < 3; attempt++ {
		req, _ := http.NewRequestWithContext(ctx, method, "http://p/c", bytes.NewReader(body))
		if resp, err := client.Do(req); err == nil { // want `retry loop sends POST without an Idempotency-Key header`
			return resp.Body.Close()
		}
	}
	return errors.New("x")
}

// R9 EXPECT: lowercase header, key per attempt.
func r9(ctx context.Context, body []byte) error {
	for attempt := 0; attempt < 3; attempt++ {
		req, _ := http.NewRequest("POST", "http://p/c", bytes.NewReader(body))
		req.Header.Set("idempotency-key", uuid.NewString()) // want `retry loop creates the Idempotency-Key of its POST inside the loop`
		if resp, err := client.Do(req); err == nil {
			return resp.Body.Close()
		}
	}
	return errors.New("x")
}

// R10 EXPECT: map assignment, key per attempt.
func r10(ctx context.Context, body []byte) error {
	for attempt := 0; attempt < 3; attempt++ {
		req, _ := http.NewRequest("POST", "http://p/c", bytes.NewReader(body))
		req.Header["Idempotency-Key"] = []string{uuid.NewString()} // want `retry loop creates the Idempotency-Key of its POST inside the loop`
		if resp, err := client.Do(req); err == nil {
			return resp.Body.Close()
		}
	}
	return errors.New("x")
}

// R10b NOEXPECT: map assignment, stable key.
func r10b(ctx context.Context, key string, body []byte) error {
	for attempt := 0; attempt < 3; attempt++ {
		req, _ := http.NewRequest("POST", "http://p/c", bytes.NewReader(body))
		req.Header["Idempotency-Key"] = []string{key}
		if resp, err := client.Do(req); err == nil {
			return resp.Body.Close()
		}
	}
	return errors.New("x")
}

// R11 NOEXPECT: event loop with continue, each round a different event.
func r11(ctx context.Context, events <-chan []byte) {
	for {
		body, ok := <-events
		if !ok {
			return
		}
		if len(body) == 0 {
			continue
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://p/ingest", bytes.NewReader(body))
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
		}
	}
}

// R12 EXPECT: backoff-style loop with a local backoff variable.
func r12(ctx context.Context, body []byte) error {
	delay := 100 * time.Millisecond
	for i := 0; i < 5; i++ {
		req, _ := http.NewRequestWithContext(ctx, "POST", "http://p/c", bytes.NewReader(body))
		req.Header.Set("Idempotency-Key", fmt.Sprint(time.Now().UnixNano())) // want `retry loop creates the Idempotency-Key of its POST inside the loop`
		if resp, err := client.Do(req); err == nil {
			return resp.Body.Close()
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(delay):
		}
		delay *= 2
	}
	return errors.New("x")
}

// R13 EXPECT: cenkalti/backoff's shape, the operation in a variable.
func r13(ctx context.Context, body []byte) error {
	op := func() error {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPut, "http://p/c", bytes.NewReader(body))
		req.Header.Set("Idempotency-Key", uuid.NewString()) // want `retry loop creates the Idempotency-Key of its PUT inside the loop`
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		return resp.Body.Close()
	}
	return retryDo(op, 3)
}

// R14 NOEXPECT: a closure handed to something that is not a retry helper.
func r14(ctx context.Context, body []byte) error {
	run := func(fn func() error) error { return fn() }
	return run(func() error {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://p/c", bytes.NewReader(body))
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		return resp.Body.Close()
	})
}

// R15 EXPECT: a labeled loop; the fix keeps the label on the loop.
func r15(ctx context.Context, body []byte) error {
retry:
	for attempt := 0; attempt < 3; attempt++ {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://p/c", bytes.NewReader(body))
		req.Header.Set("Idempotency-Key", uuid.NewString()) // want `retry loop creates the Idempotency-Key of its POST inside the loop`
		resp, err := client.Do(req)
		if err != nil {
			continue retry
		}
		return resp.Body.Close()
	}
	return errors.New("x")
}

// R16 NOEXPECT: a request built before the loop without a body may be resent.
func r16(ctx context.Context, key string) error {
	req, _ := http.NewRequestWithContext(ctx, http.MethodDelete, "http://p/c/1", nil)
	req.Header.Set("Idempotency-Key", key)
	for attempt := 0; attempt < 3; attempt++ {
		if resp, err := client.Do(req); err == nil {
			return resp.Body.Close()
		}
		time.Sleep(time.Second)
	}
	return errors.New("x")
}

// R17 NOEXPECT: a method variable assigned twice cannot be judged.
func r17(ctx context.Context, safe bool) error {
	method := http.MethodPost
	if safe {
		method = http.MethodGet
	}
	for attempt := 0; attempt < 3; attempt++ {
		req, _ := http.NewRequestWithContext(ctx, method, "http://p/c", nil)
		if resp, err := client.Do(req); err == nil {
			return resp.Body.Close()
		}
	}
	return errors.New("x")
}

// R18 EXPECT: a goto loop making a key per attempt; no mechanical fix.
func r18(ctx context.Context, body []byte) error {
	attempt := 0
again:
	key := uuid.NewString()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://p/c", bytes.NewReader(body))
	req.Header.Set("Idempotency-Key", key) // want `retry loop creates the Idempotency-Key of its POST inside the loop`
	resp, err := client.Do(req)
	if err != nil {
		if attempt++; attempt < 3 {
			goto again
		}
		return err
	}
	return resp.Body.Close()
}

// R19 NOEXPECT: a label jumped to forward is not a loop.
func r19(ctx context.Context, body []byte) error {
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://p/c", bytes.NewReader(body))
	if len(body) == 0 {
		goto done
	}
	if resp, err := client.Do(req); err == nil {
		resp.Body.Close()
	}
done:
	return nil
}

// R20 EXPECT x2: two requests, each with a key per attempt. No fix: one
// hoisted name for both would make the second a replay of the first.
func r20(ctx context.Context) error {
	for attempt := 0; attempt < 3; attempt++ {
		a, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://p/a", nil)
		a.Header.Set("Idempotency-Key", uuid.NewString()) // want `retry loop creates the Idempotency-Key of its POST inside the loop`
		b, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://p/b", nil)
		b.Header.Set("Idempotency-Key", uuid.NewString()) // want `retry loop creates the Idempotency-Key of its POST inside the loop`
		ra, err := client.Do(a)
		if err != nil {
			continue
		}
		ra.Body.Close()
		rb, err := client.Do(b)
		if err != nil {
			continue
		}
		return rb.Body.Close()
	}
	return errors.New("x")
}

// R21 NOEXPECT: built before the loop, rebuilt in it for the next attempt.
func r21(ctx context.Context, key string, body []byte) error {
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://p/c", bytes.NewReader(body))
	for attempt := 0; attempt < 3; attempt++ {
		req.Header.Set("Idempotency-Key", key)
		resp, err := client.Do(req)
		if err == nil {
			return resp.Body.Close()
		}
		time.Sleep(time.Second)
		req, _ = http.NewRequestWithContext(ctx, http.MethodPost, "http://p/c", bytes.NewReader(body))
	}
	return errors.New("x")
}
