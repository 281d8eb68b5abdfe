package generator

import (
	"bytes"
	"fmt"
	"go/token"
	"go/types"
	"time"
	"unicode"

	"github.com/dave/jennifer/jen"
)

// emitter renders one package's idem_gen.go.
type emitter struct {
	m   *pkgModel
	f   *jen.File
	err error // the first type that cannot be rendered
}

// emit returns the formatted source of m's generated file. If gofmt rejects
// the output (a generator bug), it returns the raw source and the error.
func emit(m *pkgModel) ([]byte, error) {
	e := &emitter{m: m, f: jen.NewFilePathName(m.path, m.name)}
	e.f.HeaderComment(Header)
	e.f.ImportName("context", "context")
	e.f.ImportName("net/http", "http")
	e.f.ImportName("time", "time")
	e.f.ImportName(pgxPath, "pgx")
	e.f.ImportName("fmt", "fmt")
	e.f.ImportName("strconv", "strconv")
	e.f.ImportName(runtimePath, "idem")

	e.guards()
	for _, h := range m.https {
		e.httpHandler(h)
	}
	e.registerRoutes()
	for _, c := range m.consumes {
		e.consumer(c)
	}
	e.consumerList()
	for _, t := range m.outboxes {
		e.enqueue(t)
	}
	if e.err != nil {
		return nil, e.err
	}

	var buf bytes.Buffer
	if err := e.f.Render(&buf); err != nil {
		buf.Reset()
		e.f.NoFormat = true
		_ = e.f.Render(&buf)
		return buf.Bytes(), fmt.Errorf("generated code for %s does not gofmt (an idemgen bug): %w", m.path, err)
	}
	return buf.Bytes(), nil
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
		params := []jen.Code{jen.Qual("context", "Context"), jen.Qual(pgxPath, "Tx"), e.typ(arg)}
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
	for _, h := range e.m.https {
		guard(&h.wrapped, h.req, e.typ(h.resp), jen.Error())
	}
	for _, c := range e.m.consumes {
		guard(&c.wrapped, c.event, jen.Error())
	}
	if len(defs) == 0 {
		return
	}
	e.f.Comment("The functions idemgen wrapped, with the shapes it generated code for. If one")
	e.f.Comment("changes, this file stops compiling here: run go generate again.")
	e.f.Var().Defs(defs...)
}

// httpHandler emits the constructor of one //idem:http handler:
//
//	// ChargeHandler serves POST /payments with (*PaymentService).Charge ...
//	func (s *PaymentService) ChargeHandler(h *idem.HTTP) http.Handler {
//		return idem.Handle(h, idem.Endpoint{Scope: "...", ...}, s.Charge)
//	}
func (e *emitter) httpHandler(h *httpFunc) {
	hParam := "h"
	recv := recvVar(&h.wrapped, hParam)
	what := e.describe(&h.wrapped)
	serves := "serves requests"
	if h.route != "" {
		serves = "serves " + h.route
	}
	e.f.Line()
	e.f.Commentf("%s %s with %s.", h.handlerName(), serves, what)
	e.f.Commentf("Each %s value runs it once: the key claim, the call and the stored", h.header)
	e.f.Comment("response commit in one transaction, and a repeated request replays the")
	e.f.Comment("stored response without calling it.")

	field := func(name string, value jen.Code) jen.Code { return jen.Id(name).Op(":").Add(value) }
	fields := []jen.Code{field("Scope", jen.Lit(h.scope))}
	if h.route != "" {
		fields = append(fields, field("Route", jen.Lit(h.route)))
	}
	fields = append(fields,
		field("Status", jen.Lit(h.status)),
		field("TTL", duration(h.ttl)),
		field("KeyHeader", jen.Lit(h.header)),
	)
	if h.keyOptional {
		fields = append(fields, field("KeyOptional", jen.True()))
	}
	if h.wait == 0 {
		fields = append(fields, field("NoWait", jen.True()))
	} else {
		fields = append(fields, field("Wait", duration(h.wait)))
	}

	fn := jen.Id(h.name)
	decl := jen.Func()
	if h.recv != nil {
		fn = jen.Id(recv).Dot(h.name)
		decl = decl.Params(jen.Id(recv).Add(e.recvType(&h.wrapped)))
	}
	decl.Id(h.handlerName()).Params(jen.Id(hParam).Op("*").Qual(runtimePath, "HTTP")).Qual("net/http", "Handler").Block(
		jen.Return(jen.Qual(runtimePath, "Handle").Call(
			jen.Id(hParam),
			jen.Qual(runtimePath, "Endpoint").Custom(jen.Options{Open: "{", Close: "}", Separator: ",", Multi: true}, fields...),
			fn,
		)),
	)
	e.f.Add(decl)
}

