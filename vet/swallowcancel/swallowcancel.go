// Package swallowcancel reports, in a function that has a database
// transaction, a branch on cancellation (context.Canceled,
// context.DeadlineExceeded, ctx.Err(), <-ctx.Done()) that returns nil,
// continues or clears the error instead of re-raising it, and errors of the
// transaction's own calls that are dropped.
package swallowcancel

import (
	"fmt"
	"go/ast"
	"go/token"
	"go/types"

	"golang.org/x/tools/go/analysis"

	"github.com/idemgen/idemgen/vet/internal/vetutil"
)

// Analyzer is the swallowcancel check.
var Analyzer = &analysis.Analyzer{
	Name: "swallowcancel",
	Doc: `report swallowed cancellation and dropped errors in functions with a transaction

A cancelled operation must roll back and report the cancellation. In a function
that holds a pgx.Tx (or *sql.Tx), a branch on context.Canceled,
context.DeadlineExceeded, ctx.Err() or <-ctx.Done() that returns nil, continues
or sets the error to nil tells the caller the work is done: the caller commits a
half-done transaction or acknowledges an event whose writes never happened.
Errors of the transaction's own calls (Exec, Commit, sqlc queries on it) that are
dropped hide the same failures. Only where a transaction is open: a worker
loop's "case <-ctx.Done(): return nil" with the transaction begun elsewhere, or
a branch after the commit, is a clean shutdown.`,
	URL: "https://github.com/idemgen/idemgen#idemgen-vet",
	Run: run,
}

func run(pass *analysis.Pass) (any, error) {
	r := vetutil.NewReporter(pass)
	vetutil.FuncBodies(pass, func(_ *ast.FuncDecl, typ *ast.FuncType, body *ast.BlockStmt) {
		if !hasTx(pass.TypesInfo, typ, body) {
			return
		}
		returnsError := false
		if res := typ.Results; res != nil && len(res.List) > 0 {
			returnsError = isError(pass.TypesInfo.TypeOf(res.List[len(res.List)-1].Type))
		}
		live := liveTx(pass.TypesInfo, typ, body)
		checkCancel(pass, r, body, returnsError, live)
		checkDropped(pass, r, body)
	})
	return nil, nil
}

func isError(t types.Type) bool {
	return t != nil && types.Identical(t, types.Universe.Lookup("error").Type())
}

// hasTx reports whether the function takes or uses a transaction.
func hasTx(info *types.Info, typ *ast.FuncType, body *ast.BlockStmt) bool {
	if typ.Params != nil {
		for _, f := range typ.Params.List {
			if vetutil.IsTx(info.TypeOf(f.Type)) {
				return true
			}
		}
	}
	found := false
	vetutil.InspectShallow(body, func(n ast.Node) bool {
		if id, ok := n.(*ast.Ident); ok {
			if v, ok := info.ObjectOf(id).(*types.Var); ok && vetutil.IsTx(v.Type()) {
				found = true
			}
		}
		return !found
	})
	return found
}

