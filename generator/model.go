package generator

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"go/types"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"

	"golang.org/x/tools/go/packages"

	"github.com/idemgen/idemgen/internal/suggest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// Import paths the generated code and the shape checks refer to.
const (
	runtimePath = "github.com/idemgen/idemgen/runtime/idem"
	pgxPath     = "github.com/jackc/pgx/v5"
)

// pkgModel is everything idemgen generates for one package.
type pkgModel struct {
	path, name string
	dir        string
	https      []*httpFunc
	consumes   []*consumeFunc
	outboxes   []*outboxType
	// groups splits the above by the build constraint of their files, one
	// generated file each; sorted by file name.
	groups []*group
	// emitted names the package-level identifiers and methods the generated
	// files declare; type errors at uses of them are expected before the
	// first generation and are not the user's.
	emitted map[string]bool
	// names are the package-level names the package declares in any build:
	// those of this build's scope and those of the files it excludes. A
	// generated file without a constraint is compiled in every build, so
	// its import names and locals must avoid them all, and it must be the
	// same file whichever build generated it (a type http in a _windows.go
	// file once made gen on linux write a file that broke the windows build,
	// and check on windows call it out of date).
	names map[string]bool
	// otherBuild is where the files this build excludes declare names and
	// methods ("Name", "T.Method").
	otherBuild map[string]declaredAt
}

// declared reports whether the package declares name at package level in
// some build.
func (m *pkgModel) declared(name string) bool { return m.names[name] }

// packageNames returns the package-level names of pkg in every build: its
// scope's, and those declared in the non-test files the build excludes
// (read syntactically; a file of another package clause is skipped). It
// also returns where those excluded files declare names and methods
// ("Name", "T.Method"), for the collision check, and whether each such file
// is in the user's build after all (excluded by LoadTag alone).
func packageNames(pkg *packages.Package, selects func(string) bool) (names map[string]bool, otherBuild map[string]declaredAt) {
	names, otherBuild = map[string]bool{}, map[string]declaredAt{}
	for _, n := range pkg.Types.Scope().Names() {
		names[n] = true
	}
	for _, path := range pkg.IgnoredFiles {
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") || isGeneratedName(path) {
			continue
		}
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if f == nil || err != nil || f.Name.Name != pkg.Name {
			continue
		}
		sameBuild := selects != nil && selects(path)
		declare := func(key string, id *ast.Ident) {
			if _, dup := otherBuild[key]; !dup {
				otherBuild[key] = declaredAt{fset.Position(id.Pos()), sameBuild}
			}
			if !strings.Contains(key, ".") {
				names[key] = true
			}
		}
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				if d.Recv == nil {
					declare(d.Name.Name, d.Name)
				} else if len(d.Recv.List) == 1 {
					if t := recvTypeName(d.Recv.List[0].Type); t != "" {
						declare(t+"."+d.Name.Name, d.Name)
					}
				}
			case *ast.GenDecl:
				for _, spec := range d.Specs {
					switch spec := spec.(type) {
					case *ast.TypeSpec:
						declare(spec.Name.Name, spec.Name)
					case *ast.ValueSpec:
						for _, n := range spec.Names {
							declare(n.Name, n)
						}
					}
				}
			}
		}
	}
	return names, otherBuild
}

// declaredAt is where a file the load excluded declares a name.
type declaredAt struct {
	pos token.Position
	// sameBuild: the user's build compiles the file (only LoadTag
	// excluded it, e.g. a copy of generated code under another name).
	sameBuild bool
}

func (d declaredAt) where(rel func(token.Position) token.Position) string {
	if d.sameBuild {
		return rel(d.pos).String()
	}
	return rel(d.pos).String() + " (a file of another build)"
}

// recvTypeName is the type name of a method's receiver expression: T for T,
// *T, T[P] and *T[P].
func recvTypeName(x ast.Expr) string {
	for {
		switch t := x.(type) {
		case *ast.StarExpr:
			x = t.X
		case *ast.ParenExpr:
			x = t.X
		case *ast.IndexExpr:
			x = t.X
		case *ast.IndexListExpr:
			x = t.X
		case *ast.Ident:
			return t.Name
		default:
			return ""
		}
	}
}

// wrapped is a function or method that generated code wraps.
type wrapped struct {
	pos      token.Position
	group    *group
	name     string       // the function's name
	recv     *types.Named // nil for a plain function
	ptrRecv  bool
	recvName string // the receiver's name in the user's declaration, if usable
}

// qualifiedName is f's name as a default scope or context:
// "pkg/path.Func", "pkg/path.(*T).Method" or "pkg/path.T.Method".
func (f *wrapped) qualifiedName(pkgPath string) string {
	switch {
	case f.recv == nil:
		return pkgPath + "." + f.name
	case f.ptrRecv:
		return pkgPath + ".(*" + f.recv.Obj().Name() + ")." + f.name
	default:
		return pkgPath + "." + f.recv.Obj().Name() + "." + f.name
	}
}

