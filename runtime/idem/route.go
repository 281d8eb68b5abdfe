package idem

import (
	"fmt"
	"net/http"
	"strings"
)

// HandleRoute registers h on mux for pattern, as mux.Handle does, and makes
// a request for the same path with a method no pattern serves a 405 in
// application/problem+json, with Allow. (http.ServeMux answers that 405
// itself, in text/plain.) Generated RegisterIdemRoutes functions call it.
//
// For a pattern with a method ("POST /payments") it also registers the same
// pattern without the method ("/payments"), which ServeMux prefers only when
// no pattern with a method matches. If that pattern is already registered
// (another method of the same path, or your own handler for it), the one
// registered first stays.
func HandleRoute(mux *http.ServeMux, pattern string, h http.Handler) {
	mux.Handle(pattern, h)
	method, rest, found := strings.Cut(pattern, " ")
	if !found || strings.HasPrefix(method, "/") {
		return // no method: every method is served
	}
	rest = strings.TrimLeft(rest, " \t")
	func() {
		// ServeMux reports a conflicting pattern only by panicking, before
		// it changes anything: the path is served already.
		defer func() { _ = recover() }()
		mux.Handle(rest, methodNotAllowed{mux: mux, pattern: rest})
	}()
}

// methodNotAllowed answers every method that reaches the method-less
// fallback pattern of HandleRoute.
type methodNotAllowed struct {
	mux     *http.ServeMux
	pattern string
}

// probeMethods are the methods Allow is computed from.
var probeMethods = []string{http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut,
	http.MethodPatch, http.MethodDelete, http.MethodOptions}

func (m methodNotAllowed) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// Allow lists the methods another pattern serves for this request, as
	// ServeMux computes it.
	var allow []string
	for _, method := range probeMethods {
		probe := r.Clone(r.Context())
		probe.Method = method
		h, p := m.mux.Handler(probe)
		if e, ok := h.(endpointHandler); ok && e.method != "" && e.method != method {
			continue // a GET endpoint that ServeMux would give HEAD refuses it
		}
		if p != "" && p != m.pattern {
			allow = append(allow, method)
		}
	}
	w.Header().Set("Allow", strings.Join(allow, ", "))
	writeProblem(w, &Error{Status: http.StatusMethodNotAllowed,
		Detail: fmt.Sprintf("%s does not accept %s; use %s", r.URL.Path, r.Method, strings.Join(allow, " or "))})
}
