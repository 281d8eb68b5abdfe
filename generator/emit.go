package generator

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/format"
	"go/parser"
	"go/token"
	"go/types"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/dave/jennifer/jen"
)

// emitter renders one generated file: the functions and types of one group
// of a package.
type emitter struct {
	m *pkgModel
	g *group
	f *jen.File

	// aliases maps an import path to the name generated code uses for it:
	// the package's own name unless that is taken by a package-level
	// declaration or a local of the generated code, then an alias.
	aliases map[string]string
	// locals are the names of the generated functions' parameters, chosen
	// not to shadow any package-level name or import the code refers to.
	locals map[string]string
}

// Local names the generated functions use, before renaming to avoid clashes.
var localNames = []string{"h", "mux", "ctx", "tx", "ev", "recv"}

// emit returns the formatted source of g's generated file. If gofmt rejects
// the output (a generator bug), it returns the raw source and the error.
func emit(m *pkgModel, g *group) ([]byte, error) {
	e := &emitter{m: m, g: g, f: jen.NewFilePathName(m.path, m.name), aliases: map[string]string{}, locals: map[string]string{}}
	e.f.HeaderComment(Header)
	taken := func(name string) bool {
		return m.scope.Lookup(name) != nil || m.imports[name] || token.IsKeyword(name)
	}
	for _, l := range localNames {
		name := l
		for i := 2; taken(name) || e.isLocal(name) || generatedImport[name]; i++ {
			name = l + strconv.Itoa(i)
		}
		e.locals[l] = name
	}

	e.guards()
	for _, h := range g.https {
		e.httpHandler(h)
	}
	e.registerRoutes()
	for _, c := range g.consumes {
		e.consumer(c)
	}
	e.consumerList()
	for _, t := range g.outboxes {
		e.enqueue(t)
	}

	// jennifer renders unformatted; finish formats once, after regrouping
	// the imports.
	var buf bytes.Buffer
	e.f.NoFormat = true
	if err := e.f.Render(&buf); err != nil {
		return buf.Bytes(), fmt.Errorf("render generated code for %s (an idemgen bug): %w", m.path, err)
	}
	src, err := finish(buf.Bytes(), g.buildLine())
	if err != nil {
		return buf.Bytes(), fmt.Errorf("generated code for %s does not gofmt (an idemgen bug): %w", m.path, err)
	}
	return src, nil
}

func (e *emitter) isLocal(name string) bool {
	for _, v := range e.locals {
		if v == name {
			return true
		}
	}
	return false
}

// generatedImport names the packages generated code itself imports; locals
// never take these names.
var generatedImport = map[string]bool{"context": true, "http": true, "time": true, "pgx": true, "strconv": true, "idem": true}

// Import paths generated code uses.
const (
	contextPath = "context"
	httpPath    = "net/http"
	timePath    = "time"
	strconvPath = "strconv"
)

// qual refers to name in the package at path, importing it under its own
// name, or under an alias if a package-level declaration (type http
// struct{}) or another import already uses that name.
func (e *emitter) qual(path, pkgName, name string) *jen.Statement {
	if path == e.m.path {
		return jen.Id(name)
	}
	if _, ok := e.aliases[path]; !ok {
		alias := pkgName
		used := func(a string) bool {
			if e.m.scope.Lookup(a) != nil || e.isLocal(a) || token.IsKeyword(a) {
				return true
			}
			for _, other := range e.aliases {
				if other == a {
					return true
				}
			}
			return false
		}
		for i := 2; used(alias); i++ {
			alias = pkgName + "pkg"
			if i > 2 {
				alias += strconv.Itoa(i - 1)
			}
		}
		e.aliases[path] = alias
		if alias == pkgName {
			e.f.ImportName(path, pkgName)
		} else {
			e.f.ImportAlias(path, alias)
		}
	}
	return jen.Qual(path, name)
}

func (e *emitter) ctxType() *jen.Statement { return e.qual(contextPath, "context", "Context") }
func (e *emitter) txType() *jen.Statement  { return e.qual(pgxPath, "pgx", "Tx") }
func (e *emitter) idem(name string) *jen.Statement {
	return e.qual(runtimePath, "idem", name)
}

