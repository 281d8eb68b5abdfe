package idem

import (
	"crypto/sha256"
	"encoding"
	"fmt"
	"net/http"
	"net/url"
	"reflect"
	"runtime/debug"
	"strconv"
	"strings"
)

// Request binding: fields of a request struct tagged path:"name",
// query:"name" or header:"Name" take their value from the route's wildcard,
// the URL's query or a request header; every other field comes from the JSON
// body, as before. Handle builds one binder per endpoint at start-up, by
// reflection over the struct tags (the generator checks the same rules at
// generation time, with positions), so generated code stays one Handle call.

// Binding sources, as written in struct tags.
const (
	bindPath   = "path"
	bindQuery  = "query"
	bindHeader = "header"
)

var bindSources = []string{bindPath, bindQuery, bindHeader}

// binder sets the bound fields of one request type.
type binder struct {
	fields []boundField
}

// boundField is one tagged field.
type boundField struct {
	index  int
	source string // bindPath, bindQuery or bindHeader
	name   string // wildcard, query parameter or canonical header name
	slice  bool   // repeated values (query and header only)
	conv   converter
	// zero is the canonical text of the field's zero value, which an
	// absent or empty value gives the function: so that X-Version: 0 and
	// no X-Version header, which the function cannot tell apart, are the
	// same request. hasZero is false when it is unknown (a TextUnmarshaler
	// without MarshalText, or whose MarshalText fails on its zero value).
	zero    string
	hasZero bool
}

// converter parses one value into v (settable, of the field's element type)
// and returns its canonical text for the fingerprint.
type converter func(s string, v reflect.Value) (canonical string, err error)

var textUnmarshalerType = reflect.TypeFor[encoding.TextUnmarshaler]()

// newBinder reads the binding tags of t (the request type). route is the
// endpoint's pattern ("" if unknown): every path field must name one of its
// wildcards. A type with no binding tags gets an empty binder.
func newBinder(t reflect.Type, route string) (*binder, error) {
	b := &binder{}
	st := t
	if st.Kind() == reflect.Pointer {
		st = st.Elem()
	}
	if st.Kind() != reflect.Struct {
		return b, nil
	}
	var wildcards map[string]bool
	if route != "" {
		wildcards = map[string]bool{}
		for _, w := range RouteWildcards(route) {
			wildcards[w] = true
		}
	}
	seen := map[string]string{}
	for i := range st.NumField() {
		f := st.Field(i)
		source, name, ok, err := BindingTag(f.Tag)
		if err != nil {
			return nil, fmt.Errorf("field %s %w", f.Name, err)
		}
		if !ok {
			if f.Anonymous && embedsBinding(f.Type, 0) {
				return nil, fmt.Errorf("embedded field %s has fields with binding tags, which are read only on the request type's own fields: move them up", f.Name)
			}
			continue
		}
		if t.Kind() == reflect.Pointer {
			return nil, fmt.Errorf("field %s is bound from the %s, but the request type is a pointer: use the struct type %s", f.Name, source, st)
		}
		if !f.IsExported() {
			return nil, fmt.Errorf("field %s is bound from the %s but unexported, so it cannot be set: export it", f.Name, source)
		}
		if source == bindHeader {
			name = http.CanonicalHeaderKey(name)
		}
		id := source + " " + name
		if prev, dup := seen[id]; dup {
			return nil, fmt.Errorf("fields %s and %s are both bound to %s %q", prev, f.Name, source, name)
		}
		seen[id] = f.Name
		if source == bindPath && wildcards != nil && !wildcards[name] {
			return nil, fmt.Errorf("field %s is bound to path wildcard %q, which route %q does not have", f.Name, name, route)
		}
		ft, slice := f.Type, false
		if ft.Kind() == reflect.Slice && !implementsText(ft) {
			if source == bindPath {
				return nil, fmt.Errorf("field %s: a path wildcard holds one value; use a single-valued type, not %s", f.Name, ft)
			}
			ft, slice = ft.Elem(), true
		}
		conv := converterFor(ft)
		if conv == nil {
			return nil, fmt.Errorf("field %s has type %s, which %s binding does not support (%s)", f.Name, f.Type, source, SupportedBindingTypes)
		}
		bf := boundField{index: i, source: source, name: name, slice: slice, conv: conv}
		if !slice {
			bf.zero, bf.hasZero = zeroCanonical(ft)
		}
		b.fields = append(b.fields, bf)
	}
	return b, nil
}

// SupportedBindingTypes describes the field types path, query and header
// binding accepts, for error messages.
const SupportedBindingTypes = "string, bool, integer types, types whose pointer implements encoding.TextUnmarshaler, and for query and header fields slices of those"

