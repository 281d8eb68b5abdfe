// Package vetutil holds what the idemgen vet analyzers share: recognising the
// pgx, franz-go and net/http types they reason about, the //idemvet:ignore
// comment that silences one finding, and the //idem: directives of a function.
package vetutil

import (
	"go/ast"
	"go/token"
	"go/types"
	"strings"

	"golang.org/x/tools/go/analysis"
)

// Import paths of the libraries the checks know.
const (
	PgxPath     = "github.com/jackc/pgx/v5"
	PgxpoolPath = "github.com/jackc/pgx/v5/pgxpool"
	KgoPath     = "github.com/twmb/franz-go/pkg/kgo"
)

// IgnorePrefix starts a comment that silences one check on its line or on
// the line below it: //idemvet:ignore CHECK REASON. It is not an //idem:
// directive, so the generator never reads it.
const IgnorePrefix = "//idemvet:ignore"

// Named reports whether t, or what t points to, is the named type pkg.name.
func Named(t types.Type, pkg, name string) bool {
	if p, ok := types.Unalias(t).(*types.Pointer); ok {
		t = p.Elem()
	}
	n, ok := types.Unalias(t).(*types.Named)
	if !ok || n.Obj().Pkg() == nil {
		return false
	}
	return n.Obj().Pkg().Path() == pkg && n.Obj().Name() == name
}

// IsTx reports whether t is a database transaction: pgx.Tx, *pgxpool.Tx or
// *sql.Tx.
func IsTx(t types.Type) bool {
	return t != nil && (Named(t, PgxPath, "Tx") || Named(t, PgxpoolPath, "Tx") || Named(t, "database/sql", "Tx"))
}

// IsPoolOrConn reports whether t is a handle that runs each statement outside
// any caller's transaction: *pgxpool.Pool, *pgxpool.Conn, *pgx.Conn, *sql.DB
// or *sql.Conn.
func IsPoolOrConn(t types.Type) bool {
	return t != nil && (Named(t, PgxpoolPath, "Pool") || Named(t, PgxpoolPath, "Conn") ||
		Named(t, PgxPath, "Conn") || Named(t, "database/sql", "DB") || Named(t, "database/sql", "Conn"))
}

// IsQueries reports whether t is (a pointer to) a sqlc Queries type: a struct
// named Queries whose first field is a DBTX interface.
func IsQueries(t types.Type) bool {
	if p, ok := types.Unalias(t).(*types.Pointer); ok {
		t = p.Elem()
	}
	n, ok := types.Unalias(t).(*types.Named)
	if !ok || n.Obj().Name() != "Queries" {
		return false
	}
	st, ok := n.Underlying().(*types.Struct)
	if !ok || st.NumFields() == 0 {
		return false
	}
	ft, ok := types.Unalias(st.Field(0).Type()).(*types.Named)
	return ok && ft.Obj().Name() == "DBTX"
}

// Callee returns the function or method a call statically calls, or nil.
func Callee(info *types.Info, call *ast.CallExpr) *types.Func {
	var id *ast.Ident
	switch fun := ast.Unparen(call.Fun).(type) {
	case *ast.Ident:
		id = fun
	case *ast.SelectorExpr:
		id = fun.Sel
	case *ast.IndexExpr: // generic instantiation
		return calleeOf(info, fun.X)
	default:
		return nil
	}
	f, _ := info.Uses[id].(*types.Func)
	return f
}

func calleeOf(info *types.Info, e ast.Expr) *types.Func {
	switch e := ast.Unparen(e).(type) {
	case *ast.Ident:
		f, _ := info.Uses[e].(*types.Func)
		return f
	case *ast.SelectorExpr:
		f, _ := info.Uses[e.Sel].(*types.Func)
		return f
	}
	return nil
}

// Receiver returns the receiver expression of a method call x.M(...), or nil.
func Receiver(info *types.Info, call *ast.CallExpr) ast.Expr {
	sel, ok := ast.Unparen(call.Fun).(*ast.SelectorExpr)
	if !ok {
		return nil
	}
	if s, ok := info.Selections[sel]; ok && (s.Kind() == types.MethodVal) {
		return sel.X
	}
	return nil
}

// IsFunc reports whether f is the package-level function pkg.name.
func IsFunc(f *types.Func, pkg, name string) bool {
	return f != nil && f.Pkg() != nil && f.Pkg().Path() == pkg && f.Name() == name &&
		f.Type().(*types.Signature).Recv() == nil
}

// IsMethod reports whether f is a method named one of names whose receiver is
// the named type pkg.typ (or a pointer to it).
func IsMethod(f *types.Func, pkg, typ string, names ...string) bool {
	if f == nil {
		return false
	}
	recv := f.Type().(*types.Signature).Recv()
	if recv == nil || !Named(recv.Type(), pkg, typ) {
		return false
	}
	for _, n := range names {
		if f.Name() == n {
			return true
		}
	}
	return len(names) == 0
}