// liveTx returns whether a transaction is open at a position of the
// function: the function takes one (it runs inside its caller's), reaches
// one through a field, or a local transaction variable is in scope there and
// was not committed or rolled back by a statement that runs before it on
// every path. A worker loop's "case <-ctx.Done(): return nil" with the
// transaction begun in another case, or after the commit, is a clean
// shutdown, not a swallowed cancellation.
func liveTx(info *types.Info, typ *ast.FuncType, body *ast.BlockStmt) func(token.Pos) bool {
	if typ.Params != nil {
		for _, f := range typ.Params.List {
			if vetutil.IsTx(info.TypeOf(f.Type)) {
				return func(token.Pos) bool { return true }
			}
		}
	}
	var locals []*types.Var
	field := false // a transaction not declared here: open throughout
	// ended[v] lists the statements that end v unconditionally, as the
	// block they sit in and the statement itself.
	type end struct{ block, stmt ast.Node }
	ended := map[*types.Var][]end{}
	ast.PreorderStack(body, nil, func(n ast.Node, stack []ast.Node) bool {
		switch n := n.(type) {
		case *ast.FuncLit:
			return false
		case *ast.Ident:
			switch obj := info.ObjectOf(n).(type) {
			case *types.Var:
				if !vetutil.IsTx(obj.Type()) {
					break
				}
				if obj.IsField() || !vetutil.Encloses(body, posNode(obj.Pos())) {
					field = true // a field, or captured from the enclosing function
				} else if info.Defs[n] == obj {
					locals = append(locals, obj)
				}
			}
		case *ast.CallExpr:
			f := vetutil.Callee(info, n)
			if f == nil || (f.Name() != "Commit" && f.Name() != "Rollback") {
				break
			}
			id, ok := ast.Unparen(vetutil.Receiver(info, n)).(*ast.Ident)
			if !ok {
				break
			}
			v, ok := info.Uses[id].(*types.Var)
			if !ok || !vetutil.IsTx(v.Type()) {
				break
			}
			// The nearest enclosing block and the statement of it that
			// holds the call, with no block in between: the call runs
			// whenever that statement does.
			for i := len(stack) - 1; i > 0; i-- {
				switch b := stack[i-1].(type) {
				case *ast.BlockStmt, *ast.CaseClause, *ast.CommClause:
					switch stack[i].(type) {
					case *ast.DeferStmt, *ast.GoStmt:
					default:
						ended[v] = append(ended[v], end{b, stack[i]})
					}
					return true
				}
				switch stack[i-1].(type) {
				case *ast.IfStmt, *ast.ForStmt, *ast.RangeStmt, *ast.SwitchStmt, *ast.TypeSwitchStmt, *ast.SelectStmt:
					if _, isBody := stack[i].(*ast.BlockStmt); isBody {
						return true // inside a branch or a loop: not on every path
					}
				}
			}
		}
		return true
	})
	return func(pos token.Pos) bool {
		if field {
			return true
		}
		for _, v := range locals {
			if v.Pos() >= pos || v.Parent() == nil || !v.Parent().Contains(pos) {
				continue
			}
			open := true
			for _, e := range ended[v] {
				if vetutil.Encloses(e.block, posNode(pos)) && e.stmt.End() <= pos {
					open = false
				}
			}
			if open {
				return true
			}
		}
		return false
	}
}

type posNode token.Pos

func (p posNode) Pos() token.Pos { return token.Pos(p) }
func (p posNode) End() token.Pos { return token.Pos(p) + 1 }

const swallowMsg = "cancellation is swallowed inside a transaction (%s): the caller sees success and commits a half-done operation or acknowledges an event whose writes never happened (lost event, or a double charge on the next attempt); return the error (e.g. return ctx.Err()) or roll the transaction back explicitly"

// checkCancel reports cancellation branches that swallow it.
func checkCancel(pass *analysis.Pass, r *vetutil.Reporter, body *ast.BlockStmt, returnsError bool, live func(token.Pos) bool) {
	info := pass.TypesInfo
	report := func(at ast.Node, why string) {
		if why != "" && live(at.Pos()) {
			r.Report(at, fmt.Sprintf(swallowMsg, why))
		}
	}
	ast.PreorderStack(body, nil, func(n ast.Node, stack []ast.Node) bool {
		switch n := n.(type) {
		case *ast.FuncLit:
			return false
		case *ast.IfStmt:
			test, negated, errVar := cancelTest(info, n.Cond)
			if test == nil {
				test, negated = initCtxErr(info, n)
			}
			if test == nil {
				return true
			}
			switch blk, _ := n.Else.(*ast.BlockStmt); {
			case !negated:
				report(test, swallows(info, n.Body.List, returnsError, errVar))
			case blk != nil:
				report(test, swallows(info, blk.List, returnsError, errVar))
			case n.Else == nil && terminates(n.Body):
				// if !errors.Is(err, context.Canceled) { return err }
				// return nil: the cancelled error falls through.
				if next := nextStmt(stack, n); next != nil {
					if why := swallows(info, []ast.Stmt{next}, returnsError, nil); why == "the branch returns a nil error" || why == "the branch continues" {
						report(test, "only other errors are returned; the cancellation falls through to "+map[bool]string{true: "a nil return", false: "continue"}[why == "the branch returns a nil error"])
					}
				}
			}
		case *ast.SwitchStmt:
			for _, cc := range n.Body.List {
				cc := cc.(*ast.CaseClause)
				for _, e := range cc.List {
					var test ast.Expr
					var errVar types.Object
					if n.Tag == nil {
						if t, neg, v := cancelTest(info, e); t != nil && !neg {
							test, errVar = t, v
						}
					} else if isCancelErr(info, e) {
						test, errVar = e, objOf(info, n.Tag)
					}
					if test != nil {
						report(test, swallows(info, cc.Body, returnsError, errVar))
						break
					}
				}
			}
		case *ast.CommClause:
			recv := commRecv(n.Comm)
			if recv == nil || !isDone(info, recv) {
				return true
			}
			report(recv, swallows(info, n.Body, returnsError, nil))
		}
		return true
	})
}

