package generator

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/tools/go/packages"
)

// goList runs go list as go/packages' go list driver does for mode, and
// converts its output the same way for the cases the vet-like loader
// handles, without the go/packages driver's extra go command that asks the
// go version before every load (one more process on the critical path of
// every run, two for the two loads that run side by side).
//
// It reports ok=false, and the caller loads with packages.Load instead,
// whenever go/packages would do something other than run go list and
// convert its output: an external driver (GOPACKAGESDRIVER, or a
// gopackagesdriver on PATH), a query pattern (file=, pattern=), a go
// command that fails (go/packages turns some failures into packages with
// errors, and words the others), or output that does not decode. A package
// with an error is returned as it is; the vet-like loader gives way to
// go/packages for it anyway.
//
// The packages returned are those go list was asked for (not DepOnly), with
// Imports linked to the listed dependencies when mode has NeedDeps.
func goList(ctx context.Context, cfg Config, bc *buildConfig, mode packages.LoadMode, patterns []string) (pkgs []*packages.Package, ok bool, err error) {
	env := cfg.Env
	if env == nil {
		env = os.Environ()
	}
	if usesExternalDriver(env) {
		return nil, false, nil
	}
	for _, p := range patterns {
		if strings.Contains(p, "=") {
			return nil, false, nil // a go/packages query
		}
	}
	export := mode&packages.NeedExportFile != 0
	deps := mode&packages.NeedImports != 0
	fields := []string{"Name", "ImportPath", "Error", "Dir"}
	if mode&packages.NeedFiles != 0 {
		fields = append(fields, "GoFiles", "IgnoredGoFiles", "IgnoredOtherFiles", "CFiles", "CgoFiles", "CXXFiles",
			"MFiles", "HFiles", "FFiles", "SFiles", "SwigFiles", "SwigCXXFiles", "SysoFiles")
	}
	if deps {
		fields = append(fields, "DepOnly", "Imports", "ImportMap")
	}
	if export {
		fields = append(fields, "Export")
	}
	if mode&packages.NeedModule != 0 {
		fields = append(fields, "Module")
	}
	// go/packages' arguments for these modes (golistargs), the build flags
	// once rather than twice.
	args := []string{"list", "-e", "-json=" + strings.Join(fields, ","),
		"-compiled=false", "-test=false",
		fmt.Sprintf("-export=%t", export), fmt.Sprintf("-deps=%t", deps), "-find=false",
		"-buildvcs=false", "-pgo=off"}
	args = append(args, bc.loadFlags...)
	args = append(args, "--")
	args = append(args, patterns...)

	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = cfg.Dir
	// PWD as go/packages sets it, so that the go command reports paths
	// under Dir as given, not with symbolic links resolved.
	cmd.Env = append(append([]string{}, env...), "PWD="+cfg.Dir)
	setProcessGroup(cmd)
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = time.Second
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			return nil, false, ctx.Err()
		}
		return nil, false, nil
	}

	type jsonPackage struct {
		ImportPath, Name, Dir, Export                        string
		GoFiles, CgoFiles, IgnoredGoFiles, IgnoredOtherFiles []string
		CFiles, CXXFiles, MFiles, HFiles, FFiles, SFiles     []string
		SwigFiles, SwigCXXFiles, SysoFiles                   []string
		Imports                                              []string
		ImportMap                                            map[string]string
		DepOnly                                              bool
		Module                                               *packages.Module
		Error                                                *struct{ Pos, Err string }
	}
	byID := map[string]*packages.Package{}
	var order []*packages.Package
	var roots []*packages.Package
	var imports [][]string
	var importMaps []map[string]string
	for dec := json.NewDecoder(&stdout); dec.More(); {
		p := new(jsonPackage)
		if err := dec.Decode(p); err != nil {
			return nil, false, nil
		}
		if p.ImportPath == "" || strings.Contains(p.ImportPath, " ") || byID[p.ImportPath] != nil ||
			p.Dir != "" && !filepath.IsAbs(p.Dir) {
			return nil, false, nil // nothing go/packages would convert as it is
		}
		pkg := &packages.Package{
			ID:           p.ImportPath,
			PkgPath:      p.ImportPath,
			Name:         p.Name,
			Dir:          p.Dir,
			GoFiles:      absJoin(p.Dir, p.GoFiles, p.CgoFiles),
			OtherFiles:   absJoin(p.Dir, p.CFiles, p.CXXFiles, p.MFiles, p.HFiles, p.FFiles, p.SFiles, p.SwigFiles, p.SwigCXXFiles, p.SysoFiles),
			IgnoredFiles: absJoin(p.Dir, p.IgnoredGoFiles, p.IgnoredOtherFiles),
			Module:       p.Module,
			ExportFile:   p.Export,
		}
		if p.Export != "" && !filepath.IsAbs(p.Export) {
			pkg.ExportFile = filepath.Join(p.Dir, p.Export)
		}
		if p.Error != nil {
			pkg.Errors = append(pkg.Errors, packages.Error{Pos: p.Error.Pos, Msg: strings.TrimSpace(p.Error.Err), Kind: packages.ListError})
		}
		byID[pkg.ID] = pkg
		order = append(order, pkg)
		imports = append(imports, p.Imports)
		importMaps = append(importMaps, p.ImportMap)
		if !p.DepOnly {
			roots = append(roots, pkg)
		}
	}
	if deps {
		// Imports holds the IDs of the imported packages, ImportMap the
		// import paths that differ from them.
		for i, pkg := range order {
			pkg.Imports = map[string]*packages.Package{}
			ids := map[string]bool{}
			for _, id := range imports[i] {
				ids[id] = true
			}
			for path, id := range importMaps[i] {
				delete(ids, id)
				if pkg.Imports[path] = byID[id]; byID[id] == nil {
					return nil, false, nil
				}
			}
			for id := range ids {
				if id == "C" {
					continue
				}
				if pkg.Imports[id] = byID[id]; byID[id] == nil {
					return nil, false, nil
				}
			}
		}
	}
	return roots, true, nil
}

// usesExternalDriver reports whether go/packages would ask an external
// driver rather than go list (go/packages' findExternalDriver).
func usesExternalDriver(env []string) bool {
	tool := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "GOPACKAGESDRIVER="); ok {
			tool = v
		}
	}
	if tool == "off" {
		return false
	}
	if tool != "" {
		return true
	}
	_, err := exec.LookPath("gopackagesdriver")
	return err == nil
}

func absJoin(dir string, lists ...[]string) []string {
	var out []string
	for _, l := range lists {
		for _, f := range l {
			if !filepath.IsAbs(f) {
				f = filepath.Join(dir, f)
			}
			out = append(out, f)
		}
	}
	return out
}