// httpFunc is one //idem:http function, checked and with defaults applied.
type httpFunc struct {
	wrapped
	req  types.Type
	resp types.Type

	// Options as the directive gives them; zero when not given, so that
	// the runtime's defaults apply and live in one place.
	scope       string
	scopePos    token.Position // of the scope= option, or the function
	route       string
	status      int
	ttl         time.Duration
	header      string
	wait        *time.Duration
	keyOptional bool

	// bindings are the request's fields bound from the path, query or
	// headers; ignored lists the route's wildcards left deliberately unread
	// (ignore=). Both only document the handler: the runtime reads the
	// tags itself.
	bindings []binding
	ignored  []string
}

// handlerName is the generated constructor's name for f.
func (f *httpFunc) handlerName() string { return f.name + "Handler" }

// consumeFunc is one //idem:consume function.
type consumeFunc struct {
	wrapped
	event   types.Type
	topic   string
	context string
	idField *fieldRef // nil: the event id comes from the record header
	decode  string    // a package function func([]byte) (Event, error), or ""
}

// consumerName is the generated constructor's name for f.
func (f *consumeFunc) consumerName() string { return f.name + "Consumer" }

// outboxType is one //idem:outbox type.
type outboxType struct {
	pos      token.Position
	group    *group
	typ      *types.Named
	topic    string
	keyField *fieldRef // nil: no partition key
}

// enqueueName is the generated function's name for t.
// It is unexported when the type is: EnqueuePaid for Paid, enqueuePaid for
// paid (an exported function must not take an unexported type).
func (t *outboxType) enqueueName() string {
	name := []rune(t.typ.Obj().Name())
	name[0] = unicode.ToUpper(name[0])
	if !t.typ.Obj().Exported() {
		return "enqueue" + string(name)
	}
	return "Enqueue" + string(name)
}

// fieldRef is a struct field whose value generated code turns into a string.
type fieldRef struct {
	name string
	typ  types.Type
	conv fieldConv
}

// fieldConv is how a field's value becomes a string.
type fieldConv int

const (
	convIdentity fieldConv = iota // string itself: v
	convString                    // another string type: string(v)
	convStringer                  // fmt.Stringer: v.String()
	convInt                       // signed integer: strconv.FormatInt(int64(v), 10), strconv.Itoa(v)
	convUint                      // unsigned integer: strconv.FormatUint(uint64(v), 10)
)

// Package-level functions generated once per generated file. Functions from
// a file with a build constraint get the constraint's words appended
// (RegisterIdemRoutesIntegration), so that every build declares each name
// once; they are unexported when a parameter's type is unexported.
const (
	registerName  = "RegisterIdemRoutes" // registers the routed //idem:http handlers
	consumersName = "IdemConsumers"      // lists the //idem:consume handlers
)

// buildModel reads the directives of pkg and checks what they annotate.
// It returns nil (and no errors) for a package without directives.
// selects, if not nil, reports whether the user's build compiles a file
// this load excluded (one excluded by LoadTag alone).
func buildModel(pkg *packages.Package, errs *errorSink, selects func(path string) bool) *pkgModel {
	m := &pkgModel{path: pkg.PkgPath, name: pkg.Name, dir: pkgDir(pkg), emitted: map[string]bool{}}
	groups := map[string]*group{}
	for _, file := range pkg.Syntax {
		// For a cgo package the syntax is of the compiled files, whose
		// //line directives point back at the user's file.
		filename := pkg.Fset.Position(file.Package).Filename
		if isGeneratedFile(filename, file) {
			continue
		}
		expr, err := fileConstraint(filename)
		if err != nil {
			errs.add(token.Position{Filename: filename}, "read build constraint: %v", err)
			continue
		}
		// Constraints that differ only in associativity (a && b && c, a &&
		// (b && c)) share a file; its //go:build line is the least of their
		// texts, whichever of the files this build selects.
		g := newGroup(expr)
		if prev := groups[g.file]; prev != nil {
			if expr != nil && expr.String() < prev.expr.String() {
				prev.expr = expr
			}
			g = prev
		} else {
			groups[g.file] = g
		}
		scanFile(pkg, file, g, m, errs)
	}
	if len(m.https)+len(m.consumes)+len(m.outboxes) == 0 {
		return nil
	}
	m.names, m.otherBuild = packageNames(pkg, selects)
	for _, g := range groups {
		if len(g.https)+len(g.consumes)+len(g.outboxes) > 0 {
			m.groups = append(m.groups, g)
		}
	}
	sort.Slice(m.groups, func(i, j int) bool { return m.groups[i].file < m.groups[j].file })
	for _, g := range m.groups {
		nameAggregates(g)
		for _, f := range g.https {
			m.emitted[f.handlerName()] = true
			if f.route != "" {
				m.emitted[g.registerName] = true
			}
		}
		for _, f := range g.consumes {
			m.emitted[f.consumerName()] = true
			m.emitted[g.consumersName] = true
		}
		for _, t := range g.outboxes {
			m.emitted[t.enqueueName()] = true
		}
	}
	checkCollisions(pkg, m, errs)
	return m
}

