// Package txescape reports a function annotated with //idem:http or
// //idem:consume that escapes the operation's transaction: it commits or
// rolls back the tx the generated wrapper gave it, or writes through
// something else (a *pgxpool.Pool, *pgx.Conn, *sql.DB, or sqlc Queries not
// built from that tx). Such a write is not undone when the operation rolls
// back, and it is repeated on every retry.
package txescape

import (
	"fmt"
	"go/ast"
	"go/constant"
	"go/types"
	"regexp"
	"strings"

	"golang.org/x/tools/go/analysis"

	"github.com/idemgen/idemgen/vet/internal/vetutil"
)

// Analyzer is the txescape check.
var Analyzer = &analysis.Analyzer{
	Name: "txescape",
	Doc: `report //idem:http and //idem:consume functions that escape the operation's transaction

The generated wrapper commits the function's writes together with the key claim
and stored response (or the processed-event row) in the pgx.Tx it passes in.
Inside such a function:
  - Commit or Rollback on that tx breaks the pairing: the writes become durable
    before the key is, and the retry runs them again (double charge);
  - a statement through a *pgxpool.Pool, *pgxpool.Conn, *pgx.Conn, *sql.DB or
    *sql.Conn, or a sqlc Queries not built from the tx (db.New(pool), a struct
    field), or pgx.BeginFunc on a pool, runs outside the transaction: it is
    not undone on rollback and is repeated on every retry. Statements on
    tx.Conn() are inside it.
Reads are reported too (they do not see the operation's own writes and hold a
second connection); -txescape.allowreads allows them: Query/QueryRow whose SQL is
a constant SELECT, and sqlc methods named Get*, List*, Count*, Find*, Select*,
Exists*, Lookup*, Search*.`,
	URL: "https://github.com/idemgen/idemgen#idemgen-vet",
	Run: run,
}

var allowReads bool

func init() {
	Analyzer.Flags.BoolVar(&allowReads, "allowreads", false,
		"allow reads outside the operation's transaction (constant SELECT through a pool, sqlc Get*/List*/... methods)")
}

var dbMethods = map[string]bool{
	"Exec": true, "ExecContext": true, "Query": true, "QueryContext": true, "QueryRow": true, "QueryRowContext": true,
	"SendBatch": true, "CopyFrom": true, "Begin": true, "BeginTx": true, "Prepare": true, "PrepareContext": true,
}

func run(pass *analysis.Pass) (any, error) {
	r := vetutil.NewReporter(pass)
	for _, f := range pass.Files {
		for _, decl := range f.Decls {
			fd, ok := decl.(*ast.FuncDecl)
			if !ok || fd.Body == nil {
				continue
			}
			if kind := vetutil.Directive(fd.Doc); kind == "http" || kind == "consume" {
				check(pass, r, fd, kind)
			}
		}
	}
	return nil, nil
}

func check(pass *analysis.Pass, r *vetutil.Reporter, fd *ast.FuncDecl, kind string) {
	info := pass.TypesInfo
	txs := map[types.Object]bool{}
	for _, field := range fd.Type.Params.List {
		if vetutil.IsTx(info.TypeOf(field.Type)) {
			for _, n := range field.Names {
				txs[info.Defs[n]] = true
			}
		}
	}
	isOpTx := func(e ast.Expr) bool {
		id, ok := ast.Unparen(e).(*ast.Ident)
		return ok && txs[info.Uses[id]]
	}
	dir := "//idem:" + kind
	ast.Inspect(fd.Body, func(n ast.Node) bool {
		call, ok := n.(*ast.CallExpr)
		if !ok {
			return true
		}
		f := vetutil.Callee(info, call)
		recv := vetutil.Receiver(info, call)
		// pgx.BeginFunc(ctx, s.pool, fn) runs fn in a transaction of its
		// own; on the operation's tx it is a savepoint, which is fine.
		if (vetutil.IsFunc(f, vetutil.PgxPath, "BeginFunc") || vetutil.IsFunc(f, vetutil.PgxPath, "BeginTxFunc")) && len(call.Args) > 1 {
			if t := info.TypeOf(call.Args[1]); vetutil.IsPoolOrConn(t) {
				r.Report(call, escapeMsg(dir, typeName(t)+" (pgx."+f.Name()+")", false, kind))
			}
			return true
		}
		if f == nil || recv == nil {
			return true
		}
		// tx.Conn() is the connection the operation's transaction runs on:
		// statements on it are inside that transaction.
		if inner, ok := ast.Unparen(recv).(*ast.CallExpr); ok {
			if g := vetutil.Callee(info, inner); g != nil && g.Name() == "Conn" && isOpTx(vetutil.Receiver(info, inner)) {
				return true
			}
		}
		rt := info.TypeOf(recv)
		switch {
		case (f.Name() == "Commit" || f.Name() == "Rollback") && isOpTx(recv):
			r.Report(call, fmt.Sprintf("%s function calls %s on the operation's transaction: the generated wrapper commits it together with the %s, so the writes become durable without it and a retry runs them again (double charge); return nil to commit or an error to roll back", dir, f.Name(), recorded(kind)))
		case vetutil.IsPoolOrConn(rt) && dbMethods[f.Name()]:
			read := (f.Name() == "Query" || f.Name() == "QueryRow" || f.Name() == "QueryContext" || f.Name() == "QueryRowContext") && constantSelect(info, call)
			if read && allowReads {
				return true
			}
			r.Report(call, escapeMsg(dir, typeName(rt), read, kind))
		case vetutil.IsQueries(rt) && vetutil.ReturnsError(f) && f.Name() != "WithTx":
			if fromTx(info, fd.Body, recv, isOpTx) {
				return true
			}
			read := readName.MatchString(f.Name())
			if read && allowReads {
				return true
			}
			r.Report(call, escapeMsg(dir, "sqlc Queries not built from the operation's tx", read, kind))
		}
		return true
	})
}

