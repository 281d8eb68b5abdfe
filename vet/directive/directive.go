// Package directive reports misplaced or malformed //idem: directives with
// the generator's own messages (a comment not attached to a declaration, a
// typo in its kind or options, a function of the wrong shape), plus
// directives in files the generator never reads: test files and files
// excluded by build constraints. It also checks //idemvet:ignore comments.
package directive

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"slices"
	"strings"

	"golang.org/x/tools/go/analysis"

	"github.com/idemgen/idemgen/generator"
	"github.com/idemgen/idemgen/vet/internal/vetutil"
)

// Analyzer is the directive check.
var Analyzer = &analysis.Analyzer{
	Name: "directive",
	Doc: `report //idem: directives the generator rejects or never sees

Runs the generator's own directive checks (so the messages are the ones
idemgen prints) and reports //idem: comments in _test.go files and in files
excluded by build constraints: idemgen reads the package as go build does,
so such a directive silently generates nothing, and the function it marks runs
without idempotency. Also reports //idemvet:ignore comments without a known
check name or a reason.`,
	URL: "https://github.com/idemgen/idemgen#idemgen-vet",
	Run: run,
}

func run(pass *analysis.Pass) (any, error) {
	r := vetutil.NewReporter(pass)
	var built []*ast.File
	for _, f := range pass.Files {
		name := pass.Fset.File(f.Pos()).Name()
		if strings.HasSuffix(name, "_test.go") {
			notRead(pass, r, f.Comments, "in a _test.go file is ignored: idemgen generates only from the package's non-test files, so the code it marks runs without idempotency; move it to a non-test file")
			continue
		}
		built = append(built, f)
	}
	if len(built) > 0 {
		for _, e := range generator.CheckPackage(pass.Fset, built, pass.Pkg, pass.TypesInfo) {
			if pos := toPos(pass, built, e.Pos); pos.IsValid() {
				r.ReportAt(pos, pos, e.Msg)
			}
		}
	}
	for _, name := range pass.IgnoredFiles {
		if strings.HasSuffix(name, ".go") {
			ignoredFile(pass, r, name)
		}
	}
	checkIgnores(pass)
	return nil, nil
}

// notRead reports every //idem: comment of a file idemgen does not read,
// with the problems of its text.
func notRead(pass *analysis.Pass, r *vetutil.Reporter, comments []*ast.CommentGroup, why string) {
	// An excluded file is not among the pass's files, so the reporter does
	// not know its //idemvet:ignore comments: read them here.
	silenced := map[int]bool{}
	for _, cg := range comments {
		for _, c := range cg.List {
			if check, reason, ok := vetutil.ParseIgnore(c.Text); ok && check == r.Check && reason != "" {
				line := pass.Fset.Position(c.Slash).Line
				silenced[line], silenced[line+1] = true, true
			}
		}
	}
	for _, cg := range comments {
		for _, c := range cg.List {
			if !strings.HasPrefix(c.Text, "//idem:") || silenced[pass.Fset.Position(c.Slash).Line] {
				continue
			}
			kind, _, _ := strings.Cut(strings.TrimPrefix(c.Text, "//idem:"), " ")
			msg := fmt.Sprintf("//idem:%s %s", kind, why)
			if errs := generator.DirectiveProblems(c.Text, pass.Fset.Position(c.Slash)); len(errs) > 0 {
				msg += "; also: " + errs[0].Msg
			}
			r.ReportAt(c.Slash, c.End(), msg)
		}
	}
}

// ignoredFile reports the directives of a file build constraints exclude.
// The file is not in the pass's file set, so it is added (as the buildtag
// analyzer does) to give the diagnostics a position.
func ignoredFile(pass *analysis.Pass, r *vetutil.Reporter, name string) {
	content, err := pass.ReadFile(name)
	if err != nil || !strings.Contains(string(content), "//idem:") {
		return
	}
	// A file for another platform may not parse here; the parser still
	// returns the comments it saw.
	f, _ := parser.ParseFile(token.NewFileSet(), name, content, parser.ParseComments)
	if f == nil {
		return
	}
	tf := pass.Fset.AddFile(name, -1, len(content))
	tf.SetLinesForContent(content)
	base := f.FileStart
	var shifted []*ast.CommentGroup
	for _, cg := range f.Comments {
		var list []*ast.Comment
		for _, c := range cg.List {
			list = append(list, &ast.Comment{Slash: tf.Pos(int(c.Slash - base)), Text: c.Text})
		}
		shifted = append(shifted, &ast.CommentGroup{List: list})
	}
	notRead(pass, r, shifted, "is not generated in this run: the current build tags exclude this file, so a build with them runs the code it marks without idempotency; run idemgen (and idemgen vet) with -tags that select it, or move it to a file that is built")
}

// toPos finds the generator's position in the pass's files.
func toPos(pass *analysis.Pass, files []*ast.File, p token.Position) token.Pos {
	for _, f := range files {
		tf := pass.Fset.File(f.Pos())
		if tf.Name() != p.Filename {
			continue
		}
		if p.Line < 1 || p.Line > tf.LineCount() {
			return f.Package
		}
		pos := tf.LineStart(p.Line)
		if p.Column > 1 && int(pos)-tf.Base()+p.Column-1 <= tf.Size() {
			pos += token.Pos(p.Column - 1)
		}
		return pos
	}
	if len(files) > 0 {
		return files[0].Package
	}
	return token.NoPos
}

// checkIgnores reports //idemvet:ignore comments that silence nothing
// because they name no known check or give no reason.
func checkIgnores(pass *analysis.Pass) {
	for _, f := range pass.Files {
		for _, cg := range f.Comments {
			for _, c := range cg.List {
				check, reason, ok := vetutil.ParseIgnore(c.Text)
				switch {
				case !ok:
				case !slices.Contains(vetutil.Checks, check):
					pass.Reportf(c.Slash, "%s needs a check name (one of %s) and a reason; %q is not a check, so it silences nothing", vetutil.IgnorePrefix, strings.Join(vetutil.Checks, ", "), check)
				case reason == "":
					pass.Reportf(c.Slash, "%s %s needs a reason after the check name, for the reader who meets it; without one it silences nothing", vetutil.IgnorePrefix, check)
				}
			}
		}
	}
}