// nameAggregates names g's RegisterIdemRoutes and IdemConsumers: with g's
// suffix, and unexported when one of their receiver parameters has an
// unexported type (an exported function must not take an unexported type).
func nameAggregates(g *group) {
	name := func(base string, recvs []*types.Named) string {
		base += g.suffix
		for _, r := range recvs {
			if r != nil && !r.Obj().Exported() {
				return strings.ToLower(base[:1]) + base[1:]
			}
		}
		return base
	}
	var routed, consumers []*types.Named
	for _, f := range g.https {
		if f.route != "" {
			routed = append(routed, f.recv)
		}
	}
	for _, f := range g.consumes {
		consumers = append(consumers, f.recv)
	}
	g.registerName = name(registerName, routed)
	g.consumersName = name(consumersName, consumers)
}

// scanFile finds the directives of one file. Directives are read from each
// declaration's Doc.List; a directive line anywhere else is reported, since
// a blank line between it and its func silently detaches it.
func scanFile(pkg *packages.Package, file *ast.File, g *group, m *pkgModel, errs *errorSink) {
	attached := map[token.Pos]bool{}
	directives := func(doc *ast.CommentGroup) []*Directive {
		if doc == nil {
			return nil
		}
		var out []*Directive
		for _, c := range doc.List {
			if !strings.HasPrefix(c.Text, directivePrefix) {
				continue
			}
			attached[c.Slash] = true
			d, perrs := parseDirective(c.Text, pkg.Fset.Position(c.Slash))
			for _, e := range perrs {
				errs.add(e.Pos, "%s", e.Msg)
			}
			if d != nil {
				out = append(out, d)
			}
		}
		if len(out) > 1 {
			errs.add(out[1].Pos, "more than one //idem: directive on one declaration (the first is at line %d)", out[0].Pos.Line)
			return out[:1]
		}
		return out
	}

	for _, decl := range file.Decls {
		switch decl := decl.(type) {
		case *ast.FuncDecl:
			for _, d := range directives(decl.Doc) {
				if kinds[d.Kind].target != targetFunc {
					errs.add(d.Pos, "//idem:%s annotates %s, not a function", d.Kind, kinds[d.Kind].shape)
					continue
				}
				checkFunc(pkg, decl, d, g, m, errs)
			}
		case *ast.GenDecl:
			ds := directives(decl.Doc)
			if decl.Tok == token.TYPE && len(decl.Specs) == 1 {
				spec := decl.Specs[0].(*ast.TypeSpec)
				ds = append(ds, directives(spec.Doc)...)
				for _, d := range ds {
					checkType(pkg, spec, d, g, m, errs)
				}
				continue
			}
			for _, d := range ds {
				if decl.Tok == token.TYPE {
					errs.add(d.Pos, "//idem:%s above a grouped type declaration: put it directly above the type it annotates, inside the parentheses", d.Kind)
				} else {
					errs.add(d.Pos, "//idem:%s annotates %s, not a %s declaration", d.Kind, kinds[d.Kind].shape, decl.Tok)
				}
			}
			if decl.Tok == token.TYPE {
				for _, spec := range decl.Specs {
					for _, d := range directives(spec.(*ast.TypeSpec).Doc) {
						checkType(pkg, spec.(*ast.TypeSpec), d, g, m, errs)
					}
				}
			}
		}
	}

	// A directive on an interface's method is on the line above a
	// declaration, yet there is nothing to wrap: say so, rather than that
	// it is not attached.
	onInterface := map[token.Pos]bool{}
	ast.Inspect(file, func(n ast.Node) bool {
		if it, ok := n.(*ast.InterfaceType); ok && it.Methods != nil {
			for _, f := range it.Methods.List {
				if f.Doc != nil {
					for _, c := range f.Doc.List {
						onInterface[c.Slash] = true
					}
				}
			}
		}
		return true
	})

	for _, cg := range file.Comments {
		for _, c := range cg.List {
			switch {
			case attached[c.Slash]:
			case onInterface[c.Slash] && strings.HasPrefix(c.Text, directivePrefix):
				errs.add(pkg.Fset.Position(c.Slash), "%s annotates a function or method with a body, not an interface method: put it on the method of each type that implements it", firstWord(c.Text))
			case strings.HasPrefix(c.Text, directivePrefix):
				errs.add(pkg.Fset.Position(c.Slash), "%s is not attached to a declaration: put it on the line directly above the func or type (no blank line)", firstWord(c.Text))
			case strings.HasPrefix(c.Text, "// idem:"):
				errs.add(pkg.Fset.Position(c.Slash), "idemgen directives have no space after //: write %s", "//"+firstWord(strings.TrimLeft(c.Text[2:], " ")))
			default:
				if kind, ok := lookalikeDirective(c.Text); ok {
					errs.add(pkg.Fset.Position(c.Slash), "this comment is not read as a directive: write //idem:%s (a // comment, lower case, no space after //)", kind)
				}
			}
		}
	}
}

