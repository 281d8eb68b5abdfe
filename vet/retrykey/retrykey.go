// Package retrykey reports a retry loop that sends an unsafe HTTP request
// (POST, PUT, PATCH, DELETE) without a stable Idempotency-Key: either no key
// at all, or a key created anew on every attempt. If a response is lost, the
// retry is a new operation to the server: a double charge.
package retrykey

import (
	"fmt"
	"go/ast"
	"go/constant"
	"go/token"
	"go/types"
	"regexp"
	"strings"

	"golang.org/x/tools/go/analysis"

	"github.com/idemgen/idemgen/vet/internal/vetutil"
)

// Analyzer is the retrykey check.
var Analyzer = &analysis.Analyzer{
	Name: "retrykey",
	Doc: `report retry loops that send unsafe HTTP requests without a stable Idempotency-Key

A loop that retries POST, PUT, PATCH or DELETE (http.Client.Do, Post, PostForm,
a RoundTripper's RoundTrip)
must send the same Idempotency-Key on every attempt, created once before the
loop. A key created inside the loop, or no key at all, makes every attempt a
new operation: a lost response followed by a retry charges twice.`,
	URL: "https://github.com/idemgen/idemgen#idemgen-vet",
	Run: run,
}

func run(pass *analysis.Pass) (any, error) {
	r := vetutil.NewReporter(pass)
	reported := map[token.Pos]bool{}
	vetutil.FuncBodies(pass, func(_ *ast.FuncDecl, _ *ast.FuncType, body *ast.BlockStmt) {
		c := &checker{pass: pass, r: r, body: body, reported: reported}
		vetutil.InspectShallow(body, func(n ast.Node) bool {
			if loop, ok := n.(ast.Stmt); ok && isLoop(loop) && c.isRetryLoop(loop) {
				c.checkLoop(loop)
			}
			return true
		})
	})
	return nil, nil
}

type checker struct {
	pass     *analysis.Pass
	r        *vetutil.Reporter
	body     *ast.BlockStmt // the whole function's
	reported map[token.Pos]bool
}

func isLoop(s ast.Stmt) bool {
	switch s.(type) {
	case *ast.ForStmt, *ast.RangeStmt:
		return true
	}
	return false
}

func loopBody(s ast.Stmt) *ast.BlockStmt {
	if f, ok := s.(*ast.ForStmt); ok {
		return f.Body
	}
	return s.(*ast.RangeStmt).Body
}

// retryWords in a loop's header suggest it repeats one operation.
var retryWords = regexp.MustCompile(`(?i)attempt|retr|tries|try`)

// isRetryLoop reports whether loop repeats one operation rather than walking
// a collection: it does not range over a slice, map, channel or iterator
// (nor count up to a len), and it waits between rounds, continues, or counts
// attempts.
func (c *checker) isRetryLoop(loop ast.Stmt) bool {
	var header []ast.Node
	switch l := loop.(type) {
	case *ast.RangeStmt:
		t := c.pass.TypesInfo.TypeOf(l.X)
		if t == nil {
			return false
		}
		if b, ok := t.Underlying().(*types.Basic); !ok || b.Info()&types.IsInteger == 0 {
			return false
		}
		header = []ast.Node{l.Key, l.X}
	case *ast.ForStmt:
		usesLen := false
		if l.Cond != nil {
			ast.Inspect(l.Cond, func(n ast.Node) bool {
				if call, ok := n.(*ast.CallExpr); ok {
					if id, ok := call.Fun.(*ast.Ident); ok && id.Name == "len" {
						usesLen = true
					}
				}
				return true
			})
		}
		if usesLen {
			return false
		}
		header = []ast.Node{l.Init, l.Cond, l.Post}
	}
	for _, h := range header {
		if h == nil || h == ast.Node(nil) {
			continue
		}
		found := false
		ast.Inspect(h, func(n ast.Node) bool {
			if id, ok := n.(*ast.Ident); ok && retryWords.MatchString(id.Name) {
				found = true
			}
			return !found
		})
		if found {
			return true
		}
	}
	signal := false
	vetutil.InspectShallow(loopBody(loop), func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.BranchStmt:
			if n.Tok == token.CONTINUE {
				signal = true
			}
		case *ast.CallExpr:
			if f := vetutil.Callee(c.pass.TypesInfo, n); f != nil {
				name := strings.ToLower(f.Name())
				if (f.Pkg() != nil && f.Pkg().Path() == "time" && (f.Name() == "Sleep" || f.Name() == "After" || f.Name() == "NewTimer")) ||
					strings.Contains(name, "backoff") || strings.Contains(name, "sleep") {
					signal = true
				}
			}
		}
		return !signal
	})
	return signal
}

