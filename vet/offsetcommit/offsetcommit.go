// Package offsetcommit reports a Kafka offset commit or mark that can run
// before the Commit of a database transaction in the same function: if the
// process dies, or the database commit fails, in between, the event counts as
// consumed while its writes are lost.
package offsetcommit

import (
	"fmt"
	"go/ast"
	"go/types"

	"golang.org/x/tools/go/analysis"
	"golang.org/x/tools/go/cfg"

	"github.com/idemgen/idemgen/vet/internal/vetutil"
)

// Analyzer is the offsetcommit check.
var Analyzer = &analysis.Analyzer{
	Name: "offsetcommit",
	Doc: `report Kafka offsets committed or marked before the database commit

A consumer must commit its offsets only after the transaction that records the
event's effects has committed. A CommitRecords, CommitUncommittedOffsets,
CommitMarkedOffsets, CommitOffsets, CommitOffsetsSync, MarkCommitRecords or
MarkCommitOffsets call (franz-go) from which a transaction's Commit (or
pgx.BeginFunc) is reachable in the same function acknowledges the event before
its writes are durable: a crash or failed commit in between loses the event.
A call to a function that commits (a commitsTx fact) counts as the commit. A
deferred offset call in a function that commits runs on the error path too and
is reported; so is one in a goroutine started before the commit, and one
after a pgx.BeginFunc or committing helper whose error is dropped.
A path that returns first (the "already processed, commit the offset and
return" branch) and the next round of a loop (other records) do not count.`,
	URL:       "https://github.com/idemgen/idemgen#idemgen-vet",
	Run:       run,
	FactTypes: []analysis.Fact{new(commitsFact)},
}

// commitsFact marks a function that commits a database transaction (directly,
// with pgx.BeginFunc, or through another such function): calling it counts as
// a commit, so "mark the offset, then call store()" is caught when store
// commits.
type commitsFact struct{}

func (*commitsFact) AFact()         {}
func (*commitsFact) String() string { return "commitsTx" }

var offsetMethods = []string{
	"CommitRecords", "CommitUncommittedOffsets", "CommitMarkedOffsets", "CommitOffsets",
	"CommitOffsetsSync", "MarkCommitRecords", "MarkCommitOffsets",
}

type site struct {
	call  *ast.CallExpr
	block *cfg.Block
	index int // of the node in block.Nodes
}

