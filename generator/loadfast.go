package generator

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"go/ast"
	"go/build"
	"go/parser"
	"go/scanner"
	"go/token"
	"go/types"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/tools/go/gcexportdata"
	"golang.org/x/tools/go/packages"
)

// errSlowPath makes loadLikeVet give way to the go/packages loader.
var errSlowPath = errors.New("use go/packages")

// loadLikeVet loads the packages matching patterns the way go vet does: go
// list without -export for the packages themselves (so they are not
// compiled), export data for their direct dependencies only, and one
// type-check of each package from source. go/packages with NeedTypes would
// compile every matched package to produce export data nothing reads.
//
// For anything unusual (a go list error, a dependency without export data
// because it does not compile, a package the loader cannot place, cgo) it
// returns errSlowPath, and the caller loads with go/packages, which handles
// every case; both produce the same Package fields idemgen reads.
func loadLikeVet(ctx context.Context, cfg Config, bc *buildConfig, patterns []string) ([]*packages.Package, error) {
	// The second go list, for the dependencies' export data, need not wait
	// for the first: it starts at once on the imports read from the roots'
	// files, and is used only if go list then reports the same ones.
	var early *exportLoad
	if ids := guessDeps(cfg, bc, patterns); len(ids) > 0 {
		early = startExportLoad(ctx, cfg, bc, ids)
		defer early.stop()
	}
	// Without NeedCompiledGoFiles: go list -compiled prepares the build of
	// every dependency and takes twice as long. The compiled files are the
	// Go files unless cgo or SWIG generates more, and such a package is
	// left to go/packages.
	const metaMode = packages.NeedName | packages.NeedFiles | packages.NeedImports | packages.NeedDeps | packages.NeedModule
	meta, ok, err := goList(ctx, cfg, bc, metaMode, patterns)
	if err == nil && !ok {
		meta, err = packages.Load(&packages.Config{
			Context:    ctx,
			Mode:       metaMode,
			Dir:        cfg.Dir,
			Env:        cfg.Env,
			BuildFlags: bc.loadFlags,
		}, patterns...)
	}
	if err != nil {
		return nil, fmt.Errorf("load %s: %w", strings.Join(patterns, " "), err)
	}
	roots := map[string]*packages.Package{} // by ID
	for _, p := range meta {
		if len(p.Errors) > 0 || p.Module == nil || slices.ContainsFunc(p.OtherFiles, isSWIG) {
			return nil, errSlowPath
		}
		p.CompiledGoFiles = p.GoFiles
		roots[p.ID] = p
	}
	// A dependency that itself imports one of the packages loaded from
	// source would bring a second, export-data copy of that package's types
	// (go/packages then loads the dependency from source too).
	reaches := map[string]bool{}
	var reachesRoot func(p *packages.Package) bool
	reachesRoot = func(p *packages.Package) bool {
		if r, ok := reaches[p.ID]; ok {
			return r
		}
		reaches[p.ID] = false // cycles are reported by go list
		for _, imp := range p.Imports {
			if roots[imp.ID] != nil || reachesRoot(imp) {
				reaches[p.ID] = true
				return true
			}
		}
		return false
	}
	// The direct dependencies that are not loaded from source.
	var depIDs []string
	seen := map[string]bool{}
	for _, p := range meta {
		for _, imp := range p.Imports {
			if roots[imp.ID] == nil && imp.ID != "unsafe" && !seen[imp.ID] {
				if reachesRoot(imp) {
					return nil, errSlowPath
				}
				seen[imp.ID] = true
				depIDs = append(depIDs, imp.ID)
			}
		}
	}
	exports := map[string]string{} // ID → export data file
	fset := token.NewFileSet()
	sizes := types.SizesFor("gc", bc.ctx.GOARCH)
	var mu sync.Mutex // guards imported and fset's use by gcexportdata
	imported := map[string]*types.Package{}
	importDep := func(id string) (*types.Package, error) {
		mu.Lock()
		defer mu.Unlock()
		if p := imported[id]; p != nil && p.Complete() {
			return p, nil
		}
		f, err := os.Open(exports[id])
		if err != nil {
			return nil, err
		}
		defer f.Close()
		r, err := gcexportdata.NewReader(bufio.NewReader(f))
		if err != nil {
			return nil, fmt.Errorf("read export data of %s: %w", id, err)
		}
		return gcexportdata.Read(r, fset, imported, id)
	}

	// Parse every package's files in parallel, while go list finds the
	// dependencies' export data; then type-check the packages in import
	// order, each once.
	var wg sync.WaitGroup
	cgo := false
	var unreadable error
	for _, p := range meta {
		p.Fset = fset
		p.Syntax = make([]*ast.File, len(p.CompiledGoFiles))
		for i, name := range p.CompiledGoFiles {
			var src any // nil: the file on disk
			if b, ok := bc.overlay[name]; ok {
				src = b
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				f, err := parser.ParseFile(fset, name, src, parser.AllErrors|parser.ParseComments|parser.SkipObjectResolution)
				mu.Lock()
				defer mu.Unlock()
				p.Syntax[i] = f
				cgo = cgo || f != nil && importsC(f)
				var list scanner.ErrorList
				if errors.As(err, &list) {
					for _, e := range list {
						p.Errors = append(p.Errors, packages.Error{Pos: e.Pos.String(), Msg: e.Msg, Kind: packages.ParseError})
					}
				} else if err != nil {
					// Not a syntax error: a file the go command listed could
					// not be read (one that only a GOFLAGS -overlay adds,
					// say). Its directives would be missed: an error, not
					// output without them (go/packages drops such a file).
					if unreadable == nil {
						unreadable = err
					}
				}
			}()
		}
	}
	sort.Strings(depIDs)
	if len(depIDs) > 0 {
		// The early go list ran with exactly these arguments, so its result
		// is the one a go list started now would give; a wrong guess is
		// abandoned.
		var deps []*packages.Package
		if early != nil && slices.Equal(early.ids, depIDs) {
			deps, err = early.wait()
		} else {
			early.stop()
			deps, err = loadExports(ctx, cfg, bc, depIDs)
		}
		if err != nil {
			wg.Wait()
			return nil, fmt.Errorf("load dependencies of %s: %w", strings.Join(patterns, " "), err)
		}
		for _, d := range deps {
			if len(d.Errors) > 0 || d.ExportFile == "" {
				wg.Wait()
				return nil, errSlowPath
			}
			exports[d.ID] = d.ExportFile
		}
		for _, id := range depIDs {
			if exports[id] == "" {
				wg.Wait()
				return nil, errSlowPath
			}
		}
	}

	wg.Wait()
	if unreadable != nil {
		return nil, fmt.Errorf("load %s: %w (idemgen reads the package's files from disk; GOFLAGS -overlay is not supported)", strings.Join(patterns, " "), unreadable)
	}
	if cgo {
		return nil, errSlowPath
	}

	done := map[string]bool{}
	var check func(p *packages.Package, stack map[string]bool) error
	check = func(p *packages.Package, stack map[string]bool) error {
		if done[p.ID] {
			return nil
		}
		if stack[p.ID] {
			return errSlowPath // an import cycle: let go/packages report it
		}
		stack[p.ID] = true
		for _, imp := range p.Imports {
			if r := roots[imp.ID]; r != nil {
				if err := check(r, stack); err != nil {
					return err
				}
			}
		}
		delete(stack, p.ID)
		done[p.ID] = true

		var syntax []*ast.File
		for _, f := range p.Syntax {
			if f != nil {
				syntax = append(syntax, f)
			}
		}
		p.Types = types.NewPackage(p.PkgPath, p.Name)
		p.TypesInfo = &types.Info{
			Types:        map[ast.Expr]types.TypeAndValue{},
			Defs:         map[*ast.Ident]types.Object{},
			Uses:         map[*ast.Ident]types.Object{},
			Implicits:    map[ast.Node]types.Object{},
			Selections:   map[*ast.SelectorExpr]*types.Selection{},
			Scopes:       map[ast.Node]*types.Scope{},
			Instances:    map[*ast.Ident]types.Instance{},
			FileVersions: map[*ast.File]string{},
		}
		p.TypesSizes = sizes
		tc := &types.Config{
			Importer: importerFunc(func(path string) (*types.Package, error) {
				if path == "unsafe" {
					return types.Unsafe, nil
				}
				imp := p.Imports[path]
				if imp == nil {
					return nil, fmt.Errorf("no metadata for %s", path)
				}
				if r := roots[imp.ID]; r != nil {
					return r.Types, nil
				}
				return importDep(imp.ID)
			}),
			Sizes: sizes,
			Error: func(err error) {
				var te types.Error
				if !errors.As(err, &te) {
					p.Errors = append(p.Errors, packages.Error{Msg: err.Error(), Kind: packages.UnknownError})
					return
				}
				p.TypeErrors = append(p.TypeErrors, te)
				p.Errors = append(p.Errors, packages.Error{Pos: te.Fset.Position(te.Pos).String(), Msg: te.Msg, Kind: packages.TypeError})
			},
		}
		if p.Module != nil && p.Module.GoVersion != "" {
			tc.GoVersion = "go" + p.Module.GoVersion
		}
		_ = types.NewChecker(tc, fset, p.Types, p.TypesInfo).Files(syntax)
		p.IllTyped = len(p.Errors) > 0
		return nil
	}
	for _, p := range meta {
		if err := check(p, map[string]bool{}); err != nil {
			return nil, err
		}
	}
	sort.Slice(meta, func(i, j int) bool { return meta[i].PkgPath < meta[j].PkgPath })
	return meta, nil
}