// checkLoop reports each unsafe request sent in loop without a stable key.
func (c *checker) checkLoop(loop ast.Stmt) {
	vetutil.InspectShallow(loopBody(loop), func(n ast.Node) bool {
		call, ok := n.(*ast.CallExpr)
		if !ok || c.reported[call.Pos()] {
			return true
		}
		f := vetutil.Callee(c.pass.TypesInfo, call)
		switch {
		case vetutil.IsMethod(f, "net/http", "Client", "Post", "PostForm") || vetutil.IsFunc(f, "net/http", "Post") || vetutil.IsFunc(f, "net/http", "PostForm"):
			c.reported[call.Pos()] = true
			c.r.Report(call, fmt.Sprintf("retry loop sends POST with http %s, which cannot carry an Idempotency-Key: if a response is lost the retry runs the operation again (double charge); build the request with http.NewRequestWithContext and set an Idempotency-Key created once before the loop", f.Name()))
		case (vetutil.IsMethod(f, "net/http", "Client", "Do") || vetutil.IsMethod(f, "net/http", "RoundTripper", "RoundTrip") ||
			vetutil.IsMethod(f, "net/http", "Transport", "RoundTrip")) && len(call.Args) == 1:
			c.checkDo(loop, call)
		}
		return true
	})
}

func (c *checker) checkDo(loop ast.Stmt, do *ast.CallExpr) {
	info := c.pass.TypesInfo
	var newReq *ast.CallExpr // http.NewRequest[WithContext]
	var reqVar *types.Var
	switch arg := ast.Unparen(do.Args[0]).(type) {
	case *ast.CallExpr:
		newReq = arg
	case *ast.Ident:
		reqVar, _ = info.Uses[arg].(*types.Var)
		if reqVar == nil {
			return
		}
		newReq = c.lastAssign(reqVar, do.Pos())
	}
	if newReq == nil {
		return // built elsewhere: cannot tell its method
	}
	method, ok := requestMethod(info, newReq)
	if !ok || !unsafeMethod[strings.ToUpper(method)] {
		return
	}
	if c.forIdemClient(newReq) {
		return // idem's client sets a key derived from the operation
	}
	sets, unknown := c.keySets(reqVar)
	if unknown {
		return
	}
	if len(sets) == 0 {
		c.reported[do.Pos()] = true
		c.r.Report(do, fmt.Sprintf("retry loop sends %s without an Idempotency-Key header: if a response is lost the retry runs the operation again (double charge); create a key once before the loop and set it on every attempt", strings.ToUpper(method)))
		return
	}
	for _, s := range sets {
		if !vetutil.Encloses(loopBody(loop), s.call) || c.reported[s.call.Pos()] {
			continue
		}
		if fresh, byLoopVar := c.fresh(loop, s.value, 0); fresh {
			c.reported[s.call.Pos()] = true
			var fixes []analysis.SuggestedFix
			if !byLoopVar {
				fixes = c.hoist(loop, s.value)
			}
			c.r.Report(s.value, fmt.Sprintf("retry loop creates the Idempotency-Key of its %s inside the loop, so every attempt is a new operation to the server and a lost response followed by a retry charges twice; create the key once before the loop", strings.ToUpper(method)), fixes...)
		}
	}
}