// guards emits one compile-time assertion per wrapped function:
//
//	var (
//		_ func(*T, context.Context, pgx.Tx, Req) (Resp, error) = (*T).Method
//		_ func(context.Context, pgx.Tx, Event) error = Func
//	)
//
// A changed signature then fails the build on this line, naming the function,
// instead of somewhere inside the runtime's generic code.
func (e *emitter) guards() {
	var defs []jen.Code
	guard := func(w *wrapped, arg types.Type, results ...jen.Code) {
		params := []jen.Code{e.ctxType(), e.txType(), e.typ(arg)}
		expr := jen.Id(w.name)
		if w.recv != nil {
			params = append([]jen.Code{e.recvType(w)}, params...)
			if w.ptrRecv {
				expr = jen.Parens(e.recvType(w)).Dot(w.name)
			} else {
				expr = jen.Add(e.recvType(w)).Dot(w.name)
			}
		}
		defs = append(defs, jen.Id("_").Func().Params(params...).Params(results...).Op("=").Add(expr))
	}
	for _, h := range e.g.https {
		guard(&h.wrapped, h.req, e.typ(h.resp), jen.Error())
	}
	for _, c := range e.g.consumes {
		guard(&c.wrapped, c.event, jen.Error())
	}
	if len(defs) == 0 {
		return
	}
	e.f.Comment("The functions idemgen wrapped, with the shapes it generated code for. If one")
	e.f.Comment("changes, this file stops compiling here: run idemgen again.")
	e.f.Var().Defs(defs...)
}

// httpHandler emits the constructor of one //idem:http handler, with only
// the options the directive gives (the runtime owns the defaults):
//
//	// ChargeHandler serves POST /payments with (*PaymentService).Charge, once per idempotency key.
//	func (s *PaymentService) ChargeHandler(h *idem.HTTP) http.Handler {
//		return idem.Handle(h, idem.Endpoint{Scope: "...", Route: "POST /payments"}, s.Charge)
//	}
func (e *emitter) httpHandler(h *httpFunc) {
	hParam := e.locals["h"]
	recv := e.recvVar(&h.wrapped)
	serves := "serves requests"
	if h.route != "" {
		serves = "serves " + h.route
	}
	e.f.Line()
	e.f.Commentf("%s %s with %s, once per idempotency key.", h.handlerName(), serves, e.describe(&h.wrapped))
	for _, line := range h.bindingDoc() {
		e.f.Comment(line)
	}

	field := func(name string, value jen.Code) jen.Code { return jen.Id(name).Op(":").Add(value) }
	fields := []jen.Code{field("Scope", jen.Lit(h.scope))}
	if h.route != "" {
		fields = append(fields, field("Route", jen.Lit(h.route)))
	}
	if h.status != 0 {
		fields = append(fields, field("Status", jen.Lit(h.status)))
	}
	if h.ttl != 0 {
		fields = append(fields, field("TTL", e.duration(h.ttl)))
	}
	if h.header != "" {
		fields = append(fields, field("KeyHeader", jen.Lit(h.header)))
	}
	if h.keyOptional {
		fields = append(fields, field("KeyOptional", jen.True()))
	}
	if h.wait != nil {
		if *h.wait == 0 {
			fields = append(fields, field("NoWait", jen.True()))
		} else {
			fields = append(fields, field("Wait", e.duration(*h.wait)))
		}
	}

	fn := jen.Id(h.name)
	decl := jen.Func()
	if h.recv != nil {
		fn = jen.Id(recv).Dot(h.name)
		decl = decl.Params(jen.Id(recv).Add(e.recvType(&h.wrapped)))
	}
	decl.Id(h.handlerName()).Params(jen.Id(hParam).Op("*").Add(e.idem("HTTP"))).Add(e.qual(httpPath, "http", "Handler")).Block(
		jen.Return(e.idem("Handle").Call(
			jen.Id(hParam),
			e.idem("Endpoint").Custom(jen.Options{Open: "{", Close: "}", Separator: ",", Multi: true}, fields...),
			fn,
		)),
	)
	e.f.Add(decl)
}

