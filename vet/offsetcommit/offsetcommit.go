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
A path that returns first (the "already processed, commit the offset and
return" branch) and the next round of a loop (other records) do not count.`,
	URL: "https://github.com/idemgen/idemgen#idemgen-vet",
	Run: run,
}

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
	vetutil.FuncBodies(pass, func(_ *ast.FuncDecl, _ *ast.FuncType, body *ast.BlockStmt) {
		// Cheap test first: most functions have neither.
		var hasOffset, hasCommit bool
		vetutil.InspectShallow(body, func(n ast.Node) bool {
			if call, ok := n.(*ast.CallExpr); ok {
				hasOffset = hasOffset || isOffset(info, call)
				hasCommit = hasCommit || isCommit(info, call)
			}
			return true
		})
		if !hasOffset || !hasCommit {
			return
		}
		g := cfg.New(body, func(call *ast.CallExpr) bool { return mayReturn(info, call) })
		var offsets, commits []site
		for _, b := range g.Blocks {
			for i, node := range b.Nodes {
				if _, ok := node.(*ast.DeferStmt); ok {
					continue // a deferred call runs at return, not here
				}
				vetutil.InspectShallow(node, func(n ast.Node) bool {
					call, ok := n.(*ast.CallExpr)
					if !ok {
						return true
					}
					if isOffset(info, call) {
						offsets = append(offsets, site{call, b, i})
					}
					if isCommit(info, call) {
						commits = append(commits, site{call, b, i})
					}
					return true
				})
			}
		}
		for _, o := range offsets {
			if c := reachableCommit(o, commits); c != nil {
				f := vetutil.Callee(info, o.call)
				r.Report(o.call, fmt.Sprintf("Kafka offset %s runs before the transaction's commit at line %d: if the process dies or the commit fails in between, the event counts as consumed but its writes are lost (lost event); commit or mark the offsets only after Commit returns nil",
					verb(f.Name()), pass.Fset.Position(c.call.Pos()).Line))
			}
		}
	})
	return nil, nil
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