// checkType checks the type an //idem:outbox directive annotates.
func checkType(pkg *packages.Package, spec *ast.TypeSpec, d *Directive, g *group, m *pkgModel, errs *errorSink) {
	if kinds[d.Kind].target != targetType {
		errs.add(d.Pos, "//idem:%s annotates a function of shape %s, not a type", d.Kind, kinds[d.Kind].shape)
		return
	}
	pos := pkg.Fset.Position(spec.Name.Pos())
	obj, _ := pkg.TypesInfo.Defs[spec.Name].(*types.TypeName)
	if obj == nil {
		if len(pkg.TypeErrors) == 0 { // else the type error is the root cause, reported
			errs.add(pos, "cannot type-check %s", spec.Name.Name)
		}
		return
	}
	named, _ := obj.Type().(*types.Named)
	if named == nil || spec.TypeParams != nil {
		errs.add(pos, "//idem:outbox annotates a named, non-generic struct type; %s is not one", obj.Name())
		return
	}
	st, ok := named.Underlying().(*types.Struct)
	if !ok {
		errs.add(pos, "//idem:outbox annotates a struct type; %s is %s", obj.Name(), named.Underlying())
		return
	}
	if why := jsonUnfriendly(named, pkg.Types); why != "" {
		errs.add(pos, "//idem:outbox cannot publish %s: it %s", obj.Name(), why)
		return
	}
	if hasInvalid(named.Underlying()) || typeErrorWithin(pkg, spec.Pos(), spec.End()) {
		return // a type error, reported on its own
	}
	t := &outboxType{pos: pos, group: g, typ: named}
	for _, o := range d.Options {
		switch o.Name {
		case "topic":
			t.topic = o.Value
		case "key":
			ref, err := stringField(st, pkg.Types, o.Value)
			if err != nil {
				errs.add(o.Pos, "//idem:outbox key=%s: %v", o.Value, err)
				return
			}
			t.keyField = ref
		}
	}
	m.outboxes = append(m.outboxes, t)
	g.outboxes = append(g.outboxes, t)
}

// stringField finds the exported field name of st that generated code can
// turn into a string (a partition key, an event id).
func stringField(st *types.Struct, local *types.Package, name string) (*fieldRef, error) {
	var fields []string
	for i := 0; i < st.NumFields(); i++ {
		f := st.Field(i)
		if f.Exported() {
			fields = append(fields, f.Name())
		}
		if f.Name() != name {
			continue
		}
		t := f.Type()
		if types.Implements(t, stringerType) {
			return &fieldRef{name: name, typ: t, conv: convStringer}, nil
		}
		if b, ok := t.Underlying().(*types.Basic); ok {
			switch {
			case types.Identical(t, types.Typ[types.String]):
				return &fieldRef{name: name, typ: t, conv: convIdentity}, nil
			case b.Info()&types.IsString != 0:
				return &fieldRef{name: name, typ: t, conv: convString}, nil
			case b.Info()&types.IsInteger != 0 && b.Info()&types.IsUnsigned != 0:
				return &fieldRef{name: name, typ: t, conv: convUint}, nil
			case b.Info()&types.IsInteger != 0:
				return &fieldRef{name: name, typ: t, conv: convInt}, nil
			}
		}
		return nil, fmt.Errorf("field %s has type %s; want a string, an integer or a fmt.Stringer", name, types.TypeString(t, pkgNameQualifier(local)))
	}
	return nil, fmt.Errorf("no field %s%s (fields: %s)", name, suggest.DidYouMean(name, fields), strings.Join(fields, ", "))
}

// stringerType is fmt.Stringer, built without importing fmt's types.
var stringerType = types.NewInterfaceType([]*types.Func{
	types.NewFunc(token.NoPos, nil, "String", types.NewSignatureType(nil, nil, nil, nil,
		types.NewTuple(types.NewVar(token.NoPos, nil, "", types.Typ[types.String])), false)),
}, nil).Complete()