// ReturnsError reports whether the last result of f is error.
func ReturnsError(f *types.Func) bool {
	if f == nil {
		return false
	}
	res := f.Type().(*types.Signature).Results()
	return res.Len() > 0 && types.Identical(res.At(res.Len()-1).Type(), types.Universe.Lookup("error").Type())
}

// Directive returns the kind of the //idem: directive in doc ("http",
// "consume", "outbox"), or "".
func Directive(doc *ast.CommentGroup) string {
	if doc == nil {
		return ""
	}
	for _, c := range doc.List {
		if rest, ok := strings.CutPrefix(c.Text, "//idem:"); ok {
			kind, _, _ := strings.Cut(rest, " ")
			kind, _, _ = strings.Cut(kind, "\t")
			return kind
		}
	}
	return ""
}

// Reporter reports a check's diagnostics, except those an //idemvet:ignore
// comment silences.
type Reporter struct {
	Pass  *analysis.Pass
	Check string // the analyzer's name, as written in //idemvet:ignore
	// ignored maps a file to the lines on which Check is silenced.
	ignored map[*token.File]map[int]bool
}

// NewReporter reads the //idemvet:ignore comments of pass's files.
func NewReporter(pass *analysis.Pass) *Reporter {
	r := &Reporter{Pass: pass, Check: pass.Analyzer.Name, ignored: map[*token.File]map[int]bool{}}
	for _, f := range pass.Files {
		tf := pass.Fset.File(f.Pos())
		for _, cg := range f.Comments {
			for _, c := range cg.List {
				check, reason, ok := ParseIgnore(c.Text)
				if !ok || check != r.Check || reason == "" {
					continue
				}
				if r.ignored[tf] == nil {
					r.ignored[tf] = map[int]bool{}
				}
				line := tf.Line(c.Slash)
				// On its own line it silences the line below; at the end
				// of a line, that line.
				r.ignored[tf][line] = true
				r.ignored[tf][line+1] = true
			}
		}
	}
	return r
}

// ParseIgnore splits an //idemvet:ignore comment into the check it names and
// the reason given; ok is false for any other comment.
func ParseIgnore(text string) (check, reason string, ok bool) {
	rest, ok := strings.CutPrefix(text, IgnorePrefix)
	if !ok || (rest != "" && rest[0] != ' ' && rest[0] != '\t') {
		return "", "", false
	}
	fields := strings.Fields(rest)
	if len(fields) == 0 {
		return "", "", true
	}
	return fields[0], strings.Join(fields[1:], " "), true
}

// Report reports msg at node unless the check is silenced on node's line.
func (r *Reporter) Report(node ast.Node, msg string, fixes ...analysis.SuggestedFix) {
	r.ReportAt(node.Pos(), node.End(), msg, fixes...)
}

// ReportAt reports msg at pos unless the check is silenced on pos's line.
func (r *Reporter) ReportAt(pos, end token.Pos, msg string, fixes ...analysis.SuggestedFix) {
	if tf := r.Pass.Fset.File(pos); tf != nil && r.ignored[tf][tf.Line(pos)] {
		return
	}
	r.Pass.Report(analysis.Diagnostic{Pos: pos, End: end, Message: msg, SuggestedFixes: fixes})
}

// Checks names every idemgen vet analyzer, as //idemvet:ignore accepts them.
var Checks = []string{"retrykey", "swallowcancel", "offsetcommit", "txescape", "directive"}

// FuncBodies calls fn for every function body in the pass's files: each
// declared function and each function literal, with the declaration's doc
// comment (nil for a literal).
func FuncBodies(pass *analysis.Pass, fn func(decl *ast.FuncDecl, typ *ast.FuncType, body *ast.BlockStmt)) {
	for _, f := range pass.Files {
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.FuncDecl:
				if n.Body != nil {
					fn(n, n.Type, n.Body)
				}
			case *ast.FuncLit:
				fn(nil, n.Type, n.Body)
			}
			return true
		})
	}
}

// InspectShallow walks n without descending into function literals, which
// are separate functions.
func InspectShallow(n ast.Node, fn func(ast.Node) bool) {
	ast.Inspect(n, func(m ast.Node) bool {
		if _, ok := m.(*ast.FuncLit); ok && m != n {
			return false
		}
		return fn(m)
	})
}

// Encloses reports whether outer's source range contains inner's.
func Encloses(outer, inner ast.Node) bool {
	return outer.Pos() <= inner.Pos() && inner.End() <= outer.End()
}
