package generator

import (
	"fmt"
	"go/token"
	"go/types"
	"net/http"
	"reflect"
	"slices"
	"strings"

	"golang.org/x/tools/go/packages"

	"github.com/idemgen/idemgen/runtime/idem"
)

// binding is one request field bound from the path, query or a header. The
// runtime binds by the same struct tags (idem.Handle reads them once at
// start-up); the generator checks them here, at generation time, so that a
// mistake is a file:line:col error and not a panic when the service starts.
type binding struct {
	field  string // Go field name
	source string // path, query or header
	name   string // wildcard, parameter or header name
}

// validIgnore validates ignore=: comma-separated wildcard names.
func validIgnore(v string) error {
	for name := range strings.SplitSeq(v, ",") {
		if strings.TrimSpace(name) == "" {
			return fmt.Errorf("%q: want wildcard names separated by commas, e.g. ignore=\"id\"", v)
		}
	}
	return nil
}

// checkBindings checks the binding tags of f's request type against its
// route and records them in f. ignoreOpt is the ignore= option, if given.
// Every wildcard of the route must be bound by a path field or listed in
// ignore=: a wildcard read by nobody is almost always a forgotten field, and
// it is not part of the fingerprint.
func checkBindings(pkg *packages.Package, f *httpFunc, ignoreOpt *Option, routePos token.Position, errs *errorSink) {
	reqName := typeString(f.req, pkg.Types.Path())
	wildcards := idem.RouteWildcards(f.route)
	var ignored []string
	if ignoreOpt != nil {
		for name := range strings.SplitSeq(ignoreOpt.Value, ",") {
			name = strings.TrimSpace(name)
			switch {
			case f.route == "":
				errs.add(ignoreOpt.Pos, "//idem:http on %s: ignore=%s: %s has no route=, so there is no wildcard to ignore", f.name, ignoreOpt.Value, f.name)
				return
			case !slices.Contains(wildcards, name):
				errs.add(ignoreOpt.Pos, "//idem:http on %s: ignore=%s: route %q has no wildcard {%s}%s", f.name, ignoreOpt.Value, f.route, name, wildcardList(wildcards))
				return
			}
			ignored = append(ignored, name)
		}
	}

	t := f.req
	ptr := false
	if p, ok := types.Unalias(t).Underlying().(*types.Pointer); ok {
		t, ptr = p.Elem(), true
	}
	st, _ := t.Underlying().(*types.Struct)
	local := func(v *types.Var) bool { return v.Pkg() == pkg.Types }
	bound := map[string]string{} // source+" "+name -> field
	tagged := map[string]bool{}  // wildcards some path field names, valid or not
	for i := 0; st != nil && i < st.NumFields(); i++ {
		v := st.Field(i)
		source, name, ok, err := idem.BindingTag(reflect.StructTag(st.Tag(i)))
		at := f.pos
		where := fmt.Sprintf("field %s of %s", v.Name(), reqName)
		if local(v) {
			at = pkg.Fset.Position(v.Pos())
			where = "field " + v.Name()
		}
		fail := func(format string, args ...any) {
			errs.add(at, "//idem:http on %s: %s %s", f.name, where, fmt.Sprintf(format, args...))
		}
		switch {
		case err != nil:
			fail("%v", err)
			continue
		case source == "path":
			tagged[name] = true
		}
		switch {
		case !ok:
			if v.Embedded() && embedsBinding(v.Type(), 0) {
				fail("is embedded and has fields with binding tags, which are read only on the request type's own fields: move them up")
			}
			continue
		case ptr:
			fail("is bound from the %s, but the request type %s is a pointer: take the struct type as the request", source, reqName)
			continue
		case !v.Exported():
			fail("is bound from the %s but unexported, so it cannot be set: export it", source)
			continue
		}
		if source == "header" {
			if err := validHeaderName(name); err != nil {
				fail("has header tag %q, which is not a valid header name", name)
				continue
			}
			name = http.CanonicalHeaderKey(name)
		}
		if prev, dup := bound[source+" "+name]; dup {
			fail("is bound to %s %q, like field %s: bind each one once", source, name, prev)
			continue
		}
		bound[source+" "+name] = v.Name()
		if source == "path" {
			switch {
			case f.route == "":
				fail("is bound to path wildcard {%s}, but %s has no route= to take it from", name, f.name)
				continue
			case !slices.Contains(wildcards, name):
				fail("is bound to path wildcard {%s}, but route %q has no {%s}%s", name, f.route, name, wildcardList(wildcards))
				continue
			case slices.Contains(ignored, name):
				errs.add(ignoreOpt.Pos, "//idem:http on %s: ignore=%s: wildcard {%s} is bound by field %s; drop it from ignore=", f.name, ignoreOpt.Value, name, v.Name())
				continue
			}
		}
		if why := bindableType(v.Type(), source); why != "" {
			fail("has type %s, %s", typeString(v.Type(), pkg.Types.Path()), why)
			continue
		}
		f.bindings = append(f.bindings, binding{field: v.Name(), source: source, name: name})
	}
	for _, w := range wildcards {
		if tagged[w] || slices.Contains(ignored, w) {
			continue
		}
		fix := fmt.Sprintf("add a field tagged `path:%q` to %s", w, reqName)
		if st == nil || ptr {
			fix = fmt.Sprintf("make the request type a struct with a field tagged `path:%q`", w)
		}
		errs.add(routePos, "//idem:http on %s: wildcard {%s} of route %q is not bound: %s, or add ignore=%q to the directive if the function does not need it",
			f.name, w, f.route, fix, w)
	}
	f.ignored = ignored
}