// checkFunc checks the function a directive annotates and adds it to m.
func checkFunc(pkg *packages.Package, decl *ast.FuncDecl, d *Directive, g *group, m *pkgModel, errs *errorSink) {
	obj, _ := pkg.TypesInfo.Defs[decl.Name].(*types.Func)
	if obj == nil {
		if len(pkg.TypeErrors) == 0 { // else the type error is the root cause, reported
			errs.add(pkg.Fset.Position(decl.Name.Pos()), "cannot type-check %s", decl.Name.Name)
		}
		return
	}
	pos := pkg.Fset.Position(decl.Name.Pos())
	sig := obj.Type().(*types.Signature)
	if hasInvalid(sig) || typeErrorWithin(pkg, decl.Pos(), decl.Type.End()) {
		// A type error in the signature is reported by itself; a shape
		// error about "invalid type" would only hide it. Not every such
		// error leaves an invalid type (map[F]int with a key type that is
		// not comparable is still a map): wrapped, the function repeated
		// the error in the generated file the recheck type-checks.
		return
	}
	qual := func(p *types.Package) string {
		if p == pkg.Types {
			return ""
		}
		return p.Name()
	}

	w := wrapped{pos: pos, group: g, name: obj.Name()}
	if recv := sig.Recv(); recv != nil {
		t := recv.Type()
		if p, ok := t.(*types.Pointer); ok {
			w.ptrRecv, t = true, p.Elem()
		}
		named, _ := types.Unalias(t).(*types.Named)
		if named == nil || named.TypeParams().Len() > 0 {
			errs.add(pos, "//idem:%s cannot wrap %s: methods of generic types are not supported; wrap a plain method or function", d.Kind, obj.Name())
			return
		}
		w.recv = named
		if n := recv.Name(); n != "" && n != "_" {
			w.recvName = n
		}
	}

	var want string
	if d.Kind == "http" {
		want = wantHTTPShape(sig, qual)
	} else {
		want = wantConsumeShape(sig, qual)
	}
	shapeErr := func(why string) {
		errs.add(pos, "//idem:%s cannot wrap %s: %s\n\thave %s\n\twant %s",
			d.Kind, obj.Name(), why, signatureString(sig, qual), want)
	}
	wantResults := 2
	if d.Kind == "consume" {
		wantResults = 1
	}
	params, results := sig.Params(), sig.Results()
	switch {
	case sig.TypeParams().Len() > 0:
		shapeErr("generic functions are not supported")
		return
	case sig.Variadic():
		shapeErr("it is variadic")
		return
	case params.Len() != 3:
		shapeErr(fmt.Sprintf("it takes %s, want 3", plural(params.Len(), "parameter")))
		return
	case !isNamed(params.At(0).Type(), "context", "Context"):
		shapeErr("the first parameter must be context.Context")
		return
	case !isNamed(params.At(1).Type(), pgxPath, "Tx"):
		shapeErr("the second parameter must be pgx.Tx (github.com/jackc/pgx/v5), the transaction that also holds the " +
			map[string]string{"http": "key claim", "consume": "processed-event row"}[d.Kind])
		return
	case results.Len() != wantResults:
		shapeErr(fmt.Sprintf("it returns %s, want %d", plural(results.Len(), "result"), wantResults))
		return
	case !types.Identical(results.At(results.Len()-1).Type(), types.Universe.Lookup("error").Type()):
		shapeErr("the last result must be error")
		return
	}

	switch d.Kind {
	case "http":
		checkHTTP(pkg, w, sig, d, m, errs)
	case "consume":
		checkConsume(pkg, w, sig, d, m, errs)
	}
}

func checkHTTP(pkg *packages.Package, w wrapped, sig *types.Signature, d *Directive, m *pkgModel, errs *errorSink) {
	f := &httpFunc{wrapped: w, req: sig.Params().At(2).Type(), resp: sig.Results().At(0).Type()}
	for _, t := range []struct {
		what string
		typ  types.Type
	}{{"request", f.req}, {"response", f.resp}} {
		why := jsonUnfriendly(t.typ, pkg.Types)
		if why == "" {
			why = unnameable(t.typ, pkg.Types)
		}
		if why != "" {
			errs.add(w.pos, "//idem:http cannot wrap %s: its %s type %s %s", w.name, t.what, typeString(t.typ, pkg.PkgPath), why)
			return
		}
	}
	f.scope, f.scopePos = f.qualifiedName(pkg.PkgPath), w.pos
	var ignore *Option
	routePos := w.pos
	for _, o := range d.Options {
		switch o.Name {
		case "route":
			f.route, routePos = o.Value, o.Pos
		case "ignore":
			ignore = &o
		case "status":
			f.status, _ = strconv.Atoi(o.Value)
		case "ttl":
			f.ttl, _ = time.ParseDuration(o.Value)
		case "header":
			f.header = o.Value
		case "scope":
			f.scope, f.scopePos = o.Value, o.Pos
		case "wait":
			wait, _ := time.ParseDuration(o.Value)
			f.wait = &wait
		case "key":
			f.keyOptional = o.Value == "optional"
		}
	}
	checkBindings(pkg, f, ignore, routePos, errs)
	m.https = append(m.https, f)
	w.group.https = append(w.group.https, f)
}