var unsafeMethod = map[string]bool{"POST": true, "PUT": true, "PATCH": true, "DELETE": true}

func requestMethod(info *types.Info, call *ast.CallExpr) (string, bool) {
	f := vetutil.Callee(info, call)
	var arg ast.Expr
	switch {
	case vetutil.IsFunc(f, "net/http", "NewRequest") && len(call.Args) == 3:
		arg = call.Args[0]
	case vetutil.IsFunc(f, "net/http", "NewRequestWithContext") && len(call.Args) == 4:
		arg = call.Args[1]
	default:
		return "", false
	}
	tv, ok := info.Types[arg]
	if !ok || tv.Value == nil || tv.Value.Kind() != constant.String {
		return "", false
	}
	return constant.StringVal(tv.Value), true
}

// lastAssign returns the http.NewRequest call last assigned to v before pos
// in the function, or nil.
func (c *checker) lastAssign(v *types.Var, before token.Pos) *ast.CallExpr {
	var last *ast.CallExpr
	vetutil.InspectShallow(c.body, func(n ast.Node) bool {
		as, ok := n.(*ast.AssignStmt)
		if !ok || as.Pos() > before || len(as.Rhs) != 1 || len(as.Lhs) == 0 {
			return true
		}
		id, ok := as.Lhs[0].(*ast.Ident)
		if !ok || c.pass.TypesInfo.ObjectOf(id) != v {
			return true
		}
		if call, ok := ast.Unparen(as.Rhs[0]).(*ast.CallExpr); ok {
			last = call
		} else {
			last = nil
		}
		return true
	})
	return last
}

type keySet struct {
	call  *ast.CallExpr // req.Header.Set(...)
	value ast.Expr
}

var keyHeader = regexp.MustCompile(`(?i)idempotency`)

// keySets returns the calls that set an idempotency header on req
// (req.Header.Set/Add). unknown is true if req's header is replaced or
// handed elsewhere, so its key cannot be judged.
func (c *checker) keySets(req *types.Var) (sets []keySet, unknown bool) {
	if req == nil {
		return nil, false
	}
	info := c.pass.TypesInfo
	isReqHeader := func(e ast.Expr) bool {
		sel, ok := ast.Unparen(e).(*ast.SelectorExpr)
		if !ok || sel.Sel.Name != "Header" {
			return false
		}
		id, ok := ast.Unparen(sel.X).(*ast.Ident)
		return ok && info.Uses[id] == req
	}
	ast.Inspect(c.body, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.CallExpr:
			sel, ok := ast.Unparen(n.Fun).(*ast.SelectorExpr)
			if ok && isReqHeader(sel.X) && (sel.Sel.Name == "Set" || sel.Sel.Name == "Add") && len(n.Args) == 2 {
				if tv := info.Types[n.Args[0]]; tv.Value != nil && tv.Value.Kind() == constant.String && keyHeader.MatchString(constant.StringVal(tv.Value)) {
					sets = append(sets, keySet{call: n, value: n.Args[1]})
				} else if tv.Value == nil {
					unknown = true // a header name we cannot read
				}
				return true
			}
			// req handed to another function (not Do): it may set the key.
			f := vetutil.Callee(info, n)
			if vetutil.IsMethod(f, "net/http", "Client", "Do") || (f != nil && f.Name() == "RoundTrip") {
				return true
			}
			for _, a := range n.Args {
				if id, ok := ast.Unparen(a).(*ast.Ident); ok && info.Uses[id] == req {
					unknown = true
				}
				if isReqHeader(a) {
					unknown = true
				}
			}
		case *ast.AssignStmt:
			for _, l := range n.Lhs {
				if isReqHeader(l) {
					unknown = true // req.Header = h
				}
				if ix, ok := l.(*ast.IndexExpr); ok && isReqHeader(ix.X) {
					unknown = true // req.Header[k] = v
				}
			}
		}
		return true
	})
	return sets, unknown
}