// isSWIG reports whether path is a SWIG interface file, from which the go
// command generates Go files.
func isSWIG(path string) bool {
	return strings.HasSuffix(path, ".swig") || strings.HasSuffix(path, ".swigcxx")
}

// importsC reports whether f uses cgo, whose generated Go files the go
// command compiles in place of f.
func importsC(f *ast.File) bool {
	for _, imp := range f.Imports {
		if path, _ := strconv.Unquote(imp.Path.Value); path == "C" {
			return true
		}
	}
	return false
}

// loadExports runs go list -export for the packages ids.
func loadExports(ctx context.Context, cfg Config, bc *buildConfig, ids []string) ([]*packages.Package, error) {
	const mode = packages.NeedName | packages.NeedExportFile
	if pkgs, ok, err := goList(ctx, cfg, bc, mode, ids); ok || err != nil {
		return pkgs, err
	}
	return packages.Load(&packages.Config{
		Context:    ctx,
		Mode:       mode,
		Dir:        cfg.Dir,
		Env:        cfg.Env,
		BuildFlags: bc.loadFlags,
	}, ids...)
}

// guessDeps returns, sorted, the packages the files of patterns import as
// go/build selects those files for the loading build, or nil when a pattern
// is not a plain directory or a package is unusual (cgo, unreadable). It is
// a guess at the direct dependencies go list will report: the go command
// may judge files differently (GOFLAGS in go env, a toolchain's default
// tags), and one pattern's package may import another's.
func guessDeps(cfg Config, bc *buildConfig, patterns []string) []string {
	if bc.overlay != nil {
		return nil // the files are not the ones on disk, the tags not LoadTag's
	}
	bctx := bc.ctx
	bctx.BuildTags = append(slices.Clone(bc.tags), LoadTag)
	seen := map[string]bool{}
	var ids []string
	for _, pattern := range patterns {
		if strings.Contains(pattern, "...") || !build.IsLocalImport(pattern) && !filepath.IsAbs(pattern) {
			return nil
		}
		dir := pattern
		if !filepath.IsAbs(dir) {
			dir = filepath.Join(cfg.Dir, dir)
		}
		p, err := bctx.ImportDir(dir, 0)
		if err != nil || len(p.CgoFiles) > 0 {
			return nil
		}
		for _, path := range p.Imports {
			if path != "unsafe" && !seen[path] {
				seen[path] = true
				ids = append(ids, path)
			}
		}
	}
	sort.Strings(ids)
	return ids
}

// exportLoad is a go list -export started early, on guessed dependencies.
type exportLoad struct {
	ids    []string
	cancel context.CancelFunc
	done   chan struct{}
	pkgs   []*packages.Package
	err    error
}

func startExportLoad(ctx context.Context, cfg Config, bc *buildConfig, ids []string) *exportLoad {
	ctx, cancel := context.WithCancel(ctx)
	l := &exportLoad{ids: ids, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(l.done)
		l.pkgs, l.err = loadExports(ctx, cfg, bc, ids)
	}()
	return l
}

// wait returns the load's result.
func (l *exportLoad) wait() ([]*packages.Package, error) {
	<-l.done
	return l.pkgs, l.err
}

// stop ends the load if it is still running and waits for its go command
// to exit, so that none outlives the call that started it.
func (l *exportLoad) stop() {
	if l == nil {
		return
	}
	l.cancel()
	<-l.done
}

type importerFunc func(path string) (*types.Package, error)

func (f importerFunc) Import(path string) (*types.Package, error) { return f(path) }