func checkConsume(pkg *packages.Package, w wrapped, sig *types.Signature, d *Directive, m *pkgModel, errs *errorSink) {
	f := &consumeFunc{wrapped: w, event: sig.Params().At(2).Type()}
	f.context = f.qualifiedName(pkg.PkgPath)
	evName := typeString(f.event, pkg.PkgPath)
	for _, o := range d.Options {
		switch o.Name {
		case "topic":
			f.topic = o.Value
		case "context":
			f.context = o.Value
		case "id":
			st, ok := f.event.Underlying().(*types.Struct)
			if p, isPtr := f.event.Underlying().(*types.Pointer); !ok && isPtr {
				if _, ok := p.Elem().Underlying().(*types.Struct); ok {
					errs.add(o.Pos, "//idem:consume id=%s: the event type %s is a pointer, and a record whose value is JSON null decodes to nil, which has no %s; take %s by value, or drop id= to read the %s record header", o.Value, evName, o.Value, typeString(p.Elem(), pkg.PkgPath), idem.EventIDHeader)
					return
				}
			}
			if !ok {
				errs.add(o.Pos, "//idem:consume id=%s: the event type %s is not a struct; drop id= to read the %s record header", o.Value, evName, idem.EventIDHeader)
				return
			}
			ref, err := stringField(st, pkg.Types, o.Value)
			if err != nil {
				errs.add(o.Pos, "//idem:consume id=%s: %v", o.Value, err)
				return
			}
			f.idField = ref
		case "decode":
			fn, _ := pkg.Types.Scope().Lookup(o.Value).(*types.Func)
			want := fmt.Sprintf("func(value []byte) (%s, error)", evName)
			if fn == nil {
				errs.add(o.Pos, "//idem:consume decode=%s: no function %s in package %s; want %s", o.Value, o.Value, pkg.Name, want)
				return
			}
			dsig := fn.Type().(*types.Signature)
			if dsig.Params().Len() != 1 || !types.Identical(dsig.Params().At(0).Type(), types.NewSlice(types.Typ[types.Byte])) ||
				dsig.Results().Len() != 2 || !types.Identical(dsig.Results().At(0).Type(), f.event) ||
				!types.Identical(dsig.Results().At(1).Type(), types.Universe.Lookup("error").Type()) || dsig.TypeParams().Len() > 0 {
				errs.add(o.Pos, "//idem:consume decode=%s: have %s, want %s", o.Value, signatureString(dsig, pkgNameQualifier(pkg.Types)), want)
				return
			}
			f.decode = o.Value
		}
	}
	if f.decode == "" {
		if why := jsonUnfriendly(f.event, pkg.Types); why != "" {
			errs.add(w.pos, "//idem:consume cannot wrap %s: its event type %s %s; give a decoder with decode=", w.name, evName, why)
			return
		}
	}
	if why := unnameable(f.event, pkg.Types); why != "" {
		errs.add(w.pos, "//idem:consume cannot wrap %s: its event type %s %s", w.name, evName, why)
		return
	}
	if !exportedOrLocal(f.event, pkg.Types) {
		errs.add(w.pos, "//idem:consume cannot wrap %s: its event type %s is unexported in another package", w.name, evName)
		return
	}
	m.consumes = append(m.consumes, f)
	w.group.consumes = append(w.group.consumes, f)
}

func exportedOrLocal(t types.Type, local *types.Package) bool {
	if n, ok := types.Unalias(t).(*types.Named); ok && n.Obj().Pkg() != nil && n.Obj().Pkg() != local {
		return n.Obj().Exported()
	}
	return true
}

// checkCollisions reports generated names that the user's code already
// declares (outside a previous idem_gen.go) and duplicate routes.
func checkCollisions(pkg *packages.Package, m *pkgModel, errs *errorSink) {
	userDecl := func(obj types.Object) bool {
		return obj != nil && !strings.HasSuffix(pkg.Fset.Position(obj.Pos()).Filename, FileName)
	}
	lookup := func(w *wrapped, name string) types.Object {
		if w != nil && w.recv != nil {
			obj, _, _ := types.LookupFieldOrMethod(w.recv, true, pkg.Types, name)
			return obj
		}
		return pkg.Types.Scope().Lookup(name)
	}
	collide := func(pos token.Position, kind, what, name string, obj types.Object) {
		if userDecl(obj) {
			errs.add(pos, "//idem:%s on %s generates %s, which %s already declares; rename one of them", kind, what, name, errs.rel(pkg.Fset.Position(obj.Pos())))
		}
	}
	scopes := map[string]*httpFunc{}
	mux := http.NewServeMux() // every route so far that registered cleanly
	for i, f := range m.https {
		collide(f.pos, "http", f.name, f.handlerName(), lookup(&f.wrapped, f.handlerName()))
		if prev, dup := scopes[f.scope]; dup {
			errs.add(f.scopePos, "scope %q is already the scope of %s (%s): two operations sharing a scope replay each other's responses; give each its own", f.scope, prev.name, errs.rel(prev.scopePos))
		} else {
			scopes[f.scope] = f
		}
		if f.route == "" || register(mux, f.route) == "" {
			continue
		}
		// It conflicts with an earlier route: find which (only now, so
		// that the common case costs one registration per route).
		for _, prev := range m.https[:i] {
			if prev.route != "" && prev.route == f.route {
				errs.add(f.pos, "route %q is already served by %s (%s)", f.route, prev.name, errs.rel(prev.pos))
				break
			}
			if prev.route == "" {
				continue
			}
			if why := register(muxWith(prev.route), f.route); why != "" {
				errs.add(f.pos, "route %q conflicts with route %q of %s (%s): %s", f.route, prev.route, prev.name, errs.rel(prev.pos), why)
				break
			}
		}
	}
	type topicContext struct{ topic, context string }
	consumers := map[topicContext]*consumeFunc{}
	for _, f := range m.consumes {
		collide(f.pos, "consume", f.name, f.consumerName(), lookup(&f.wrapped, f.consumerName()))
		k := topicContext{f.topic, f.context}
		if prev, dup := consumers[k]; dup {
			errs.add(f.pos, "//idem:consume on %s: %s (%s) already consumes topic %s in context %q, so every event would count as processed for one of them; give each its own context=", f.name, prev.name, errs.rel(prev.pos), f.topic, f.context)
		} else {
			consumers[k] = f
		}
	}
	for _, t := range m.outboxes {
		collide(t.pos, "outbox", t.typ.Obj().Name(), t.enqueueName(), lookup(nil, t.enqueueName()))
	}
	// The file without a constraint is compiled in every build: what it
	// declares must not be declared by a file of another build either, or
	// that build breaks although this one compiles.
	otherBuild := func(pos token.Position, what, name string, recv *types.Named) {
		key := name
		if recv != nil {
			key = recv.Obj().Name() + "." + name
		}
		if at, ok := m.otherBuild[key]; ok {
			errs.add(pos, "%s generates %s, which %s already declares; rename one of them", what, key, at.where(errs.rel))
		}
	}
	for _, g := range m.groups {
		if g.expr != nil {
			continue
		}
		for _, f := range g.https {
			otherBuild(f.pos, "//idem:http on "+f.name, f.handlerName(), f.recv)
		}
		for _, f := range g.consumes {
			otherBuild(f.pos, "//idem:consume on "+f.name, f.consumerName(), f.recv)
		}
		for _, t := range g.outboxes {
			otherBuild(t.pos, "//idem:outbox on "+t.typ.Obj().Name(), t.enqueueName(), nil)
		}
		for _, name := range []string{g.registerName, g.consumersName} {
			if at, ok := m.otherBuild[name]; ok && m.emitted[name] {
				errs.add(at.pos, "%s is generated by idemgen for the //idem: functions of this package; rename this declaration", name)
			}
		}
	}
	for _, g := range m.groups {
		for _, name := range []string{g.registerName, g.consumersName} {
			if !m.emitted[name] {
				continue
			}
			if obj := pkg.Types.Scope().Lookup(name); userDecl(obj) {
				errs.add(pkg.Fset.Position(obj.Pos()), "%s is generated by idemgen for the //idem: functions of this package; rename this declaration", name)
			}
		}
	}
}