// fresh reports whether e yields a new value on each round of loop: it calls
// a generator (a package function without arguments such as uuid.NewString,
// or anything from crypto/rand, math/rand or time.Now), or uses a variable
// the loop declares whose value is fresh, or the loop's counter. byLoopVar
// is true if it depends on the loop's counter, so hoisting is not a
// mechanical fix.
func (c *checker) fresh(loop ast.Stmt, e ast.Expr, depth int) (fresh, byLoopVar bool) {
	if depth > 4 {
		return false, false
	}
	info := c.pass.TypesInfo
	ast.Inspect(e, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.CallExpr:
			if f := vetutil.Callee(info, n); f != nil && generator(f, len(n.Args)) {
				fresh = true
			}
		case *ast.Ident:
			v, ok := info.Uses[n].(*types.Var)
			if !ok || !vetutil.Encloses(loop, identDecl(v)) || v.Pos() == token.NoPos {
				return true
			}
			// A variable of the loop: its counter, or declared in the body.
			if isCounter(loop, v) {
				fresh, byLoopVar = true, true
			} else if def := c.definition(v); def != nil {
				if f, counter := c.fresh(loop, def, depth+1); f {
					fresh, byLoopVar = true, byLoopVar || counter
				}
			}
		}
		return true
	})
	return fresh, byLoopVar
}

func identDecl(v *types.Var) ast.Node { return posNode(v.Pos()) }

type posNode token.Pos

func (p posNode) Pos() token.Pos { return token.Pos(p) }
func (p posNode) End() token.Pos { return token.Pos(p) + 1 }

func isCounter(loop ast.Stmt, v *types.Var) bool {
	switch l := loop.(type) {
	case *ast.ForStmt:
		return l.Init != nil && vetutil.Encloses(l.Init, posNode(v.Pos()))
	case *ast.RangeStmt:
		return l.Key != nil && vetutil.Encloses(l.Key, posNode(v.Pos()))
	}
	return false
}

// definition returns the expression v := expr defines v with, or nil.
func (c *checker) definition(v *types.Var) ast.Expr {
	var def ast.Expr
	vetutil.InspectShallow(c.body, func(n ast.Node) bool {
		as, ok := n.(*ast.AssignStmt)
		if !ok || def != nil || len(as.Lhs) != len(as.Rhs) {
			return def == nil
		}
		for i, l := range as.Lhs {
			if id, ok := l.(*ast.Ident); ok && c.pass.TypesInfo.Defs[id] == v {
				def = as.Rhs[i]
			}
		}
		return def == nil
	})
	return def
}

// generator reports whether calling f makes a new value each time.
func generator(f *types.Func, nargs int) bool {
	if f.Pkg() == nil {
		return false
	}
	switch f.Pkg().Path() {
	case "crypto/rand", "math/rand", "math/rand/v2":
		return true
	case "time":
		return f.Name() == "Now"
	}
	// uuid.New(), uuid.NewString(), ulid.Make(), idem.NewKey(): package
	// functions without arguments.
	return nargs == 0 && f.Type().(*types.Signature).Recv() == nil && f.Type().(*types.Signature).Params().Len() == 0
}