// embedsBinding reports whether struct t (or *t), or a struct it embeds, has
// a field with a binding tag.
func embedsBinding(t types.Type, depth int) bool {
	if p, ok := t.Underlying().(*types.Pointer); ok {
		t = p.Elem()
	}
	st, ok := t.Underlying().(*types.Struct)
	if !ok || depth > 8 {
		return false
	}
	for i := 0; i < st.NumFields(); i++ {
		_, _, bound, err := idem.BindingTag(reflect.StructTag(st.Tag(i)))
		if bound || err != nil || st.Field(i).Embedded() && embedsBinding(st.Field(i).Type(), depth+1) {
			return true
		}
	}
	return false
}

// wildcardList is ", which has {a}, {b}" or "", for errors.
func wildcardList(ws []string) string {
	if len(ws) == 0 {
		return " (it has no wildcards)"
	}
	return " (it has {" + strings.Join(ws, "}, {") + "})"
}

// bindableType says why a field of type t cannot be bound from source, or
// "" if it can. The rules are the runtime's (idem.SupportedBindingTypes).
func bindableType(t types.Type, source string) string {
	if textUnmarshaler(t) {
		return ""
	}
	if s, ok := t.Underlying().(*types.Slice); ok {
		if source == "path" {
			return "but a path wildcard holds one value; use a single-valued type"
		}
		if textUnmarshaler(s.Elem()) || scalar(s.Elem()) {
			return ""
		}
		return "whose elements " + source + " binding does not support (" + idem.SupportedBindingTypes + ")"
	}
	if scalar(t) {
		return ""
	}
	return "which " + source + " binding does not support (" + idem.SupportedBindingTypes + ")"
}

// scalar reports a string, bool or integer type.
func scalar(t types.Type) bool {
	b, ok := t.Underlying().(*types.Basic)
	return ok && b.Info()&(types.IsString|types.IsBoolean|types.IsInteger) != 0 && b.Kind() != types.UntypedNil &&
		b.Kind() != types.UnsafePointer && b.Kind() != types.Uintptr
}

// textUnmarshaler reports whether *t has UnmarshalText([]byte) error.
func textUnmarshaler(t types.Type) bool {
	obj, _, _ := types.LookupFieldOrMethod(types.NewPointer(t), false, nil, "UnmarshalText")
	fn, ok := obj.(*types.Func)
	if !ok {
		return false
	}
	sig := fn.Type().(*types.Signature)
	return sig.Params().Len() == 1 && types.Identical(sig.Params().At(0).Type(), types.NewSlice(types.Typ[types.Byte])) &&
		sig.Results().Len() == 1 && types.Identical(sig.Results().At(0).Type(), types.Universe.Lookup("error").Type())
}

// bindingDoc is, for the handler's doc comment, one line per request field
// the runtime binds and one for the wildcards ignore= leaves unread.
func (f *httpFunc) bindingDoc() []string {
	var lines []string
	if len(f.bindings) > 0 {
		lines = append(lines, "idem.Handle binds these request fields (any other field is read from the JSON body):")
	}
	for _, b := range f.bindings {
		from := b.source + " " + b.name
		if b.source == "path" {
			from = "path {" + b.name + "}"
		}
		lines = append(lines, "  - "+b.field+" from "+from)
	}
	if len(f.ignored) > 0 {
		lines = append(lines, "The route's {"+strings.Join(f.ignored, "}, {")+"} is deliberately not read (ignore=).")
	}
	return lines
}