// register registers pattern on mux and says why http.ServeMux refuses it
// (it panics, as it would at start-up), or "". ServeMux is the judge, so its
// rules (wildcard names do not matter, a more specific pattern wins) apply
// exactly.
func register(mux *http.ServeMux, pattern string) (why string) {
	defer func() {
		if r := recover(); r != nil {
			// After its first line (which names where each pattern was
			// registered: here) the panic explains, e.g. "POST
			// /items/{name} matches the same requests as POST /items/{id}".
			msg := fmt.Sprint(r)
			if _, rest, ok := strings.Cut(msg, ":\n"); ok {
				msg = rest
			}
			why = "http.ServeMux would panic registering both: " + strings.Join(strings.Fields(msg), " ")
		}
	}()
	mux.Handle(pattern, http.NotFoundHandler())
	return ""
}

// muxWith returns a ServeMux with pattern registered.
func muxWith(pattern string) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle(pattern, http.NotFoundHandler())
	return mux
}

// hasInvalid reports whether t mentions an invalid type (the result of a
// type error).
// typeErrorWithin reports whether the type checker reported an error
// between from and to, such as in the signature of a function.
func typeErrorWithin(pkg *packages.Package, from, to token.Pos) bool {
	for _, te := range pkg.TypeErrors {
		if te.Fset == pkg.Fset && te.Pos >= from && te.Pos < to {
			return true
		}
	}
	return false
}

func hasInvalid(t types.Type) bool {
	switch t := t.(type) {
	case *types.Basic:
		return t.Kind() == types.Invalid
	case *types.Pointer:
		return hasInvalid(t.Elem())
	case *types.Slice:
		return hasInvalid(t.Elem())
	case *types.Array:
		return hasInvalid(t.Elem())
	case *types.Map:
		return hasInvalid(t.Key()) || hasInvalid(t.Elem())
	case *types.Chan:
		return hasInvalid(t.Elem())
	case *types.Tuple:
		for i := 0; i < t.Len(); i++ {
			if hasInvalid(t.At(i).Type()) {
				return true
			}
		}
	case *types.Signature:
		return hasInvalid(t.Params()) || hasInvalid(t.Results()) || (t.Recv() != nil && hasInvalid(t.Recv().Type()))
	case *types.Struct:
		for i := 0; i < t.NumFields(); i++ {
			if hasInvalid(t.Field(i).Type()) {
				return true
			}
		}
	case *types.Named:
		args := t.TypeArgs()
		for i := 0; i < args.Len(); i++ {
			if hasInvalid(args.At(i)) {
				return true
			}
		}
	case *types.Alias:
		return hasInvalid(types.Unalias(t))
	}
	return false
}