func run(pass *analysis.Pass) (any, error) {
	r := vetutil.NewReporter(pass)
	info := pass.TypesInfo
	exportCommits(pass)
	vetutil.FuncBodies(pass, func(_ *ast.FuncDecl, _ *ast.FuncType, body *ast.BlockStmt) {
		// Cheap test first: most functions have neither.
		var hasOffset, hasCommit bool
		vetutil.InspectShallow(body, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.GoStmt:
				hasOffset = hasOffset || unguardedOffset(info, n.Call) != nil
			case *ast.DeferStmt:
				hasOffset = hasOffset || unguardedOffset(info, n.Call) != nil
			}
			if call, ok := n.(*ast.CallExpr); ok {
				hasOffset = hasOffset || isOffset(info, call)
				hasCommit = hasCommit || commits(pass, call)
			}
			return true
		})
		if !hasOffset || !hasCommit {
			return
		}
		g := cfg.New(body, func(call *ast.CallExpr) bool { return mayReturn(info, call) })
		var offsets, commitSites, dropped []site
		for _, b := range g.Blocks {
			for i, node := range b.Nodes {
				if d, ok := node.(*ast.DeferStmt); ok {
					// A deferred call runs at return, after the commit,
					// but also on every error path: a failed commit or
					// handler still acknowledges the event.
					if call := unguardedOffset(info, d.Call); call != nil {
						f := vetutil.Callee(info, call)
						r.Report(call, fmt.Sprintf("deferred Kafka offset %s runs on every return, also when the transaction's commit fails or the handler returns an error: the event counts as consumed but its writes are lost (lost event); commit or mark the offsets after Commit returns nil, not in a defer",
							verb(f.Name())))
					}
					continue
				}
				if gs, ok := node.(*ast.GoStmt); ok {
					// A goroutine started before the commit may commit
					// the offsets before it.
					if call := unguardedOffset(info, gs.Call); call != nil {
						offsets = append(offsets, site{call, b, i})
					}
					continue
				}
				vetutil.InspectShallow(node, func(n ast.Node) bool {
					call, ok := n.(*ast.CallExpr)
					if !ok {
						return true
					}
					if isOffset(info, call) {
						offsets = append(offsets, site{call, b, i})
					}
					if commits(pass, call) {
						commitSites = append(commitSites, site{call, b, i})
						// pgx.BeginFunc(...) or store(...) with its error
						// dropped (a dropped tx.Commit error is
						// swallowcancel's finding).
						if !vetutil.IsTx(info.TypeOf(vetutil.Receiver(info, call))) && errorDropped(node, call) {
							dropped = append(dropped, site{call, b, i})
						}
					}
					return true
				})
			}
		}
		for _, d := range dropped {
			if o := reachableCommit(d, offsets); o != nil {
				f := vetutil.Callee(info, d.call)
				r.Report(d.call, fmt.Sprintf("error of %s, which commits a transaction, is dropped before the Kafka offset %s at line %d: if the commit fails the offset still acknowledges the event (lost event); return the error before committing the offset",
					f.Name(), verb(vetutil.Callee(info, o.call).Name()), pass.Fset.Position(o.call.Pos()).Line))
			}
		}
		for _, o := range offsets {
			if c := reachableCommit(o, commitSites); c != nil {
				f := vetutil.Callee(info, o.call)
				where := ""
				if !isCommit(info, c.call) {
					where = " (in " + vetutil.Callee(info, c.call).Name() + ")"
				}
				r.Report(o.call, fmt.Sprintf("Kafka offset %s runs before the transaction's commit%s at line %d: if the process dies or the commit fails in between, the event counts as consumed but its writes are lost (lost event); commit or mark the offsets only after Commit returns nil",
					verb(f.Name()), where, pass.Fset.Position(c.call.Pos()).Line))
			}
		}
	})
	return nil, nil
}

// errorDropped reports whether node, a statement, discards call's error:
// call as a statement, or assigned only to _.
func errorDropped(node ast.Node, call *ast.CallExpr) bool {
	switch n := node.(type) {
	case *ast.ExprStmt:
		return ast.Unparen(n.X) == call
	case *ast.AssignStmt:
		if len(n.Rhs) != 1 || ast.Unparen(n.Rhs[0]) != call {
			return false
		}
		for _, l := range n.Lhs {
			if id, ok := l.(*ast.Ident); !ok || id.Name != "_" {
				return false
			}
		}
		return true
	}
	return false
}

func verb(name string) string {
	if len(name) >= 4 && name[:4] == "Mark" {
		return "mark (" + name + ")"
	}
	return "commit (" + name + ")"
}

func isOffset(info *types.Info, call *ast.CallExpr) bool {
	return vetutil.IsMethod(vetutil.Callee(info, call), vetutil.KgoPath, "Client", offsetMethods...)
}

// unguardedOffset returns the offset call that a deferred or go statement's
// call makes: the call itself, or one in its function literal outside any
// if, switch or select (if err == nil { cl.MarkCommitRecords(r) } is the
// right way to mark in a defer). nil if none.
func unguardedOffset(info *types.Info, call *ast.CallExpr) *ast.CallExpr {
	if isOffset(info, call) {
		return call
	}
	lit, ok := ast.Unparen(call.Fun).(*ast.FuncLit)
	if !ok {
		return nil
	}
	var found *ast.CallExpr
	vetutil.InspectShallow(lit.Body, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.IfStmt, *ast.SwitchStmt, *ast.TypeSwitchStmt, *ast.SelectStmt:
			return false
		case *ast.CallExpr:
			if found == nil && isOffset(info, n) {
				found = n
			}
		}
		return found == nil
	})
	return found
}

