package generator

import (
	"go/ast"
	"go/token"
	"go/types"
	"strings"

	"golang.org/x/tools/go/packages"
)

// CheckPackage runs the generator's directive checks (placement, kind,
// options, the shape of what each directive annotates, name collisions) on
// one package that the caller has already parsed and type-checked, and
// returns the problems Generate would report, with the same messages. It
// generates nothing. files must be the files the generator reads: the
// package's non-test Go files for the build tags in use; idemgen vet (an
// analysis pass) calls it so editors show the generator's errors.
func CheckPackage(fset *token.FileSet, files []*ast.File, pkg *types.Package, info *types.Info) ErrorList {
	var names []string
	for _, f := range files {
		names = append(names, fset.Position(f.Package).Filename)
	}
	p := &packages.Package{
		PkgPath:         pkg.Path(),
		Name:            pkg.Name(),
		Fset:            fset,
		GoFiles:         names,
		CompiledGoFiles: names,
		Syntax:          files,
		Types:           pkg,
		TypesInfo:       info,
	}
	errs := &errorSink{}
	buildModel(p, errs)
	return errs.errs
}

// DirectiveProblems parses one comment that starts with //idem: and returns
// the problems the generator reports for its text (unknown kind, unknown or
// invalid options), positioned from pos, the comment's "//". It checks the
// text alone, not where the comment is.
func DirectiveProblems(text string, pos token.Position) ErrorList {
	if !strings.HasPrefix(text, directivePrefix) {
		return nil
	}
	_, errs := parseDirective(text, pos)
	return errs
}
