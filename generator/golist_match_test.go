package generator

import (
	"context"
	"fmt"
	"sort"
	"strings"

	"golang.org/x/tools/go/packages"
)

// goListMatches is GoListMatches (export_test.go); it lives in the package
// so that it can compare with every mode goList is used in.
func goListMatches(ctx context.Context, cfg Config, bc *buildConfig, patterns []string) (string, error) {
	modes := []packages.LoadMode{
		packages.NeedName | packages.NeedFiles | packages.NeedImports | packages.NeedDeps | packages.NeedModule,
		packages.NeedName | packages.NeedExportFile,
	}
	for _, mode := range modes {
		fast, ok, err := goList(ctx, cfg, bc, mode, patterns)
		if err != nil || !ok {
			return "", fmt.Errorf("goList: ok=%v err=%v", ok, err)
		}
		slow, err := packages.Load(&packages.Config{Context: ctx, Mode: mode, Dir: cfg.Dir, Env: cfg.Env, BuildFlags: bc.loadFlags}, patterns...)
		if err != nil {
			return "", err
		}
		if a, b := describePackages(fast), describePackages(slow); a != b {
			return fmt.Sprintf("mode %v:\n--- goList\n%s\n--- packages.Load\n%s", mode, a, b), nil
		}
	}
	return "", nil
}

// describePackages prints the fields the vet-like loader reads of pkgs and
// of every package they import, transitively.
func describePackages(pkgs []*packages.Package) string {
	var lines []string
	seen := map[*packages.Package]bool{}
	var walk func(p *packages.Package, root bool)
	walk = func(p *packages.Package, root bool) {
		if seen[p] {
			return
		}
		seen[p] = true
		var imps []string
		for path, imp := range p.Imports {
			imps = append(imps, path+"="+imp.ID)
		}
		sort.Strings(imps)
		mod := "<nil>"
		if m := p.Module; m != nil {
			mod = fmt.Sprintf("%s@%s main=%v dir=%s gomod=%s go=%s replace=%v", m.Path, m.Version, m.Main, m.Dir, m.GoMod, m.GoVersion, m.Replace != nil)
		}
		var errs []string
		for _, e := range p.Errors {
			errs = append(errs, e.Error())
		}
		lines = append(lines, fmt.Sprintf("%s root=%v id=%s name=%s dir=%s\n  go=%v\n  compiled=%v\n  other=%v\n  ignored=%v\n  export=%v\n  module=%s\n  imports=%v\n  errors=%v",
			p.PkgPath, root, p.ID, p.Name, p.Dir, p.GoFiles, p.CompiledGoFiles, p.OtherFiles, p.IgnoredFiles, p.ExportFile != "", mod, imps, errs))
		for _, imp := range p.Imports {
			walk(imp, false)
		}
	}
	for _, p := range pkgs {
		walk(p, true)
	}
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}