// registerRoutes emits, when any function has a route:
//
//	// RegisterIdemRoutes registers every routed //idem:http handler of this package on mux.
//	func RegisterIdemRoutes(mux *http.ServeMux, h *idem.HTTP, paymentService *PaymentService) {
//		idem.HandleRoute(mux, "POST /payments", paymentService.ChargeHandler(h))
//	}
//
// with one parameter per receiver type, in order of first appearance
// (HandleRoute answers a wrong method with a problem+json 405).
func (e *emitter) registerRoutes() {
	mux, h := e.locals["mux"], e.locals["h"]
	rp := e.newRecvParams()
	var body []jen.Code
	for _, f := range e.g.https {
		if f.route == "" {
			continue
		}
		body = append(body, e.idem("HandleRoute").Call(jen.Id(mux), jen.Lit(f.route), rp.target(&f.wrapped, f.handlerName()).Call(jen.Id(h))))
	}
	if len(body) == 0 {
		return
	}
	params := append([]jen.Code{
		jen.Id(mux).Op("*").Add(e.qual(httpPath, "http", "ServeMux")),
		jen.Id(h).Op("*").Add(e.idem("HTTP")),
	}, rp.params(e)...)
	e.f.Line()
	e.f.Commentf("%s registers every routed //idem:http handler of %s on %s.", e.g.registerName, e.scopeDoc(), mux)
	e.f.Func().Id(e.g.registerName).Params(params...).Block(body...)
}

// scopeDoc says which handlers a package-level generated function covers.
func (e *emitter) scopeDoc() string {
	if e.g.expr == nil {
		return "this package"
	}
	return "this package's files built with " + e.g.expr.String()
}

// consumer emits the constructor of one //idem:consume handler:
//
//	// HandleOrderConfirmedConsumer consumes orders.confirmed with (*Billing).HandleOrderConfirmed,
//	// once per event id (ev.EventID) in context "billing".
//	func (b *Billing) HandleOrderConfirmedConsumer() idem.EventHandler {
//		return idem.Consume(idem.EventSpec[OrderConfirmed]{
//			Topic:   "orders.confirmed",
//			Context: "billing",
//			EventID: func(ev OrderConfirmed) string { return ev.EventID },
//		}, b.HandleOrderConfirmed)
//	}
func (e *emitter) consumer(c *consumeFunc) {
	recv := e.recvVar(&c.wrapped)
	ev := e.locals["ev"]
	e.f.Line()
	e.f.Commentf("%s consumes %s with %s,", c.consumerName(), c.topic, e.describe(&c.wrapped))
	if c.idField != nil {
		e.f.Commentf("once per event id (ev.%s) in context %q.", c.idField.name, c.context)
	} else {
		e.f.Commentf("once per event id (record header idem.EventIDHeader) in context %q.", c.context)
	}

	field := func(name string, value jen.Code) jen.Code { return jen.Id(name).Op(":").Add(value) }
	fields := []jen.Code{field("Topic", jen.Lit(c.topic)), field("Context", jen.Lit(c.context))}
	if c.idField != nil {
		fields = append(fields, field("EventID", jen.Func().Params(jen.Id(ev).Add(e.typ(c.event))).String().Block(
			jen.Return(e.stringOf(jen.Id(ev).Dot(c.idField.name), c.idField)),
		)))
	}
	if c.decode != "" {
		fields = append(fields, field("Decode", jen.Id(c.decode)))
	}
	fn := jen.Id(c.name)
	decl := jen.Func()
	if c.recv != nil {
		fn = jen.Id(recv).Dot(c.name)
		decl = decl.Params(jen.Id(recv).Add(e.recvType(&c.wrapped)))
	}
	decl.Id(c.consumerName()).Params().Add(e.idem("EventHandler")).Block(
		jen.Return(e.idem("Consume").Call(
			e.idem("EventSpec").Types(e.typ(c.event)).Custom(jen.Options{Open: "{", Close: "}", Separator: ",", Multi: true}, fields...),
			fn,
		)),
	)
	e.f.Add(decl)
}