// registerRoutes emits, when any function has a route:
//
//	// RegisterIdemRoutes registers ...
//	func RegisterIdemRoutes(mux *http.ServeMux, h *idem.HTTP, paymentService *PaymentService) {
//		idem.HandleRoute(mux, "POST /payments", paymentService.ChargeHandler(h))
//	}
//
// with one parameter per receiver type, in order of first appearance
// (HandleRoute answers a wrong method with a problem+json 405).
func (e *emitter) registerRoutes() {
	rp := newRecvParams("mux", "h")
	var body []jen.Code
	for _, h := range e.m.https {
		if h.route == "" {
			continue
		}
		body = append(body, jen.Qual(runtimePath, "HandleRoute").Call(jen.Id("mux"), jen.Lit(h.route), rp.target(&h.wrapped, h.handlerName()).Call(jen.Id("h"))))
	}
	if len(body) == 0 {
		return
	}
	params := append([]jen.Code{
		jen.Id("mux").Op("*").Qual("net/http", "ServeMux"),
		jen.Id("h").Op("*").Qual(runtimePath, "HTTP"),
	}, rp.params(e)...)
	e.f.Line()
	e.f.Commentf("%s registers every routed //idem:http handler of this package on mux.", registerName)
	e.f.Func().Id(registerName).Params(params...).Block(body...)
}