// hoist returns the fix that creates the key once before loop: it moves the
// statement k := expr defining the key variable, or names the inline
// expression.
func (c *checker) hoist(loop ast.Stmt, value ast.Expr) []analysis.SuggestedFix {
	fset := c.pass.Fset
	indent := strings.Repeat("\t", fset.Position(loop.Pos()).Column-1)
	src := func(n ast.Node) string {
		tf := fset.File(n.Pos())
		content, err := c.pass.ReadFile(tf.Name())
		if err != nil {
			return ""
		}
		return string(content[tf.Offset(n.Pos()):tf.Offset(n.End())])
	}
	if id, ok := ast.Unparen(value).(*ast.Ident); ok {
		v, _ := c.pass.TypesInfo.Uses[id].(*types.Var)
		if v == nil {
			return nil
		}
		// Only a statement directly in the loop body moves mechanically.
		for _, st := range loopBody(loop).List {
			as, ok := st.(*ast.AssignStmt)
			if !ok || len(as.Lhs) != 1 || len(as.Rhs) != 1 {
				continue
			}
			if lid, ok := as.Lhs[0].(*ast.Ident); ok && c.pass.TypesInfo.Defs[lid] == v {
				if as.Tok != token.DEFINE || c.usesLoopVars(loop, as.Rhs[0]) {
					return nil
				}
				text := src(as)
				if text == "" {
					return nil
				}
				tf := fset.File(as.Pos())
				start := tf.LineStart(tf.Line(as.Pos()))
				end := as.End()
				if l := tf.Line(as.End()); l < tf.LineCount() {
					end = tf.LineStart(l + 1)
				}
				return []analysis.SuggestedFix{{
					Message: "create the key once, before the loop",
					TextEdits: []analysis.TextEdit{
						{Pos: loop.Pos(), End: loop.Pos(), NewText: []byte(text + "\n" + indent)},
						{Pos: start, End: end},
					},
				}}
			}
		}
		return nil
	}
	text := src(value)
	if text == "" || c.usesLoopVars(loop, value) {
		return nil
	}
	name := "idempotencyKey"
	if scope := c.pass.Pkg.Scope().Innermost(loop.Pos()); scope != nil {
		if _, obj := scope.LookupParent(name, loop.Pos()); obj != nil {
			return nil
		}
	}
	return []analysis.SuggestedFix{{
		Message: "create the key once, before the loop",
		TextEdits: []analysis.TextEdit{
			{Pos: loop.Pos(), End: loop.Pos(), NewText: []byte(name + " := " + text + "\n" + indent)},
			{Pos: value.Pos(), End: value.End(), NewText: []byte(name)},
		},
	}}
}

// usesLoopVars reports whether e refers to a variable declared in loop, so
// it cannot move above it.
func (c *checker) usesLoopVars(loop ast.Stmt, e ast.Expr) bool {
	uses := false
	ast.Inspect(e, func(n ast.Node) bool {
		if id, ok := n.(*ast.Ident); ok {
			if v, ok := c.pass.TypesInfo.Uses[id].(*types.Var); ok && vetutil.Encloses(loop, posNode(v.Pos())) {
				uses = true
			}
		}
		return !uses
	})
	return uses
}

// idemPath is the runtime package whose client (idem.NewClient) sets the
// Idempotency-Key itself, derived from the operation and the call's name.
const idemPath = "github.com/idemgen/idemgen/runtime/idem"

// forIdemClient reports whether newReq's context comes from idem (e.g.
// idem.WithCallName): the request is meant for idem's client, which keys
// every attempt from the operation.
func (c *checker) forIdemClient(newReq *ast.CallExpr) bool {
	if !vetutil.IsFunc(vetutil.Callee(c.pass.TypesInfo, newReq), "net/http", "NewRequestWithContext") {
		return false
	}
	return c.mentionsIdem(newReq.Args[0], 0)
}

func (c *checker) mentionsIdem(e ast.Expr, depth int) bool {
	found := false
	ast.Inspect(e, func(n ast.Node) bool {
		id, ok := n.(*ast.Ident)
		if !ok || found {
			return !found
		}
		switch obj := c.pass.TypesInfo.Uses[id].(type) {
		case *types.Func:
			found = obj.Pkg() != nil && obj.Pkg().Path() == idemPath
		case *types.Var:
			if def := c.definition(obj); def != nil && depth < 4 {
				found = c.mentionsIdem(def, depth+1)
			}
		}
		return !found
	})
	return found
}
