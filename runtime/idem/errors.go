package idem

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"
)

// Error is an error with an HTTP status. A function wrapped by //idem:http
// returns one to choose the status of its failure response; the transaction is
// rolled back and nothing is stored, so the same key may be retried.
type Error struct {
	// Status is the HTTP status code of the response: a 4xx or 5xx. Any
	// other value is answered as a 500 (and logged): a rolled-back failure
	// must never look like a success or a redirect.
	Status int
	// Title is a short, human-readable summary; it defaults to the status text.
	Title string
	// Detail explains this occurrence; it is sent to the client.
	Detail string
	// Err is the underlying cause; it is logged, never sent.
	Err error
	// RetryAfter, when positive, is sent as the Retry-After header (seconds).
	RetryAfter time.Duration
}

// Errorf returns an *Error with the given status and a formatted detail.
// A %w verb in format sets Err as with fmt.Errorf.
func Errorf(status int, format string, args ...any) error {
	wrapped := fmt.Errorf(format, args...)
	return &Error{Status: status, Detail: wrapped.Error(), Err: errors.Unwrap(wrapped)}
}

func (e *Error) Error() string {
	msg := strconv.Itoa(e.Status) + " " + e.title()
	if e.Detail != "" {
		msg += ": " + e.Detail
	}
	return msg
}

// Unwrap returns the underlying cause.
func (e *Error) Unwrap() error { return e.Err }

// isFailure reports whether e's status is a 4xx or 5xx: the only statuses a
// failure, whose transaction rolled back, may be answered with.
func (e *Error) isFailure() bool { return e.Status >= 400 && e.Status <= 599 }

func (e *Error) title() string {
	if e.Title != "" {
		return e.Title
	}
	return http.StatusText(e.Status)
}

// problem is an RFC 9457 problem details object.
type problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
}

// writeProblem writes e as application/problem+json.
func writeProblem(w http.ResponseWriter, e *Error) {
	body, _ := json.Marshal(problem{Type: "about:blank", Title: e.title(), Status: e.Status, Detail: e.Detail})
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	if e.RetryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(int((e.RetryAfter+time.Second-1)/time.Second)))
	}
	w.WriteHeader(e.Status)
	_, _ = w.Write(body)
}
