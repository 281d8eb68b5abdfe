package generator

import (
	"bytes"
	"go/ast"
	"go/parser"
	"go/token"
	"go/types"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/tools/go/ast/astutil"
	"golang.org/x/tools/go/packages"
)

// reportLoadErrors adds the package's load, parse and type errors, except
// those at a use of a name this run generates. Generated files are excluded
// while loading (LoadTag), so code that calls generated functions cannot
// type-check until they exist, and generating them is the cure. The test is
// on the syntax and type information at the error's position, never on the
// wording of the type checker's message.
func reportLoadErrors(pkg *packages.Package, emitted map[string]map[string]bool, errs *errorSink) {
	expected := map[string]bool{} // "file:line:col" of errors at a generated name
	for _, te := range pkg.TypeErrors {
		if usesGenerated(pkg, te.Pos, emitted) {
			expected[te.Fset.Position(te.Pos).String()] = true
		}
	}
	typeErrors := len(pkg.TypeErrors) > 0
	for _, e := range pkg.Errors {
		// go list -export compiles the package too and reports the
		// compiler's text as one error; the type checker's own errors say
		// the same with positions.
		if typeErrors && e.Kind == packages.ListError && strings.HasPrefix(e.Msg, "# ") {
			continue
		}
		if e.Kind == packages.TypeError && expected[e.Pos] {
			continue
		}
		errs.add(parsePos(e.Pos), "%s", e.Msg)
	}
}

// usesGenerated reports whether pos is an unresolved identifier naming
// something this run generates: Name of the package itself, pkg.Name of a
// generated package, or x.Name where x's type belongs to one.
func usesGenerated(pkg *packages.Package, pos token.Pos, emitted map[string]map[string]bool) bool {
	for _, file := range pkg.Syntax {
		if pos < file.FileStart || pos > file.FileEnd {
			continue
		}
		path, _ := astutil.PathEnclosingInterval(file, pos, pos)
		if len(path) == 0 {
			return false
		}
		id, ok := path[0].(*ast.Ident)
		if !ok || id.Pos() != pos || pkg.TypesInfo.Uses[id] != nil {
			return false
		}
		sel, ok := path[1].(*ast.SelectorExpr)
		if !ok || sel.Sel != id {
			return emitted[pkg.PkgPath][id.Name]
		}
		if x, ok := sel.X.(*ast.Ident); ok {
			if pn, ok := pkg.TypesInfo.Uses[x].(*types.PkgName); ok {
				return emitted[pn.Imported().Path()][id.Name]
			}
		}
		t := pkg.TypesInfo.TypeOf(sel.X)
		if p, ok := t.(*types.Pointer); ok {
			t = p.Elem()
		}
		if n, ok := types.Unalias(t).(*types.Named); ok && n.Obj().Pkg() != nil {
			return emitted[n.Obj().Pkg().Path()][id.Name]
		}
		return false
	}
	return false
}

// warnIgnoredDirectives warns about directives idemgen does not generate
// from in this run: in _test.go files (idemgen generates for the package as
// it is built, never for its tests) and in files the current build tags
// exclude (generated only when the tags that select them are given).
func warnIgnoredDirectives(pkg *packages.Package, bc *buildConfig, warn func(token.Position, string, ...any)) {
	dir := pkgDir(pkg)
	if dir == "" {
		return
	}
	tests, _ := filepath.Glob(filepath.Join(dir, "*_test.go"))
	for _, path := range tests {
		for _, d := range directivesIn(path) {
			warn(d.pos, "%s in a _test.go file is ignored: idemgen generates only from the package's non-test files", d.word)
		}
	}
	for _, path := range pkg.IgnoredFiles {
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") || isGeneratedName(path) {
			continue
		}
		why := "the current build tags exclude this file"
		if len(bc.tags) > 0 {
			why = "build tags " + strings.Join(bc.tags, ",") + " exclude this file"
		}
		for _, d := range directivesIn(path) {
			warn(d.pos, "%s is not generated in this run: %s; run idemgen with -tags that select it", d.word, why)
		}
	}
}

// foundDirective is a directive line found outside the loaded files.
type foundDirective struct {
	pos  token.Position
	word string // //idem:http
}

// directivesIn returns the directives in the Go file at path.
func directivesIn(path string) []foundDirective {
	src, err := os.ReadFile(path)
	if err != nil || !bytes.Contains(src, []byte(directivePrefix)) {
		return nil
	}
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, path, src, parser.ParseComments|parser.SkipObjectResolution)
	if err != nil && f == nil {
		return nil
	}
	var out []foundDirective
	for _, cg := range f.Comments {
		for _, c := range cg.List {
			if strings.HasPrefix(c.Text, directivePrefix) {
				out = append(out, foundDirective{fset.Position(c.Slash), firstWord(c.Text)})
			}
		}
	}
	return out
}