// BindingTag returns the binding source and name of a struct tag: ok is
// false for a field without path, query or header tag. A field may have one
// binding tag, with a non-empty name; an error is a phrase that follows the
// field's name ("field X has ..."). The generator uses it too, so both
// read tags alike.
func BindingTag(tag reflect.StructTag) (source, name string, ok bool, err error) {
	for _, s := range bindSources {
		v, has := tag.Lookup(s)
		if !has {
			continue
		}
		if ok {
			return "", "", false, fmt.Errorf("has both %s and %s tags; bind a field from one source", source, s)
		}
		if v == "" || strings.ContainsAny(v, ",") {
			return "", "", false, fmt.Errorf("has %s tag %q; want exactly one name, like %s:\"id\"", s, v, s)
		}
		source, name, ok = s, v, true
	}
	return source, name, ok, nil
}

// RouteWildcards returns the wildcard names of an http.ServeMux pattern
// ("POST /orders/{id}/items/{rest...}": id, rest), in order; {$} is not a
// wildcard.
func RouteWildcards(route string) []string {
	_, path, found := strings.Cut(route, " ")
	if !found || strings.HasPrefix(route, "/") {
		path = route
	}
	path = strings.TrimSpace(path)
	var names []string
	for {
		open := strings.IndexByte(path, '{')
		if open < 0 {
			return names
		}
		end := strings.IndexByte(path[open:], '}')
		if end < 0 {
			return names
		}
		name := strings.TrimSuffix(path[open+1:open+end], "...")
		if name != "$" && name != "" {
			names = append(names, name)
		}
		path = path[open+end+1:]
	}
}

// embedsBinding reports whether struct t (or *t), or a struct it embeds, has
// a field with a binding tag.
func embedsBinding(t reflect.Type, depth int) bool {
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t.Kind() != reflect.Struct || depth > 8 {
		return false
	}
	for i := range t.NumField() {
		f := t.Field(i)
		if _, _, ok, err := BindingTag(f.Tag); ok || err != nil || f.Anonymous && embedsBinding(f.Type, depth+1) {
			return true
		}
	}
	return false
}

// implementsText reports whether a *t is an encoding.TextUnmarshaler.
func implementsText(t reflect.Type) bool {
	return reflect.PointerTo(t).Implements(textUnmarshalerType)
}

// zeroCanonical is the canonical text of t's zero value, as its converter
// would return it for a value that parses to zero.
func zeroCanonical(t reflect.Type) (canonical string, ok bool) {
	if implementsText(t) {
		defer func() {
			if recover() != nil {
				canonical, ok = "", false
			}
		}()
		m, isM := reflect.New(t).Interface().(encoding.TextMarshaler)
		if !isM {
			return "", false
		}
		out, err := m.MarshalText()
		return string(out), err == nil
	}
	switch t.Kind() {
	case reflect.String:
		return "", true
	case reflect.Bool:
		return strconv.FormatBool(false), true
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "0", true
	}
	return "", false
}

// converterFor returns the converter for a field of type t, or nil if t is
// not supported.
func converterFor(t reflect.Type) converter {
	if implementsText(t) {
		return func(s string, v reflect.Value) (canonical string, err error) {
			// The type's own code runs on the client's bytes: a panic in it
			// (a bug) would make net/http drop the connection with no
			// answer, and a retrying client try again in vain. It is the
			// value's fault as much as the type's, and the same value
			// always panics: a 400, logged with the stack by Handle.
			defer func() {
				if r := recover(); r != nil {
					err = &bindPanicError{typ: t, value: r, stack: debug.Stack()}
				}
			}()
			p := reflect.New(t)
			if err := p.Interface().(encoding.TextUnmarshaler).UnmarshalText([]byte(s)); err != nil {
				return "", err
			}
			v.Set(p.Elem())
			// The canonical text is the value's own encoding when it has one
			// (a UUID in upper case is the same UUID).
			if m, ok := p.Interface().(encoding.TextMarshaler); ok {
				out, err := m.MarshalText()
				if err != nil {
					return "", err
				}
				return string(out), nil
			}
			return s, nil
		}
	}
	switch t.Kind() {
	case reflect.String:
		return func(s string, v reflect.Value) (string, error) {
			v.SetString(s)
			return s, nil
		}
	case reflect.Bool:
		return func(s string, v reflect.Value) (string, error) {
			b, err := strconv.ParseBool(s)
			if err != nil {
				return "", fmt.Errorf("%q is not a boolean (true or false)", s)
			}
			v.SetBool(b)
			return strconv.FormatBool(b), nil
		}
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		bits := t.Bits()
		return func(s string, v reflect.Value) (string, error) {
			n, err := strconv.ParseInt(s, 10, bits)
			if err != nil {
				return "", fmt.Errorf("%q is not an integer (%d-bit)", s, bits)
			}
			v.SetInt(n)
			return strconv.FormatInt(n, 10), nil
		}
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		bits := t.Bits()
		return func(s string, v reflect.Value) (string, error) {
			n, err := strconv.ParseUint(s, 10, bits)
			if err != nil {
				return "", fmt.Errorf("%q is not a non-negative integer (%d-bit)", s, bits)
			}
			v.SetUint(n)
			return strconv.FormatUint(n, 10), nil
		}
	}
	return nil
}