// initCtxErr recognises if err := ctx.Err(); err != nil { ... }.
func initCtxErr(info *types.Info, n *ast.IfStmt) (test ast.Expr, negated bool) {
	as, ok := n.Init.(*ast.AssignStmt)
	if !ok || len(as.Lhs) != 1 || len(as.Rhs) != 1 || !isCtxErr(info, as.Rhs[0]) {
		return nil, false
	}
	v := objOf(info, as.Lhs[0])
	if id, ok := as.Lhs[0].(*ast.Ident); ok && v == nil {
		v = info.Defs[id]
	}
	bin, ok := ast.Unparen(n.Cond).(*ast.BinaryExpr)
	if !ok || v == nil || (bin.Op != token.NEQ && bin.Op != token.EQL) {
		return nil, false
	}
	for _, pair := range [][2]ast.Expr{{bin.X, bin.Y}, {bin.Y, bin.X}} {
		if objOf(info, pair[0]) == v && isNil(info, pair[1]) {
			return bin, bin.Op == token.EQL
		}
	}
	return nil, false
}

// terminates reports whether a block ends in a return.
func terminates(b *ast.BlockStmt) bool {
	if len(b.List) == 0 {
		return false
	}
	_, ok := b.List[len(b.List)-1].(*ast.ReturnStmt)
	return ok
}

// nextStmt returns the statement after s in its block, or nil.
func nextStmt(stack []ast.Node, s ast.Stmt) ast.Stmt {
	if len(stack) == 0 {
		return nil
	}
	var list []ast.Stmt
	switch b := stack[len(stack)-1].(type) {
	case *ast.BlockStmt:
		list = b.List
	case *ast.CaseClause:
		list = b.Body
	case *ast.CommClause:
		list = b.Body
	}
	for i, st := range list {
		if st == s && i+1 < len(list) {
			return list[i+1]
		}
	}
	return nil
}

// cancelTest finds a cancellation test in cond. negated is true when cond
// is true for "not cancelled" (so the else branch handles it). errVar is the
// error variable tested, if any.
func cancelTest(info *types.Info, cond ast.Expr) (test ast.Expr, negated bool, errVar types.Object) {
	switch c := ast.Unparen(cond).(type) {
	case *ast.UnaryExpr:
		if c.Op == token.NOT {
			t, neg, v := cancelTest(info, c.X)
			return t, !neg, v
		}
	case *ast.BinaryExpr:
		switch c.Op {
		case token.LOR:
			if t, neg, v := cancelTest(info, c.X); t != nil && !neg {
				return t, false, v
			}
			if t, neg, v := cancelTest(info, c.Y); t != nil && !neg {
				return t, false, v
			}
		case token.LAND:
			// err != nil && errors.Is(err, context.Canceled): the body
			// runs only when cancelled.
			for _, side := range []ast.Expr{c.X, c.Y} {
				if t, neg, v := cancelTest(info, side); t != nil && !neg {
					return c, false, v
				}
			}
		case token.EQL, token.NEQ:
			x, y := ast.Unparen(c.X), ast.Unparen(c.Y)
			for _, pair := range [][2]ast.Expr{{x, y}, {y, x}} {
				if isCancelErr(info, pair[0]) {
					return c, c.Op == token.NEQ, objOf(info, pair[1])
				}
				if isCtxErr(info, pair[0]) && isNil(info, pair[1]) {
					return c, c.Op == token.EQL, nil
				}
			}
		}
	case *ast.CallExpr:
		if f := vetutil.Callee(info, c); vetutil.IsFunc(f, "errors", "Is") && len(c.Args) == 2 && (isCancelErr(info, c.Args[1]) || isCtxErr(info, c.Args[1])) {
			return c, false, objOf(info, c.Args[0])
		}
	}
	return nil, false, nil
}

