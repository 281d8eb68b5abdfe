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
loop. A key created inside the loop (or renewed by it), or no key at all, makes
every attempt a new operation: a lost response followed by a retry charges
twice. A function literal handed to a retry helper (retry.Do, backoff.Retry)
and a backward goto count as loops. A request with a body built before the
loop and resent is reported too: the first attempt consumes the body.`,
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
			// retry: ... goto retry is a loop too.
			if blk, ok := n.(*ast.BlockStmt); ok {
				for _, region := range gotoLoops(blk) {
					if c.isRetryLoop(region) {
						c.checkLoop(region)
					}
				}
			}
			// A function handed to a retry helper (retry.Do, backoff.Retry,
			// a local withRetry) runs once per attempt: it is the loop's body.
			if call, ok := n.(*ast.CallExpr); ok && retryHelper(pass.TypesInfo, call) {
				for _, a := range call.Args {
					if lit := c.funcLit(a); lit != nil {
						cc := &checker{pass: pass, r: r, body: lit.Body, reported: reported}
						cc.checkLoop(lit)
					}
				}
			}
			return true
		})
	})
	return nil, nil
}

// gotoLoops returns, for each label in blk that a later goto jumps back
// to, the statements from the label to the one holding the goto, as a block
// that stands for the loop they make.
func gotoLoops(blk *ast.BlockStmt) []ast.Stmt {
	var loops []ast.Stmt
	for i, st := range blk.List {
		l, ok := st.(*ast.LabeledStmt)
		if !ok {
			continue
		}
		last := -1
		for j := i; j < len(blk.List); j++ {
			vetutil.InspectShallow(blk.List[j], func(n ast.Node) bool {
				if b, ok := n.(*ast.BranchStmt); ok && b.Tok == token.GOTO && b.Label != nil && b.Label.Name == l.Label.Name {
					last = j
				}
				return true
			})
		}
		if last >= 0 {
			loops = append(loops, &ast.BlockStmt{Lbrace: l.Pos(), List: blk.List[i : last+1], Rbrace: blk.List[last].End() - 1})
		}
	}
	return loops
}

func isGotoLoop(loop ast.Node) bool {
	_, ok := loop.(*ast.BlockStmt)
	return ok
}

// helperName matches the functions (and their packages) that call a function
// repeatedly until it succeeds: avast/retry-go's retry.Do, cenkalti/backoff's
// Retry, sethvargo/go-retry, a service's own withRetry.
var helperName = regexp.MustCompile(`(?i)retry|retries|retrier|backoff`)

func retryHelper(info *types.Info, call *ast.CallExpr) bool {
	f := vetutil.Callee(info, call)
	if f == nil {
		return false
	}
	return helperName.MatchString(f.Name()) || (f.Pkg() != nil && helperName.MatchString(f.Pkg().Path()))
}

// funcLit returns the function literal e is, or the one the local variable e
// is defined with (op := func() error {...}; backoff.Retry(op, b)).
func (c *checker) funcLit(e ast.Expr) *ast.FuncLit {
	switch e := ast.Unparen(e).(type) {
	case *ast.FuncLit:
		return e
	case *ast.Ident:
		if v, ok := c.pass.TypesInfo.Uses[e].(*types.Var); ok {
			if lit, ok := ast.Unparen(c.definition(v)).(*ast.FuncLit); ok {
				return lit
			}
		}
	}
	return nil
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

// loopBody returns the body of a loop, or of a function literal that a retry
// helper calls once per attempt.
func loopBody(s ast.Node) *ast.BlockStmt {
	switch s := s.(type) {
	case *ast.ForStmt:
		return s.Body
	case *ast.FuncLit:
		return s.Body
	case *ast.BlockStmt: // a goto loop
		return s
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
	// In a bare for {} a continue alone does not make a retry loop: an event
	// loop skips a bad message with continue and sends the next one.
	bare := false
	if f, ok := loop.(*ast.ForStmt); ok && f.Init == nil && f.Cond == nil && f.Post == nil {
		bare = true
	}
	if _, ok := loop.(*ast.BlockStmt); ok {
		bare = true // a goto loop has no header either
	}
	signal := false
	vetutil.InspectShallow(loopBody(loop), func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.BranchStmt:
			if n.Tok == token.CONTINUE && !bare {
				signal = true
			}
		case *ast.IncDecStmt:
			// attempts++ in the body counts attempts as a header would.
			if id, ok := ast.Unparen(n.X).(*ast.Ident); ok && n.Tok == token.INC && retryWords.MatchString(id.Name) {
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
func (c *checker) checkLoop(loop ast.Node) {
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

func (c *checker) checkDo(loop ast.Node, do *ast.CallExpr) {
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
	method, ok := c.requestMethod(newReq)
	if !ok || !unsafeMethod[strings.ToUpper(method)] {
		return
	}
	if c.forIdemClient(newReq) {
		return // idem's client sets a key derived from the operation
	}
	c.checkReused(loop, do, newReq, reqVar, method)
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
		if c.reported[s.call.Pos()] || c.reported[s.value.Pos()] {
			continue
		}
		if vetutil.Encloses(loopBody(loop), s.call) {
			if fresh, byLoopVar := c.fresh(loop, s.value, 0); fresh {
				c.reported[s.call.Pos()] = true
				var fixes []analysis.SuggestedFix
				if stmt, ok := loop.(ast.Stmt); ok && !byLoopVar && !isGotoLoop(loop) {
					fixes = c.hoist(stmt, s.value)
				}
				c.r.Report(s.value, fmt.Sprintf("retry loop creates the Idempotency-Key of its %s inside the loop, so every attempt is a new operation to the server and a lost response followed by a retry charges twice; create the key once before the loop", strings.ToUpper(method)), fixes...)
				continue
			}
		}
		// Created before the loop, but renewed by it (under a condition,
		// or in a struct field).
		if c.reassigned(loop, s.value) {
			c.reported[s.value.Pos()] = true
			c.r.Report(s.value, fmt.Sprintf("retry loop assigns a new value to the Idempotency-Key of its %s inside the loop, so the attempts after it are new operations to the server and a lost response followed by a retry charges twice; keep the key created once before the loop", strings.ToUpper(method)))
		}
	}
}

// reassigned reports whether the loop body assigns a fresh value to a
// variable or field that e reads (key = uuid.NewString(), o.key = ...),
// other than the lazy creation if key == "" { key = ... }.
func (c *checker) reassigned(loop ast.Node, e ast.Expr) bool {
	info := c.pass.TypesInfo
	// The variables and fields e reads, as written (key, o.key).
	targets := map[string]types.Object{}
	ast.Inspect(e, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.Ident:
			if v, ok := info.Uses[n].(*types.Var); ok && !v.IsField() {
				targets[n.Name] = v
			}
		case *ast.SelectorExpr:
			if root := rootVar(info, n); root != nil {
				targets[types.ExprString(n)] = root
			}
		}
		return true
	})
	matches := func(l ast.Expr) bool {
		l = ast.Unparen(l)
		obj, ok := targets[types.ExprString(l)]
		if !ok {
			return false
		}
		if id, ok := l.(*ast.Ident); ok {
			return info.ObjectOf(id) == obj
		}
		sel, ok := l.(*ast.SelectorExpr)
		return ok && rootVar(info, sel) == obj
	}
	found := false
	ast.PreorderStack(loopBody(loop), nil, func(n ast.Node, stack []ast.Node) bool {
		if _, ok := n.(*ast.FuncLit); ok || found {
			return false
		}
		as, ok := n.(*ast.AssignStmt)
		if !ok || as.Tok != token.ASSIGN || len(as.Lhs) != len(as.Rhs) {
			return true
		}
		for i, l := range as.Lhs {
			if !matches(l) || lazyInit(info, stack, l) {
				continue
			}
			if f, _ := c.fresh(loop, as.Rhs[i], 0); f || c.generates(as.Rhs[i]) {
				found = true
			}
		}
		return !found
	})
	return found
}

// generates reports whether e calls a generator (uuid.NewString, rand...).
func (c *checker) generates(e ast.Expr) bool {
	gen := false
	ast.Inspect(e, func(n ast.Node) bool {
		if call, ok := n.(*ast.CallExpr); ok {
			if f := vetutil.Callee(c.pass.TypesInfo, call); f != nil && generator(f, len(call.Args)) {
				gen = true
			}
		}
		return !gen
	})
	return gen
}

// rootVar returns the variable a selector chain starts from (o in o.key), or nil.
func rootVar(info *types.Info, e ast.Expr) types.Object {
	for {
		switch x := ast.Unparen(e).(type) {
		case *ast.SelectorExpr:
			if s, ok := info.Selections[x]; !ok || s.Kind() != types.FieldVal {
				return nil
			}
			e = x.X
		case *ast.Ident:
			v, _ := info.Uses[x].(*types.Var)
			if v == nil {
				return nil
			}
			return v
		default:
			return nil
		}
	}
}

// lazyInit reports whether the assignment to l sits under if l == "" (or
// == nil, or len(l) == 0): the key is created once, on the first attempt.
func lazyInit(info *types.Info, stack []ast.Node, l ast.Expr) bool {
	want := types.ExprString(ast.Unparen(l))
	for _, n := range stack {
		ifs, ok := n.(*ast.IfStmt)
		if !ok {
			continue
		}
		bin, ok := ast.Unparen(ifs.Cond).(*ast.BinaryExpr)
		if !ok || bin.Op != token.EQL {
			continue
		}
		for _, side := range []ast.Expr{bin.X, bin.Y} {
			side = ast.Unparen(side)
			if call, ok := side.(*ast.CallExpr); ok && len(call.Args) == 1 {
				if id, ok := call.Fun.(*ast.Ident); ok && id.Name == "len" {
					side = ast.Unparen(call.Args[0])
				}
			}
			if types.ExprString(side) == want {
				return true
			}
		}
	}
	return false
}

// checkReused reports a request with a body, built before the loop and sent
// on every attempt: the first attempt consumes (and closes) the body, so a
// retry sends none.
func (c *checker) checkReused(loop ast.Node, do, newReq *ast.CallExpr, reqVar *types.Var, method string) {
	if reqVar == nil || vetutil.Encloses(loopBody(loop), newReq) || c.reported[do.Pos()+1] {
		return
	}
	if _, ok := loop.(*ast.FuncLit); ok {
		return
	}
	body := newReq.Args[len(newReq.Args)-1]
	if tv := c.pass.TypesInfo.Types[body]; tv.IsNil() {
		return
	}
	if sel, ok := ast.Unparen(body).(*ast.SelectorExpr); ok && sel.Sel.Name == "NoBody" {
		return
	}
	// req = http.NewRequest(...) again, req.Body = ..., req.GetBody(),
	// req.Clone(...) in the loop renew it.
	renewed := false
	ast.Inspect(loopBody(loop), func(n ast.Node) bool {
		if as, ok := n.(*ast.AssignStmt); ok {
			for _, l := range as.Lhs {
				if id, ok := ast.Unparen(l).(*ast.Ident); ok && c.pass.TypesInfo.ObjectOf(id) == reqVar {
					renewed = true
				}
			}
		}
		sel, ok := n.(*ast.SelectorExpr)
		if !ok {
			return !renewed
		}
		if id, ok := ast.Unparen(sel.X).(*ast.Ident); ok && c.pass.TypesInfo.Uses[id] == reqVar &&
			(sel.Sel.Name == "Body" || sel.Sel.Name == "GetBody" || sel.Sel.Name == "Clone") {
			renewed = true
		}
		return !renewed
	})
	if renewed {
		return
	}
	c.reported[do.Pos()+1] = true
	c.r.Report(do, fmt.Sprintf("retry loop sends the same %s request, built before the loop, on every attempt: the first attempt consumes its body, so a retry sends an empty body and fails (or is a different operation to the server); build the request inside the loop, with the key created once before it", strings.ToUpper(method)))
}

var unsafeMethod = map[string]bool{"POST": true, "PUT": true, "PATCH": true, "DELETE": true}

// requestMethod returns the method of an http.NewRequest[WithContext] call: a
// constant, or a local variable assigned one constant only.
func (c *checker) requestMethod(call *ast.CallExpr) (string, bool) {
	info := c.pass.TypesInfo
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
	if s, ok := constString(info, arg); ok {
		return s, true
	}
	// method := http.MethodPost; ... NewRequest(method, ...)
	id, ok := ast.Unparen(arg).(*ast.Ident)
	if !ok {
		return "", false
	}
	v, ok := info.Uses[id].(*types.Var)
	if !ok || c.assignments(v) != 1 {
		return "", false
	}
	if def := c.definition(v); def != nil {
		return constString(info, def)
	}
	return "", false
}

func constString(info *types.Info, e ast.Expr) (string, bool) {
	tv, ok := info.Types[e]
	if !ok || tv.Value == nil || tv.Value.Kind() != constant.String {
		return "", false
	}
	return constant.StringVal(tv.Value), true
}

// assignments counts the statements in the function that assign v (its
// definition included), and counts &v as many: the variable escapes.
func (c *checker) assignments(v *types.Var) int {
	n := 0
	ast.Inspect(c.body, func(node ast.Node) bool {
		switch node := node.(type) {
		case *ast.AssignStmt:
			for _, l := range node.Lhs {
				if id, ok := l.(*ast.Ident); ok && c.pass.TypesInfo.ObjectOf(id) == v {
					n++
				}
			}
		case *ast.UnaryExpr:
			if id, ok := ast.Unparen(node.X).(*ast.Ident); ok && node.Op == token.AND && c.pass.TypesInfo.Uses[id] == v {
				n += 2
			}
		case *ast.RangeStmt:
			for _, e := range []ast.Expr{node.Key, node.Value} {
				if id, ok := e.(*ast.Ident); ok && e != nil && c.pass.TypesInfo.ObjectOf(id) == v {
					n += 2
				}
			}
		}
		return true
	})
	return n
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
	call  ast.Node // req.Header.Set(...), or the statement req.Header[k] = v
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
				ix, ok := l.(*ast.IndexExpr)
				if !ok || !isReqHeader(ix.X) {
					continue
				}
				// req.Header["Idempotency-Key"] = []string{key}
				name, ok := constString(info, ix.Index)
				switch {
				case !ok || len(n.Lhs) != len(n.Rhs):
					unknown = true
				case keyHeader.MatchString(name):
					value := n.Rhs[0]
					for i := range n.Lhs {
						if n.Lhs[i] == l {
							value = n.Rhs[i]
						}
					}
					if lit, ok := ast.Unparen(value).(*ast.CompositeLit); ok && len(lit.Elts) == 1 {
						value = lit.Elts[0]
					}
					sets = append(sets, keySet{call: n, value: value})
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
func (c *checker) fresh(loop ast.Node, e ast.Expr, depth int) (fresh, byLoopVar bool) {
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

func isCounter(loop ast.Node, v *types.Var) bool {
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
	// A labeled loop keeps its label: the key goes above "label: for".
	at := loop.Pos()
	vetutil.InspectShallow(c.body, func(n ast.Node) bool {
		if l, ok := n.(*ast.LabeledStmt); ok && l.Stmt == loop {
			at = l.Pos()
		}
		return true
	})
	indent := strings.Repeat("\t", fset.Position(at).Column-1)
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
						{Pos: at, End: at, NewText: []byte(text + "\n" + indent)},
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
	// Two keys in one loop (two requests) must stay two keys: one hoisted
	// name for both would make the second request a replay of the first.
	sets := 0
	ast.Inspect(loopBody(loop), func(n ast.Node) bool {
		if call, ok := n.(*ast.CallExpr); ok {
			if sel, ok := ast.Unparen(call.Fun).(*ast.SelectorExpr); ok && (sel.Sel.Name == "Set" || sel.Sel.Name == "Add") && len(call.Args) == 2 {
				if name, ok := constString(c.pass.TypesInfo, call.Args[0]); ok && keyHeader.MatchString(name) {
					sets++
				}
			}
		}
		if ix, ok := n.(*ast.IndexExpr); ok {
			if name, ok := constString(c.pass.TypesInfo, ix.Index); ok && keyHeader.MatchString(name) {
				sets++
			}
		}
		return true
	})
	if sets > 1 {
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
			{Pos: at, End: at, NewText: []byte(name + " := " + text + "\n" + indent)},
			{Pos: value.Pos(), End: value.End(), NewText: []byte(name)},
		},
	}}
}

// usesLoopVars reports whether e refers to a variable declared in loop, so
// it cannot move above it.
func (c *checker) usesLoopVars(loop ast.Node, e ast.Expr) bool {
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
