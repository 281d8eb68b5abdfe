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
	e.f.ImportAlias(runtimePath, "idem")

	e.guards()
	for _, h := range m.https {
		e.httpHandler(h)
	}
	e.registerRoutes()
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
//		_ func(context.Context, pgx.Tx, Req) (Resp, error) = Func
//	)
//
// A changed signature then fails the build on this line, naming the function,
// instead of somewhere inside the runtime's generic code.
func (e *emitter) guards() {
	var defs []jen.Code
	for _, h := range e.m.https {
		params := []jen.Code{jen.Qual("context", "Context"), jen.Qual(pgxPath, "Tx"), e.typ(h.req)}
		var expr *jen.Statement
		if h.recv != nil {
			params = append([]jen.Code{e.recvType(h)}, params...)
			if h.ptrRecv {
				expr = jen.Parens(e.recvType(h)).Dot(h.name)
			} else {
				expr = jen.Add(e.recvType(h)).Dot(h.name)
			}
		} else {
			expr = jen.Id(h.name)
		}
		defs = append(defs, jen.Id("_").Func().Params(params...).Params(e.typ(h.resp), jen.Error()).Op("=").Add(expr))
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
	recv := h.recvName
	if recv == "" || recv == hParam {
		recv = "recv"
	}
	what := h.name
	if h.recv != nil {
		what = fmt.Sprintf("(%s).%s", typeString(e.recvTypeT(h), e.m.path), h.name)
	}
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
		fields = append(fields, field("Wait", jen.Qual(runtimePath, "NoWait")))
	} else {
		fields = append(fields, field("Wait", duration(h.wait)))
	}

	fn := jen.Id(h.name)
	decl := jen.Func()
	if h.recv != nil {
		fn = jen.Id(recv).Dot(h.name)
		decl = decl.Params(jen.Id(recv).Add(e.recvType(h)))
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
//		mux.Handle("POST /payments", paymentService.ChargeHandler(h))
//	}
//
// with one parameter per receiver type, in order of first appearance.
func (e *emitter) registerRoutes() {
	type recvParam struct {
		name string
		typ  *types.Named
		ptr  bool
	}
	var recvs []*recvParam
	byType := map[*types.Named]*recvParam{}
	taken := map[string]bool{"mux": true, "h": true}
	var body []jen.Code
	for _, h := range e.m.https {
		if h.route == "" {
			continue
		}
		target := jen.Id(h.handlerName())
		if h.recv != nil {
			p := byType[h.recv]
			if p == nil {
				p = &recvParam{name: paramName(h.recv.Obj().Name(), taken), typ: h.recv}
				byType[h.recv] = p
				recvs = append(recvs, p)
			}
			// *T has the methods of both T and *T.
			p.ptr = p.ptr || h.ptrRecv
			target = jen.Id(p.name).Dot(h.handlerName())
		}
		body = append(body, jen.Id("mux").Dot("Handle").Call(jen.Lit(h.route), target.Call(jen.Id("h"))))
	}
	if len(body) == 0 {
		return
	}
	params := []jen.Code{
		jen.Id("mux").Op("*").Qual("net/http", "ServeMux"),
		jen.Id("h").Op("*").Qual(runtimePath, "HTTP"),
	}
	for _, p := range recvs {
		t := jen.Qual(e.m.path, p.typ.Obj().Name())
		if p.ptr {
			t = jen.Op("*").Add(t)
		}
		params = append(params, jen.Id(p.name).Add(t))
	}
	e.f.Line()
	e.f.Commentf("%s registers every routed //idem:http handler of this package on mux.", registerName)
	e.f.Func().Id(registerName).Params(params...).Block(body...)
}

// recvType renders h's receiver type: T or *T.
func (e *emitter) recvType(h *httpFunc) jen.Code { return e.typ(e.recvTypeT(h)) }

func (e *emitter) recvTypeT(h *httpFunc) types.Type {
	if h.ptrRecv {
		return types.NewPointer(h.recv)
	}
	return h.recv
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
