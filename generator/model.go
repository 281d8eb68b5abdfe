package generator

import (
	"fmt"
	"go/ast"
	"go/token"
	"go/types"
	"strconv"
	"strings"
	"time"

	"golang.org/x/tools/go/packages"
)

// Import paths the generated code and the shape checks refer to.
const (
	runtimePath = "github.com/idemgen/idemgen/runtime"
	pgxPath     = "github.com/jackc/pgx/v5"
)

// pkgModel is everything idemgen generates for one package.
type pkgModel struct {
	path, name string
	dir        string
	https      []*httpFunc
	// emitted names the package-level identifiers and methods the generated
	// file declares; type errors about them being undefined are expected
	// before the first generation and are not the user's.
	emitted map[string]bool
}

// httpFunc is one //idem:http function, checked and with defaults applied.
type httpFunc struct {
	pos      token.Position
	name     string       // the function's name
	recv     *types.Named // nil for a plain function
	ptrRecv  bool
	recvName string // the receiver's name in the user's declaration, if usable
	req      types.Type
	resp     types.Type

	scope       string
	route       string
	status      int
	ttl         time.Duration
	header      string
	wait        time.Duration
	keyOptional bool
}

// handlerName is the generated constructor's name for f.
func (f *httpFunc) handlerName() string { return f.name + "Handler" }

// qualifiedName is f's name as scope: "pkg/path.Func" or "pkg/path.(*T).Method".
func (f *httpFunc) qualifiedName(pkgPath string) string {
	switch {
	case f.recv == nil:
		return pkgPath + "." + f.name
	case f.ptrRecv:
		return pkgPath + ".(*" + f.recv.Obj().Name() + ")." + f.name
	default:
		return pkgPath + "." + f.recv.Obj().Name() + "." + f.name
	}
}

// registerName is the generated function that registers a package's routes.
const registerName = "RegisterIdemRoutes"

// buildModel reads the directives of pkg and checks what they annotate.
// It returns nil (and no errors) for a package without directives.
func buildModel(pkg *packages.Package, errs *errorSink) *pkgModel {
	m := &pkgModel{path: pkg.PkgPath, name: pkg.Name, emitted: map[string]bool{}}
	for i, file := range pkg.Syntax {
		filename := pkg.Fset.Position(file.Package).Filename
		if i == 0 {
			m.dir = dirOf(filename)
		}
		if isGeneratedFile(filename, file) {
			continue
		}
		scanFile(pkg, file, m, errs)
	}
	if len(m.https) == 0 {
		return nil
	}
	for _, f := range m.https {
		m.emitted[f.handlerName()] = true
		if f.route != "" {
			m.emitted[registerName] = true
		}
	}
	checkCollisions(pkg, m, errs)
	return m
}

// scanFile finds the directives of one file. Directives are read from each
// declaration's Doc.List; a directive line anywhere else is reported, since
// a blank line between it and its func silently detaches it.
func scanFile(pkg *packages.Package, file *ast.File, m *pkgModel, errs *errorSink) {
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
				checkFunc(pkg, decl, d, m, errs)
			}
		case *ast.GenDecl:
			ds := directives(decl.Doc)
			if decl.Tok == token.TYPE && len(decl.Specs) == 1 {
				ds = append(ds, directives(decl.Specs[0].(*ast.TypeSpec).Doc)...)
				for _, d := range ds {
					checkType(d, errs)
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
						checkType(d, errs)
					}
				}
			}
		}
	}

	for _, cg := range file.Comments {
		for _, c := range cg.List {
			switch {
			case attached[c.Slash]:
			case strings.HasPrefix(c.Text, directivePrefix):
				errs.add(pkg.Fset.Position(c.Slash), "%s is not attached to a declaration: put it on the line directly above the func or type (no blank line)", firstWord(c.Text))
			case strings.HasPrefix(c.Text, "// idem:"):
				errs.add(pkg.Fset.Position(c.Slash), "idemgen directives have no space after //: write %s", "//"+firstWord(strings.TrimLeft(c.Text[2:], " ")))
			}
		}
	}
}

// checkType handles a directive on a type declaration.
func checkType(d *Directive, errs *errorSink) {
	if kinds[d.Kind].target != targetType {
		errs.add(d.Pos, "//idem:%s annotates a function of shape %s, not a type", d.Kind, kinds[d.Kind].shape)
		return
	}
	errs.add(d.Pos, "//idem:%s is not generated by this version of idemgen yet", d.Kind)
}