// exportCommits marks, with commitsFact, the package's functions that commit
// a transaction, directly or through functions already marked (here or in
// the packages this one imports).
func exportCommits(pass *analysis.Pass) {
	var decls []*ast.FuncDecl
	for _, f := range pass.Files {
		for _, d := range f.Decls {
			if fd, ok := d.(*ast.FuncDecl); ok && fd.Body != nil {
				decls = append(decls, fd)
			}
		}
	}
	for changed := true; changed; {
		changed = false
		for _, fd := range decls {
			fn, ok := pass.TypesInfo.Defs[fd.Name].(*types.Func)
			if !ok || pass.ImportObjectFact(fn, new(commitsFact)) {
				continue
			}
			found := false
			// Closures count: pgx.BeginFunc's fn, a deferred commit.
			ast.Inspect(fd.Body, func(n ast.Node) bool {
				if call, ok := n.(*ast.CallExpr); ok && commits(pass, call) {
					found = true
				}
				return !found
			})
			if found {
				pass.ExportObjectFact(fn, new(commitsFact))
				changed = true
			}
		}
	}
}

// commits reports whether call commits a transaction, itself or through a
// function marked with commitsFact.
func commits(pass *analysis.Pass, call *ast.CallExpr) bool {
	if isCommit(pass.TypesInfo, call) {
		return true
	}
	f := vetutil.Callee(pass.TypesInfo, call)
	return f != nil && f.Pkg() != nil && pass.ImportObjectFact(f.Origin(), new(commitsFact))
}

// isCommit reports whether call commits a database transaction: Commit on a
// transaction, or pgx.BeginFunc/BeginTxFunc, which commit when fn succeeds.
func isCommit(info *types.Info, call *ast.CallExpr) bool {
	f := vetutil.Callee(info, call)
	if f == nil {
		return false
	}
	if vetutil.IsFunc(f, vetutil.PgxPath, "BeginFunc") || vetutil.IsFunc(f, vetutil.PgxPath, "BeginTxFunc") {
		return true
	}
	return f.Name() == "Commit" && vetutil.IsTx(info.TypeOf(vetutil.Receiver(info, call)))
}

// mayReturn is false for calls that end the goroutine or the process.
func mayReturn(info *types.Info, call *ast.CallExpr) bool {
	if id, ok := ast.Unparen(call.Fun).(*ast.Ident); ok && id.Name == "panic" {
		if _, builtin := info.Uses[id].(*types.Builtin); builtin {
			return false
		}
	}
	f := vetutil.Callee(info, call)
	switch {
	case vetutil.IsFunc(f, "os", "Exit"), vetutil.IsFunc(f, "log", "Fatal"), vetutil.IsFunc(f, "log", "Fatalf"),
		vetutil.IsFunc(f, "log", "Panic"), vetutil.IsFunc(f, "log", "Panicf"), vetutil.IsFunc(f, "runtime", "Goexit"):
		return false
	}
	return true
}

// reachableCommit returns a commit reachable from o without going round a
// loop that encloses o (its next round handles other records), or nil.
func reachableCommit(o site, commits []site) *site {
	for i, c := range commits {
		if c.block == o.block && c.index > o.index {
			return &commits[i]
		}
	}
	seen := map[*cfg.Block]bool{o.block: true}
	queue := append([]*cfg.Block(nil), o.block.Succs...)
	for len(queue) > 0 {
		b := queue[0]
		queue = queue[1:]
		if seen[b] || backEdge(b, o.call) {
			continue
		}
		seen[b] = true
		for i, c := range commits {
			if c.block == b {
				return &commits[i]
			}
		}
		queue = append(queue, b.Succs...)
	}
	// The commit's own block is o's block at a smaller index: reachable only
	// round a loop, which does not count.
	return nil
}

// backEdge reports whether entering b starts another round of a loop that
// encloses call.
func backEdge(b *cfg.Block, call ast.Node) bool {
	switch b.Kind {
	case cfg.KindForLoop, cfg.KindForPost, cfg.KindForBody, cfg.KindRangeLoop, cfg.KindRangeBody:
		return b.Stmt != nil && vetutil.Encloses(b.Stmt, call)
	}
	return false
}