// consumerList emits, when the group has consumers:
//
//	// IdemConsumers returns every //idem:consume handler of this package, for kafka.ConsumerConfig.Handlers.
//	func IdemConsumers(billing *Billing) []idem.EventHandler {
//		return []idem.EventHandler{billing.HandleOrderConfirmedConsumer()}
//	}
func (e *emitter) consumerList() {
	if len(e.g.consumes) == 0 {
		return
	}
	rp := e.newRecvParams()
	var items []jen.Code
	for _, c := range e.g.consumes {
		items = append(items, rp.target(&c.wrapped, c.consumerName()).Call())
	}
	e.f.Line()
	e.f.Commentf("%s returns every //idem:consume handler of %s, for kafka.ConsumerConfig.Handlers.", e.g.consumersName, e.scopeDoc())
	e.f.Func().Id(e.g.consumersName).Params(rp.params(e)...).Index().Add(e.idem("EventHandler")).Block(
		jen.Return(jen.Index().Add(e.idem("EventHandler")).Custom(jen.Options{Open: "{", Close: "}", Separator: ",", Multi: true}, items...)),
	)
}

// enqueue emits the outbox function of one //idem:outbox type:
//
//	// EnqueuePaymentCharged adds ev to the outbox in tx for topic billing.charged, keyed by ev.OrderID.
//	func EnqueuePaymentCharged(ctx context.Context, tx pgx.Tx, ev PaymentCharged) error {
//		return idem.Enqueue(ctx, tx, "billing.charged", ev.OrderID, ev)
//	}
func (e *emitter) enqueue(t *outboxType) {
	ctx, tx, ev := e.locals["ctx"], e.locals["tx"], e.locals["ev"]
	var key jen.Code = jen.Lit("")
	keyDoc := "without a partition key"
	if t.keyField != nil {
		key = e.stringOf(jen.Id(ev).Dot(t.keyField.name), t.keyField)
		keyDoc = "keyed by " + ev + "." + t.keyField.name
	}
	e.f.Line()
	e.f.Commentf("%s adds %s to the outbox in %s for topic %s, %s.", t.enqueueName(), ev, tx, t.topic, keyDoc)
	e.f.Func().Id(t.enqueueName()).Params(
		jen.Id(ctx).Add(e.ctxType()),
		jen.Id(tx).Add(e.txType()),
		jen.Id(ev).Add(e.typ(t.typ)),
	).Error().Block(
		jen.Return(e.idem("Enqueue").Call(jen.Id(ctx), jen.Id(tx), jen.Lit(t.topic), key, jen.Id(ev))),
	)
}

// stringOf renders v, the field f, as a string expression, converting only
// where the types need it: strconv.Itoa(v) for an int,
// strconv.FormatInt(int64(v), 10) for a named integer type.
func (e *emitter) stringOf(v *jen.Statement, f *fieldRef) jen.Code {
	switch f.conv {
	case convStringer:
		return v.Dot("String").Call()
	case convInt:
		switch {
		case types.Identical(f.typ, types.Typ[types.Int]):
			return e.qual(strconvPath, "strconv", "Itoa").Call(v)
		case types.Identical(f.typ, types.Typ[types.Int64]):
			return e.qual(strconvPath, "strconv", "FormatInt").Call(v, jen.Lit(10))
		}
		return e.qual(strconvPath, "strconv", "FormatInt").Call(jen.Int64().Call(v), jen.Lit(10))
	case convUint:
		if types.Identical(f.typ, types.Typ[types.Uint64]) {
			return e.qual(strconvPath, "strconv", "FormatUint").Call(v, jen.Lit(10))
		}
		return e.qual(strconvPath, "strconv", "FormatUint").Call(jen.Uint64().Call(v), jen.Lit(10))
	case convIdentity:
		return v
	default:
		return jen.String().Call(v)
	}
}

// recvParams collects one parameter per receiver type for a generated
// package-level function (RegisterIdemRoutes, IdemConsumers).
type recvParams struct {
	list   []*recvParam
	byType map[*types.Named]*recvParam
	taken  func(string) bool
	names  map[string]bool
}

type recvParam struct {
	name string
	typ  *types.Named
	ptr  bool
}

func (e *emitter) newRecvParams() *recvParams {
	rp := &recvParams{byType: map[*types.Named]*recvParam{}, names: map[string]bool{}}
	rp.taken = func(name string) bool {
		if rp.names[name] || e.isLocal(name) || token.IsKeyword(name) || e.m.scope.Lookup(name) != nil || generatedImport[name] || e.m.imports[name] {
			return true
		}
		for _, a := range e.aliases {
			if a == name {
				return true
			}
		}
		return false
	}
	return rp
}