// unnameable says why generated code cannot spell t (declared in local),
// or "". The emitter handles exactly the types this accepts.
func unnameable(t types.Type, local *types.Package) string {
	switch t := t.(type) {
	case *types.Alias:
		if obj := t.Obj(); obj.Pkg() != nil && (obj.Exported() || obj.Pkg() == local) {
			args := t.TypeArgs()
			for i := 0; i < args.Len(); i++ {
				if why := unnameable(args.At(i), local); why != "" {
					return why
				}
			}
			return ""
		}
		if t.Obj().Pkg() == nil && t.Obj().Name() == "any" {
			return ""
		}
		return unnameable(types.Unalias(t), local)
	case *types.Named:
		obj := t.Obj()
		if obj.Pkg() != nil && obj.Pkg() != local && !obj.Exported() {
			return "is unexported in another package, so generated code cannot name it"
		}
		args := t.TypeArgs()
		for i := 0; i < args.Len(); i++ {
			if why := unnameable(args.At(i), local); why != "" {
				return why
			}
		}
		return ""
	case *types.Basic:
		return ""
	case *types.Pointer:
		return unnameable(t.Elem(), local)
	case *types.Slice:
		return unnameable(t.Elem(), local)
	case *types.Array:
		return unnameable(t.Elem(), local)
	case *types.Map:
		if why := unnameable(t.Key(), local); why != "" {
			return why
		}
		return unnameable(t.Elem(), local)
	case *types.Interface:
		if t.Empty() {
			return ""
		}
	case *types.Struct:
		if t.NumFields() == 0 {
			return ""
		}
		return "is an anonymous struct type; declare a named type for it"
	}
	return "has no name that generated code can spell; declare a named type for it"
}

// wantConsumeShape is the signature an //idem:consume function should have.
func wantConsumeShape(sig *types.Signature, qual types.Qualifier) string {
	ev := "Event"
	if p := sig.Params(); p.Len() > 0 {
		last := p.At(p.Len() - 1).Type()
		if !isNamed(last, "context", "Context") && !isNamed(last, pgxPath, "Tx") {
			ev = types.TypeString(last, qual)
		}
	}
	return fmt.Sprintf("func(ctx context.Context, tx pgx.Tx, ev %s) error", ev)
}

func isNamed(t types.Type, path, name string) bool {
	n, ok := types.Unalias(t).(*types.Named)
	return ok && n.Obj().Pkg() != nil && n.Obj().Pkg().Path() == path && n.Obj().Name() == name
}

// jsonUnfriendly says why t cannot be a JSON request or response type that
// generated code can name, or "" if it can.
func jsonUnfriendly(t types.Type, local *types.Package) string {
	switch u := types.Unalias(t).(type) {
	case *types.Named:
		if obj := u.Obj(); obj.Pkg() != nil && obj.Pkg() != local && !obj.Exported() {
			return "is unexported in another package, so generated code cannot name it"
		}
		for i := 0; i < u.TypeArgs().Len(); i++ {
			if why := jsonUnfriendly(u.TypeArgs().At(i), local); why != "" {
				return why
			}
		}
		return jsonUnfriendly(u.Underlying(), local)
	case *types.Signature:
		return "is a function; JSON cannot encode it"
	case *types.Chan:
		return "is a channel; JSON cannot encode it"
	case *types.Basic:
		if u.Kind() == types.Complex64 || u.Kind() == types.Complex128 || u.Kind() == types.UnsafePointer {
			return "cannot be encoded as JSON"
		}
	}
	return ""
}

// pkgNameQualifier writes types as the user's code does: a type of the
// package itself unqualified, others by package name (pgx.Tx, not
// github.com/jackc/pgx/v5.Tx).
func pkgNameQualifier(local *types.Package) types.Qualifier {
	return func(p *types.Package) string {
		if p == local {
			return ""
		}
		return p.Name()
	}
}

func signatureString(sig *types.Signature, qual types.Qualifier) string {
	return "func" + strings.TrimPrefix(types.TypeString(sig, qual), "func")
}

// wantHTTPShape is the signature an //idem:http function should have, using
// the user's own request and response types where they can be guessed.
func wantHTTPShape(sig *types.Signature, qual types.Qualifier) string {
	req, resp := "Req", "Resp"
	if p := sig.Params(); p.Len() > 0 {
		last := p.At(p.Len() - 1).Type()
		if !isNamed(last, "context", "Context") && !isNamed(last, pgxPath, "Tx") {
			req = types.TypeString(last, qual)
		}
	}
	if r := sig.Results(); r.Len() > 0 && !types.Identical(r.At(0).Type(), types.Universe.Lookup("error").Type()) {
		resp = types.TypeString(r.At(0).Type(), qual)
	}
	return fmt.Sprintf("func(ctx context.Context, tx pgx.Tx, req %s) (%s, error)", req, resp)
}

func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// lookalikeDirective reports whether comment text is a directive spelled
// so that it is not read as one — "//Idem:http", "//\tidem:http",
// "/*idem:http ...*/" — and which kind it names. Ignored, such a typo
// generated nothing for the function: no idempotency, and no error.
func lookalikeDirective(text string) (string, bool) {
	rest, ok := strings.CutPrefix(text, "//")
	if !ok {
		rest, ok = strings.CutPrefix(text, "/*")
	}
	if !ok {
		return "", false
	}
	rest = strings.TrimLeft(rest, " \t")
	if len(rest) < len("idem:") || !strings.EqualFold(rest[:len("idem:")], "idem:") {
		return "", false
	}
	word := strings.ToLower(firstWord(strings.TrimSuffix(rest[len("idem:"):], "*/")))
	if _, known := kinds[word]; !known {
		return "", false
	}
	return word, true
}

func firstWord(s string) string {
	if i := strings.IndexAny(s, " \t"); i >= 0 {
		return s[:i]
	}
	return s
}