// consumer emits the constructor of one //idem:consume handler:
//
//	// HandleOrderConfirmedConsumer consumes orders.confirmed with ...
//	func (b *Billing) HandleOrderConfirmedConsumer() idem.EventHandler {
//		return idem.Consume(idem.EventSpec[OrderConfirmed]{
//			Topic:   "orders.confirmed",
//			Context: "billing",
//			EventID: func(ev OrderConfirmed) string { return ev.EventID },
//		}, b.HandleOrderConfirmed)
//	}
func (e *emitter) consumer(c *consumeFunc) {
	recv := recvVar(&c.wrapped, "ev")
	idFrom := fmt.Sprintf("the %s record header", "idem-event-id")
	if c.idField != nil {
		idFrom = "ev." + c.idField.name
	}
	e.f.Line()
	e.f.Commentf("%s consumes %s with %s.", c.consumerName(), c.topic, e.describe(&c.wrapped))
	e.f.Commentf("Each event id (%s) is applied once in context %q:", idFrom, c.context)
	e.f.Comment("the processed-event row and the function's writes commit in one")
	e.f.Comment("transaction, and a duplicate is skipped.")

	field := func(name string, value jen.Code) jen.Code { return jen.Id(name).Op(":").Add(value) }
	fields := []jen.Code{field("Topic", jen.Lit(c.topic)), field("Context", jen.Lit(c.context))}
	if c.idField != nil {
		fields = append(fields, field("EventID", jen.Func().Params(jen.Id("ev").Add(e.typ(c.event))).String().Block(
			jen.Return(stringOf(jen.Id("ev").Dot(c.idField.name), c.idField.conv)),
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
	decl.Id(c.consumerName()).Params().Qual(runtimePath, "EventHandler").Block(
		jen.Return(jen.Qual(runtimePath, "Consume").Call(
			jen.Qual(runtimePath, "EventSpec").Types(e.typ(c.event)).Custom(jen.Options{Open: "{", Close: "}", Separator: ",", Multi: true}, fields...),
			fn,
		)),
	)
	e.f.Add(decl)
}

// consumerList emits, when the package has consumers:
//
//	// IdemConsumers returns every //idem:consume handler of this package ...
//	func IdemConsumers(billing *Billing) []idem.EventHandler {
//		return []idem.EventHandler{billing.HandleOrderConfirmedConsumer()}
//	}
func (e *emitter) consumerList() {
	if len(e.m.consumes) == 0 {
		return
	}
	rp := newRecvParams()
	var items []jen.Code
	for _, c := range e.m.consumes {
		items = append(items, rp.target(&c.wrapped, c.consumerName()).Call())
	}
	e.f.Line()
	e.f.Commentf("%s returns every //idem:consume handler of this package, for", consumersName)
	e.f.Comment("kafka.ConsumerConfig.Handlers (github.com/idemgen/idemgen/runtime/kafka).")
	e.f.Func().Id(consumersName).Params(rp.params(e)...).Index().Qual(runtimePath, "EventHandler").Block(
		jen.Return(jen.Index().Qual(runtimePath, "EventHandler").Custom(jen.Options{Open: "{", Close: "}", Separator: ",", Multi: true}, items...)),
	)
}

// enqueue emits the outbox function of one //idem:outbox type:
//
//	// EnqueuePaymentCharged adds ev to the outbox in tx ...
//	func EnqueuePaymentCharged(ctx context.Context, tx pgx.Tx, ev PaymentCharged) error {
//		return idem.Enqueue(ctx, tx, "billing.charged", ev.OrderID, ev)
//	}
func (e *emitter) enqueue(t *outboxType) {
	var key jen.Code = jen.Lit("")
	keyDoc := "no partition key"
	if t.keyField != nil {
		key = stringOf(jen.Id("ev").Dot(t.keyField.name), t.keyField.conv)
		keyDoc = "partition key ev." + t.keyField.name
	}
	e.f.Line()
	e.f.Commentf("%s adds ev to the outbox in tx, for topic %s,", t.enqueueName(), t.topic)
	e.f.Commentf("%s. The relay publishes it after tx commits, and never", keyDoc)
	e.f.Comment("if tx rolls back.")
	e.f.Func().Id(t.enqueueName()).Params(
		jen.Id("ctx").Qual("context", "Context"),
		jen.Id("tx").Qual(pgxPath, "Tx"),
		jen.Id("ev").Add(e.typ(t.typ)),
	).Error().Block(
		jen.Return(jen.Qual(runtimePath, "Enqueue").Call(jen.Id("ctx"), jen.Id("tx"), jen.Lit(t.topic), key, jen.Id("ev"))),
	)
}

// stringOf renders v as a string expression according to conv.
func stringOf(v *jen.Statement, conv fieldConv) jen.Code {
	switch conv {
	case convStringer:
		return v.Dot("String").Call()
	case convInt:
		return jen.Qual("strconv", "FormatInt").Call(jen.Int64().Call(v), jen.Lit(10))
	case convUint:
		return jen.Qual("strconv", "FormatUint").Call(jen.Uint64().Call(v), jen.Lit(10))
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
	taken  map[string]bool
}

type recvParam struct {
	name string
	typ  *types.Named
	ptr  bool
}

func newRecvParams(reserved ...string) *recvParams {
	rp := &recvParams{byType: map[*types.Named]*recvParam{}, taken: map[string]bool{}}
	for _, r := range reserved {
		rp.taken[r] = true
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
		p = &recvParam{name: paramName(w.recv.Obj().Name(), rp.taken), typ: w.recv}
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
		t := jen.Qual(e.m.path, p.typ.Obj().Name())
		if p.ptr {
			t = jen.Op("*").Add(t)
		}
		out = append(out, jen.Id(p.name).Add(t))
	}
	return out
}

// recvVar is the receiver's variable name in a generated method: the user's
// own, unless absent or clashing with another name the method uses.
func recvVar(w *wrapped, clash string) string {
	if w.recvName == "" || w.recvName == clash {
		return "recv"
	}
	return w.recvName
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
	t := jen.Qual(e.m.path, w.recv.Obj().Name())
	if w.ptrRecv {
		return jen.Op("*").Add(t)
	}
	return t
}

// typ renders a Go type, registering the imports it needs under each
// package's own name.
func (e *emitter) typ(t types.Type) jen.Code {
	switch t := t.(type) {
	case *types.Alias:
		if obj := t.Obj(); obj.Pkg() != nil && (obj.Exported() || obj.Pkg().Path() == e.m.path) {
			e.f.ImportName(obj.Pkg().Path(), obj.Pkg().Name())
			return jen.Qual(obj.Pkg().Path(), obj.Name())
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
		e.f.ImportName(obj.Pkg().Path(), obj.Pkg().Name())
		s := jen.Qual(obj.Pkg().Path(), obj.Name())
		if args := t.TypeArgs(); args.Len() > 0 {
			codes := make([]jen.Code, args.Len())
			for i := range codes {
				codes[i] = e.typ(args.At(i))
			}
			s = s.Types(codes...)
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
	if e.err == nil {
		e.err = fmt.Errorf("idemgen cannot name type %s in generated code; use a named type", t)
	}
	return jen.Null()
}

// duration renders d as a readable constant expression: 24 * time.Hour.
func duration(d time.Duration) jen.Code {
	units := []struct {
		d    time.Duration
		name string
	}{{time.Hour, "Hour"}, {time.Minute, "Minute"}, {time.Second, "Second"}, {time.Millisecond, "Millisecond"}}
	for _, u := range units {
		if d%u.d == 0 {
			n := int64(d / u.d)
			if n == 1 {
				return jen.Qual("time", u.name)
			}
			return jen.Lit(int(n)).Op("*").Qual("time", u.name)
		}
	}
	return jen.Qual("time", "Duration").Call(jen.Lit(int64(d)))
}

// paramName lower-cases the first letter of a type name for a parameter,
// avoiding keywords and names already taken.
func paramName(typeName string, taken map[string]bool) string {
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
	if token.IsKeyword(base) || base == typeName {
		base += "Svc"
	}
	name := base
	for i := 2; taken[name]; i++ {
		name = fmt.Sprintf("%s%d", base, i)
	}
	taken[name] = true
	return name
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