func objOf(info *types.Info, e ast.Expr) types.Object {
	if id, ok := ast.Unparen(e).(*ast.Ident); ok {
		return info.Uses[id]
	}
	return nil
}

func isNil(info *types.Info, e ast.Expr) bool {
	tv, ok := info.Types[e]
	return ok && tv.IsNil()
}

// isCancelErr reports whether e is context.Canceled or context.DeadlineExceeded.
func isCancelErr(info *types.Info, e ast.Expr) bool {
	sel, ok := ast.Unparen(e).(*ast.SelectorExpr)
	if !ok {
		return false
	}
	v, ok := info.Uses[sel.Sel].(*types.Var)
	return ok && v.Pkg() != nil && v.Pkg().Path() == "context" && (v.Name() == "Canceled" || v.Name() == "DeadlineExceeded")
}

// isCtxErr reports whether e is ctx.Err() on a context.Context.
func isCtxErr(info *types.Info, e ast.Expr) bool {
	call, ok := ast.Unparen(e).(*ast.CallExpr)
	if !ok {
		return false
	}
	f := vetutil.Callee(info, call)
	return f != nil && f.Name() == "Err" && isContext(info, vetutil.Receiver(info, call))
}

func isContext(info *types.Info, e ast.Expr) bool {
	return e != nil && vetutil.Named(info.TypeOf(e), "context", "Context")
}

// commRecv returns the received expression of a select case, or nil.
func commRecv(s ast.Stmt) ast.Expr {
	var x ast.Expr
	switch s := s.(type) {
	case *ast.ExprStmt:
		x = s.X
	case *ast.AssignStmt:
		if len(s.Rhs) == 1 {
			x = s.Rhs[0]
		}
	}
	if u, ok := ast.Unparen(x).(*ast.UnaryExpr); ok && u.Op == token.ARROW {
		return u
	}
	return nil
}

// isDone reports whether recv is <-ctx.Done().
func isDone(info *types.Info, recv ast.Expr) bool {
	call, ok := ast.Unparen(recv.(*ast.UnaryExpr).X).(*ast.CallExpr)
	if !ok {
		return false
	}
	f := vetutil.Callee(info, call)
	return f != nil && f.Name() == "Done" && isContext(info, vetutil.Receiver(info, call))
}

// swallows says how branch swallows the cancellation, or "" if it does not:
// it is empty, ends in continue, returns a nil error, or sets the tested
// error to nil. A branch that rolls a transaction back is fine.
func swallows(info *types.Info, branch []ast.Stmt, returnsError bool, errVar types.Object) string {
	rollsBack := false
	cleared := false
	for _, st := range branch {
		ast.Inspect(st, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.FuncLit:
				return false
			case *ast.CallExpr:
				if f := vetutil.Callee(info, n); f != nil && f.Name() == "Rollback" && vetutil.IsTx(info.TypeOf(vetutil.Receiver(info, n))) {
					rollsBack = true
				}
			case *ast.AssignStmt:
				for i, l := range n.Lhs {
					if errVar != nil && objOf(info, l) == errVar && i < len(n.Rhs) && isNil(info, n.Rhs[i]) {
						cleared = true
					}
				}
			}
			return true
		})
	}
	if rollsBack {
		return ""
	}
	if cleared {
		return "the error is set to nil"
	}
	if len(branch) == 0 {
		return "the branch is empty"
	}
	switch last := branch[len(branch)-1].(type) {
	case *ast.BranchStmt:
		if last.Tok == token.CONTINUE {
			return "the branch continues"
		}
	case *ast.ReturnStmt:
		if returnsError && len(last.Results) > 0 && isNil(info, last.Results[len(last.Results)-1]) {
			return "the branch returns a nil error"
		}
	}
	return ""
}