// target returns the expression naming the generated method or function
// name of w, adding a parameter for w's receiver type if needed.
func (rp *recvParams) target(w *wrapped, name string) *jen.Statement {
	if w.recv == nil {
		return jen.Id(name)
	}
	p := rp.byType[w.recv]
	if p == nil {
		p = &recvParam{name: rp.paramName(w), typ: w.recv}
		rp.byType[w.recv] = p
		rp.list = append(rp.list, p)
	}
	// *T has the methods of both T and *T.
	p.ptr = p.ptr || w.ptrRecv
	return jen.Id(p.name).Dot(name)
}

func (rp *recvParams) params(e *emitter) []jen.Code {
	var out []jen.Code
	for _, p := range rp.list {
		t := e.qual(e.m.path, e.m.name, p.typ.Obj().Name())
		if p.ptr {
			t = jen.Op("*").Add(t)
		}
		out = append(out, jen.Id(p.name).Add(t))
	}
	return out
}

// paramName names the parameter for w's receiver type: the type's name
// with its first word lower-cased (paymentService, httpServer). When that is
// the type's own name (an unexported type, svc) or a keyword, it is the
// receiver name of the user's method, else the type's first letter. A digit
// is appended if the name is taken.
func (rp *recvParams) paramName(w *wrapped) string {
	typeName := w.recv.Obj().Name()
	r := []rune(typeName)
	for i := 0; i < len(r) && unicode.IsUpper(r[i]); i++ {
		// HTTPServer → httpServer: lower the leading run of capitals except
		// the one that starts the next word.
		if i > 0 && i+1 < len(r) && unicode.IsLower(r[i+1]) {
			break
		}
		r[i] = unicode.ToLower(r[i])
	}
	base := string(r)
	if base == typeName || token.IsKeyword(base) {
		base = w.recvName
		if base == "" || base == typeName {
			base = string(unicode.ToLower(r[0]))
		}
	}
	name := base
	for i := 2; rp.taken(name); i++ {
		name = base + strconv.Itoa(i)
	}
	rp.names[name] = true
	return name
}

// recvVar is the receiver's variable name in a generated method: the user's
// own, unless absent or clashing with a name the method uses.
func (e *emitter) recvVar(w *wrapped) string {
	n := w.recvName
	if n == "" || e.isLocal(n) || generatedImport[n] || e.m.imports[n] {
		return e.locals["recv"]
	}
	for _, a := range e.aliases {
		if a == n {
			return e.locals["recv"]
		}
	}
	return n
}

// describe names w for a comment: Func, (*T).Method or T.Method.
func (e *emitter) describe(w *wrapped) string {
	if w.recv == nil {
		return w.name
	}
	if w.ptrRecv {
		return fmt.Sprintf("(*%s).%s", w.recv.Obj().Name(), w.name)
	}
	return w.recv.Obj().Name() + "." + w.name
}

// recvType renders w's receiver type: T or *T.
func (e *emitter) recvType(w *wrapped) jen.Code {
	t := jen.Id(w.recv.Obj().Name())
	if w.ptrRecv {
		return jen.Op("*").Add(t)
	}
	return t
}

// typ renders a Go type, importing the packages it needs. The model stage
// (unnameable) has rejected every type this cannot spell.
func (e *emitter) typ(t types.Type) jen.Code {
	switch t := t.(type) {
	case *types.Alias:
		if obj := t.Obj(); obj.Pkg() != nil && (obj.Exported() || obj.Pkg().Path() == e.m.path) {
			s := e.qual(obj.Pkg().Path(), obj.Pkg().Name(), obj.Name())
			if args := t.TypeArgs(); args.Len() > 0 {
				s = s.Types(e.typeList(args)...)
			}
			return s
		}
		if t.Obj().Pkg() == nil && t.Obj().Name() == "any" {
			return jen.Any()
		}
		return e.typ(types.Unalias(t))
	case *types.Named:
		obj := t.Obj()
		if obj.Pkg() == nil { // error
			return jen.Id(obj.Name())
		}
		s := e.qual(obj.Pkg().Path(), obj.Pkg().Name(), obj.Name())
		if args := t.TypeArgs(); args.Len() > 0 {
			s = s.Types(e.typeList(args)...)
		}
		return s
	case *types.Basic:
		return jen.Id(t.Name())
	case *types.Pointer:
		return jen.Op("*").Add(e.typ(t.Elem()))
	case *types.Slice:
		return jen.Index().Add(e.typ(t.Elem()))
	case *types.Array:
		return jen.Index(jen.Lit(int(t.Len()))).Add(e.typ(t.Elem()))
	case *types.Map:
		return jen.Map(e.typ(t.Key())).Add(e.typ(t.Elem()))
	case *types.Interface:
		if t.Empty() {
			return jen.Any()
		}
	case *types.Struct:
		if t.NumFields() == 0 {
			return jen.Struct()
		}
	}
	panic(fmt.Sprintf("idemgen: type %s passed the model stage but cannot be rendered", t))
}