func recorded(kind string) string {
	if kind == "consume" {
		return "processed-event row"
	}
	return "key claim and stored response"
}

func escapeMsg(dir, via string, read bool, kind string) string {
	if read {
		return fmt.Sprintf("%s function reads through %s, outside the operation's transaction: the read does not see the operation's own writes and holds a second connection while the transaction waits (pool exhaustion under load); read with the tx, or run with -txescape.allowreads to allow reads", dir, via)
	}
	risk := "double charge"
	if kind == "consume" {
		risk = "a duplicate effect per redelivery"
	}
	return fmt.Sprintf("%s function writes through %s, outside the operation's transaction: the write is not undone when the operation rolls back and is repeated on every retry (%s); use the tx the function receives (db.New(tx) for sqlc)", dir, via, risk)
}

func typeName(t types.Type) string {
	return types.TypeString(t, func(p *types.Package) string { return p.Name() })
}

var readName = regexp.MustCompile(`^(Get|List|Count|Find|Select|Exists|Lookup|Search)([A-Z0-9_]|$)`)

var writeWord = regexp.MustCompile(`(?i)\b(insert|update|delete|merge|for\s+update|for\s+share|nextval|setval|pg_advisory)`)

// constantSelect reports whether call's SQL (its first string argument after
// the context) is a constant SELECT that writes nothing.
func constantSelect(info *types.Info, call *ast.CallExpr) bool {
	for _, a := range call.Args {
		tv, ok := info.Types[a]
		if !ok || !isString(tv.Type) {
			continue
		}
		if tv.Value == nil || tv.Value.Kind() != constant.String {
			return false
		}
		sql := strings.TrimSpace(constant.StringVal(tv.Value))
		return len(sql) >= 6 && strings.EqualFold(sql[:6], "select") && !writeWord.MatchString(sql)
	}
	return false
}

func isString(t types.Type) bool {
	b, ok := t.Underlying().(*types.Basic)
	return ok && b.Info()&types.IsString != 0
}

// fromTx reports whether recv, a sqlc Queries, is built from the
// operation's tx: New(tx), x.WithTx(tx), or a variable assigned only those.
func fromTx(info *types.Info, body *ast.BlockStmt, recv ast.Expr, isOpTx func(ast.Expr) bool) bool {
	built := func(e ast.Expr) bool {
		call, ok := ast.Unparen(e).(*ast.CallExpr)
		return ok && len(call.Args) == 1 && isOpTx(call.Args[0])
	}
	if built(recv) {
		return true
	}
	id, ok := ast.Unparen(recv).(*ast.Ident)
	if !ok {
		return false
	}
	v := info.Uses[id]
	assigned, all := 0, true
	ast.Inspect(body, func(n ast.Node) bool {
		as, ok := n.(*ast.AssignStmt)
		if !ok || len(as.Lhs) != len(as.Rhs) {
			return true
		}
		for i, l := range as.Lhs {
			if lid, ok := l.(*ast.Ident); ok && info.ObjectOf(lid) == v {
				assigned++
				all = all && built(as.Rhs[i])
			}
		}
		return true
	})
	return assigned > 0 && all
}