// checkDropped reports calls on a transaction (or on sqlc Queries) whose
// error result is discarded. Rollback is exempt: its error does not change
// the outcome, and defer tx.Rollback(ctx) is the idiom.
func checkDropped(pass *analysis.Pass, r *vetutil.Reporter, body *ast.BlockStmt) {
	info := pass.TypesInfo
	report := func(call *ast.CallExpr) {
		f := vetutil.Callee(info, call)
		recv := vetutil.Receiver(info, call)
		// tx.QueryRow(...).Scan(&v): QueryRow's error comes out of Scan.
		if f != nil && f.Name() == "Scan" && vetutil.ReturnsError(f) {
			if inner, ok := ast.Unparen(recv).(*ast.CallExpr); ok {
				g := vetutil.Callee(info, inner)
				if t := info.TypeOf(vetutil.Receiver(info, inner)); g != nil && g.Name() == "QueryRow" && (vetutil.IsTx(t) || vetutil.IsQueries(t)) {
					r.Report(call, "error of QueryRow(...).Scan on the transaction is dropped: after a failed statement PostgreSQL aborts the transaction, so the operation's writes are lost while it reports success (lost event); check the error and return it")
					return
				}
			}
		}
		if f == nil || recv == nil || !vetutil.ReturnsError(f) || f.Name() == "Rollback" {
			return
		}
		t := info.TypeOf(recv)
		if !vetutil.IsTx(t) && !vetutil.IsQueries(t) {
			return
		}
		if f.Name() == "Commit" {
			r.Report(call, "error of Commit is dropped: if the commit fails the writes are lost while the caller goes on as if they were saved (a lost event or an unrecorded charge); check it and return it")
			return
		}
		r.Report(call, fmt.Sprintf("error of %s on the transaction is dropped: after a failed statement PostgreSQL aborts the transaction, so the operation's writes are lost while it reports success (lost event); check the error and return it", f.Name()))
	}
	vetutil.InspectShallow(body, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.ExprStmt:
			if call, ok := ast.Unparen(n.X).(*ast.CallExpr); ok {
				report(call)
			}
		case *ast.DeferStmt:
			report(n.Call)
		case *ast.AssignStmt:
			if len(n.Rhs) != 1 {
				return true
			}
			if call, ok := ast.Unparen(n.Rhs[0]).(*ast.CallExpr); ok {
				if id, ok := n.Lhs[len(n.Lhs)-1].(*ast.Ident); ok && id.Name == "_" && !rowsCarryError(info, call, n.Lhs) {
					report(call)
				}
			}
		}
		return true
	})
}

// rowsCarryError reports whether call is pgx's Query with its rows kept:
// pgx.Rows carries the query's error (rows.Err() after the loop), so
// rows, _ := tx.Query(...) is pgx's documented idiom, not a dropped error.
// database/sql is not exempt: its rows are nil on error.
func rowsCarryError(info *types.Info, call *ast.CallExpr, lhs []ast.Expr) bool {
	f := vetutil.Callee(info, call)
	if f == nil || f.Name() != "Query" || len(lhs) != 2 {
		return false
	}
	if id, ok := lhs[0].(*ast.Ident); ok && id.Name == "_" {
		return false
	}
	res := f.Type().(*types.Signature).Results()
	return res.Len() == 2 && vetutil.Named(res.At(0).Type(), vetutil.PgxPath, "Rows")
}
