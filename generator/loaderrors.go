package generator

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"go/types"
	"os"
	"path/filepath"
	"slices"
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
//
// It returns the errors left: the caller reports them, or first checks them
// against the generated files (recheck), since the syntax test cannot see
// every use of a generated name (a method promoted through an embedded
// field, an interface the generated method satisfies).
//
// suppressed reports whether an error was left out as a use of a generated
// name: such a use (orders.RegisterIdemRoutes(mux) with too few arguments)
// can only be judged once the name exists, so the caller rechecks the
// package too.
func reportLoadErrors(pkg *packages.Package, emitted map[string]map[string]bool) (out []packages.Error, suppressed bool) {
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
			suppressed = true
			continue
		}
		out = append(out, e)
	}
	return out, suppressed
}

// recheck loads the packages with load errors again as the user's build
// sees them once the files of this run are written (an overlay: nothing is
// written yet), and returns the errors each still has. An error that goes
// away was a use of a name this run generates. The generated files take
// part, so an error in them is reported too: idemgen succeeds only if the
// packages build with what it would write. ok is false if the packages could
// not be loaded; then the caller reports the errors it had.
//
// It loads like go vet (loadLikeVet), with the overlay given to the go
// command as an -overlay file: only these packages are type-checked from
// source, their dependencies come from export data the go command builds
// with the overlay. go/packages with Config.Overlay type-checks every
// dependency from source (pgx, net/http, ...) and is used only where the
// vet-like loader gives way to it.
func recheck(ctx context.Context, cfg Config, bc *buildConfig, pkgPaths []string, files []File) (errs map[string][]packages.Error, ok bool) {
	overlay := map[string][]byte{}
	for _, f := range files {
		overlay[f.Path] = f.Content
		if f.Content == nil {
			// An orphan is deleted: an empty file of no build.
			overlay[f.Path] = []byte("//go:build ignore\n\npackage ignored\n")
		}
	}
	var pkgs []*packages.Package
	err := errSlowPath
	if ctx.Value(goPackagesOnly{}) == nil {
		pkgs, err = recheckLikeVet(ctx, cfg, bc, pkgPaths, overlay)
	}
	if errors.Is(err, errSlowPath) {
		pkgs, err = packages.Load(&packages.Config{
			Context:    ctx,
			Mode:       loadMode,
			Dir:        cfg.Dir,
			Env:        cfg.Env,
			BuildFlags: bc.userFlags,
			Overlay:    overlay,
		}, pkgPaths...)
	}
	if err != nil {
		return nil, false
	}
	errs = map[string][]packages.Error{}
	for _, p := range pkgs {
		typeErrors := len(p.TypeErrors) > 0
		for _, e := range p.Errors {
			if typeErrors && e.Kind == packages.ListError && strings.HasPrefix(e.Msg, "# ") {
				continue
			}
			errs[p.PkgPath] = append(errs[p.PkgPath], e)
		}
	}
	for _, path := range pkgPaths {
		if _, found := errs[path]; !found && !slices.ContainsFunc(pkgs, func(p *packages.Package) bool { return p.PkgPath == path }) {
			return nil, false
		}
	}
	return errs, true
}

// recheckLikeVet is recheck's load with loadLikeVet: overlay is written to
// a temporary directory, with the JSON file that maps each path to its
// copy (go help build, -overlay), removed again when the load is done.
func recheckLikeVet(ctx context.Context, cfg Config, bc *buildConfig, pkgPaths []string, overlay map[string][]byte) ([]*packages.Package, error) {
	dir, err := os.MkdirTemp("", "idemgen-overlay-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	replace := map[string]string{}
	for path, content := range overlay {
		// One flat directory: a numbered copy per file, since packages
		// share file names (idem_gen.go).
		copyPath := filepath.Join(dir, fmt.Sprintf("%d-%s", len(replace), filepath.Base(path)))
		if err := os.WriteFile(copyPath, content, 0o644); err != nil {
			return nil, err
		}
		replace[path] = copyPath
	}
	js, err := json.Marshal(struct{ Replace map[string]string }{replace})
	if err != nil {
		return nil, err
	}
	jsonFile := filepath.Join(dir, "overlay.json")
	if err := os.WriteFile(jsonFile, js, 0o644); err != nil {
		return nil, err
	}
	return loadLikeVet(ctx, cfg, bc.withOverlay(jsonFile, overlay), pkgPaths)
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