// checkFunc checks the function a directive annotates and adds it to m.
func checkFunc(pkg *packages.Package, decl *ast.FuncDecl, d *Directive, m *pkgModel, errs *errorSink) {
	obj, _ := pkg.TypesInfo.Defs[decl.Name].(*types.Func)
	if obj == nil {
		errs.add(pkg.Fset.Position(decl.Name.Pos()), "cannot type-check %s; fix the errors above first", decl.Name.Name)
		return
	}
	if d.Kind != "http" {
		errs.add(d.Pos, "//idem:%s is not generated by this version of idemgen yet", d.Kind)
		return
	}
	pos := pkg.Fset.Position(decl.Name.Pos())
	sig := obj.Type().(*types.Signature)
	qual := func(p *types.Package) string {
		if p == pkg.Types {
			return ""
		}
		return p.Name()
	}

	f := &httpFunc{pos: pos, name: obj.Name()}
	if recv := sig.Recv(); recv != nil {
		t := recv.Type()
		if p, ok := t.(*types.Pointer); ok {
			f.ptrRecv, t = true, p.Elem()
		}
		named, _ := types.Unalias(t).(*types.Named)
		if named == nil || named.TypeParams().Len() > 0 {
			errs.add(pos, "//idem:http cannot wrap %s: methods of generic types are not supported; wrap a plain method or function", obj.Name())
			return
		}
		f.recv = named
		if n := recv.Name(); n != "" && n != "_" {
			f.recvName = n
		}
	}

	shapeErr := func(why string) {
		errs.add(pos, "//idem:http cannot wrap %s: %s\n\thave %s\n\twant %s",
			obj.Name(), why, signatureString(sig, qual), wantHTTPShape(sig, qual))
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
		shapeErr("the second parameter must be pgx.Tx (github.com/jackc/pgx/v5), the transaction that also holds the key claim")
		return
	case results.Len() != 2:
		shapeErr(fmt.Sprintf("it returns %s, want 2", plural(results.Len(), "result")))
		return
	case !types.Identical(results.At(1).Type(), types.Universe.Lookup("error").Type()):
		shapeErr("the last result must be error")
		return
	}
	f.req, f.resp = params.At(2).Type(), results.At(0).Type()
	for _, t := range []struct {
		what string
		typ  types.Type
	}{{"request", f.req}, {"response", f.resp}} {
		if why := jsonUnfriendly(t.typ, pkg.Types); why != "" {
			errs.add(pos, "//idem:http cannot wrap %s: its %s type %s %s", obj.Name(), t.what, types.TypeString(t.typ, qual), why)
			return
		}
	}

	f.scope = f.qualifiedName(pkg.PkgPath)
	f.status = 200
	f.ttl = 24 * time.Hour
	f.header = "Idempotency-Key"
	f.wait = 5 * time.Second
	for _, o := range d.Options {
		switch o.Name {
		case "route":
			f.route = o.Value
		case "status":
			f.status, _ = strconv.Atoi(o.Value)
		case "ttl":
			f.ttl, _ = time.ParseDuration(o.Value)
		case "header":
			f.header = o.Value
		case "scope":
			f.scope = o.Value
		case "wait":
			f.wait, _ = time.ParseDuration(o.Value)
		case "key":
			f.keyOptional = o.Value == "optional"
		}
	}
	m.https = append(m.https, f)
}

// checkCollisions reports generated names that the user's code already
// declares (outside a previous idem_gen.go) and duplicate routes.
func checkCollisions(pkg *packages.Package, m *pkgModel, errs *errorSink) {
	userDecl := func(obj types.Object) bool {
		return obj != nil && !strings.HasSuffix(pkg.Fset.Position(obj.Pos()).Filename, FileName)
	}
	routes := map[string]*httpFunc{}
	for _, f := range m.https {
		var obj types.Object
		if f.recv != nil {
			obj, _, _ = types.LookupFieldOrMethod(f.recv, true, pkg.Types, f.handlerName())
		} else {
			obj = pkg.Types.Scope().Lookup(f.handlerName())
		}
		if userDecl(obj) {
			errs.add(f.pos, "//idem:http on %s generates %s, which %s already declares; rename one of them", f.name, f.handlerName(), errs.rel(pkg.Fset.Position(obj.Pos())))
		}
		if f.route != "" {
			if prev, dup := routes[f.route]; dup {
				errs.add(f.pos, "route %q is already served by %s", f.route, prev.name)
			}
			routes[f.route] = f
		}
	}
	if m.emitted[registerName] {
		if obj := pkg.Types.Scope().Lookup(registerName); userDecl(obj) {
			errs.add(pkg.Fset.Position(obj.Pos()), "%s is generated by idemgen for the routed //idem:http functions of this package; rename this declaration", registerName)
		}
	}
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

func firstWord(s string) string {
	if i := strings.IndexAny(s, " \t"); i >= 0 {
		return s[:i]
	}
	return s
}