// bind sets req's bound fields from r, overwriting whatever the JSON body
// put there, and returns the canonical encoding of the bound values for the
// fingerprint: per field its source, name and values as converted (so "007"
// and "7" for an integer are the same request), each length-prefixed so
// that no two different requests encode alike (JSON would not do: it
// replaces invalid UTF-8, which a query or path may hold, with U+FFFD). A
// value that does not convert is a 400 naming the parameter.
func (b *binder) bind(r *http.Request, req reflect.Value) ([]byte, *Error) {
	if len(b.fields) == 0 {
		return nil, nil
	}
	var canon []byte
	put := func(s string) {
		canon = strconv.AppendInt(canon, int64(len(s)), 10)
		canon = append(canon, ':')
		canon = append(canon, s...)
	}
	var query map[string][]string
	for _, f := range b.fields {
		var raw []string
		switch f.source {
		case bindPath:
			raw = []string{r.PathValue(f.name)}
		case bindQuery:
			if query == nil {
				// url.URL.Query drops a pair it cannot parse (a ';'
				// separator, a bad %-escape) without a word:
				// ?dry_run=true; would reach the function as false.
				var err error
				if query, err = url.ParseQuery(r.URL.RawQuery); err != nil {
					return nil, &Error{Status: http.StatusBadRequest, Title: "Invalid query",
						Detail: fmt.Sprintf("query: %v (parameters are separated by &, and %% starts a two-digit hex escape)", err), Err: err}
				}
			}
			raw = query[f.name]
		case bindHeader:
			raw = r.Header.Values(f.name)
		}
		what := map[string]string{bindPath: "path parameter", bindQuery: "query parameter", bindHeader: "header"}[f.source]
		if !f.slice && len(raw) > 1 {
			return nil, &Error{Status: http.StatusBadRequest, Title: "Invalid " + what,
				Detail: fmt.Sprintf("%s %s: given %d times, want once", what, f.name, len(raw))}
		}
		field := req.Field(f.index)
		field.SetZero()
		var values []string
		if f.slice {
			if len(raw) > 0 {
				field.Set(reflect.MakeSlice(field.Type(), len(raw), len(raw)))
			}
			for i, s := range raw {
				c, err := f.conv(s, field.Index(i))
				if err != nil {
					return nil, bindError(what, f.name, err)
				}
				values = append(values, c)
			}
		} else if len(raw) == 1 && raw[0] != "" {
			// Absent or empty is the zero value, and the same request.
			c, err := f.conv(raw[0], field)
			if err != nil {
				return nil, bindError(what, f.name, err)
			}
			values = append(values, c)
		} else if f.hasZero {
			values = append(values, f.zero)
		}
		put(f.source)
		put(f.name)
		canon = strconv.AppendInt(canon, int64(len(values)), 10)
		canon = append(canon, '\n')
		for _, v := range values {
			put(v)
		}
	}
	return canon, nil
}

// bindPanicError is a panic in a bound type's UnmarshalText or MarshalText.
// Its text, which the client sees, leaves the panic value out; Handle logs
// the value and stack.
type bindPanicError struct {
	typ   reflect.Type
	value any
	stack []byte
}

func (e *bindPanicError) Error() string {
	return fmt.Sprintf("the value could not be parsed (%s's UnmarshalText or MarshalText panicked)", e.typ)
}

func bindError(what, name string, err error) *Error {
	return &Error{Status: http.StatusBadRequest, Title: "Invalid " + what,
		Detail: fmt.Sprintf("%s %s: %v", what, name, err), Err: err}
}

// fingerprint binds a key to one request: what the function receives (the
// body and the canonical bound values) and the method. Anything the function
// does not receive (an unbound header or query parameter, the spelling of a
// bound value) never makes a retry a "different request"; anything it does
// receive, differing, is a 422.
func fingerprint(method string, bound, body []byte) []byte {
	f := sha256.New()
	// As fmt.Fprintf(f, "%s\x00%d\x00", method, len(bound)) writes it.
	prefix := make([]byte, 0, 64)
	prefix = append(prefix, method...)
	prefix = append(prefix, 0)
	prefix = strconv.AppendInt(prefix, int64(len(bound)), 10)
	prefix = append(prefix, 0)
	f.Write(prefix)
	f.Write(bound)
	f.Write(body)
	return f.Sum(nil)
}

// decode fills req from the request read by readRequest: the JSON body, then
// the bound fields, and sets in.fingerprint. An empty body is the zero value
// when the type binds a field or the method has no body by convention (GET,
// HEAD, DELETE): POST /orders/{id}/cancel and GET /orders/{id} need none.
func (b *binder) decode(r *http.Request, in *request, req any, strict bool) *Error {
	bodyless := len(b.fields) > 0 || r.Method == http.MethodGet || r.Method == http.MethodHead || r.Method == http.MethodDelete
	if len(in.body) > 0 || !bodyless {
		if perr := decodeJSON(in.body, req, strict); perr != nil {
			return perr
		}
	}
	bound, perr := b.bind(r, reflect.ValueOf(req).Elem())
	if perr != nil {
		return perr
	}
	in.fingerprint = fingerprint(r.Method, bound, in.body)
	return nil
}