func (e *emitter) typeList(l *types.TypeList) []jen.Code {
	codes := make([]jen.Code, l.Len())
	for i := range codes {
		codes[i] = e.typ(l.At(i))
	}
	return codes
}

// duration renders d as a readable constant expression: 24 * time.Hour.
func (e *emitter) duration(d time.Duration) jen.Code {
	units := []struct {
		d    time.Duration
		name string
	}{{time.Hour, "Hour"}, {time.Minute, "Minute"}, {time.Second, "Second"}, {time.Millisecond, "Millisecond"}}
	for _, u := range units {
		if d%u.d == 0 {
			n := int64(d / u.d)
			if n == 1 {
				return e.qual(timePath, "time", u.name)
			}
			return jen.Lit(int(n)).Op("*").Add(e.qual(timePath, "time", u.name))
		}
	}
	return e.qual(timePath, "time", "Duration").Call(jen.Lit(int64(d)))
}

// finish adds the build constraint below the header and groups the imports
// the way goimports does (standard library, a blank line, the rest), which
// jennifer does not; it returns gofmt'ed source.
func finish(src []byte, buildLine string) ([]byte, error) {
	header := "// " + Header + "\n"
	if !bytes.HasPrefix(src, []byte(header)) {
		return nil, fmt.Errorf("rendered file does not start with the header")
	}
	src = append([]byte(header+"\n"+buildLine+"\n\n"), bytes.TrimLeft(src[len(header):], "\n")...)

	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "", src, parser.ParseComments|parser.ImportsOnly)
	if err != nil {
		return nil, err
	}
	var decl *ast.GenDecl
	for _, d := range f.Decls {
		if gd, ok := d.(*ast.GenDecl); ok && gd.Tok == token.IMPORT {
			decl = gd
			break
		}
	}
	if decl == nil {
		return format.Source(src)
	}
	var std, other []string
	for _, s := range decl.Specs {
		spec := s.(*ast.ImportSpec)
		line := spec.Path.Value
		if spec.Name != nil {
			line = spec.Name.Name + " " + line
		}
		path, _ := strconv.Unquote(spec.Path.Value)
		if first, _, _ := strings.Cut(path, "/"); strings.Contains(first, ".") {
			other = append(other, line)
		} else {
			std = append(std, line)
		}
	}
	byPath := func(l []string) {
		sort.Slice(l, func(i, j int) bool {
			return l[i][strings.Index(l[i], `"`):] < l[j][strings.Index(l[j], `"`):]
		})
	}
	byPath(std)
	byPath(other)
	var b strings.Builder
	b.WriteString("import (\n")
	for _, l := range std {
		b.WriteString("\t" + l + "\n")
	}
	if len(std) > 0 && len(other) > 0 {
		b.WriteString("\n")
	}
	for _, l := range other {
		b.WriteString("\t" + l + "\n")
	}
	b.WriteString(")")
	start, end := fset.Position(decl.Pos()).Offset, fset.Position(decl.End()).Offset
	out := append(append(append([]byte{}, src[:start]...), b.String()...), src[end:]...)
	return format.Source(out)
}

// typeString renders t as Go source would inside package pkgPath.
func typeString(t types.Type, pkgPath string) string {
	return types.TypeString(t, func(p *types.Package) string {
		if p.Path() == pkgPath {
			return ""
		}
		return p.Name()
	})
}
