package readme_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"go/ast"
	"go/format"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/tools/go/ast/astutil"
	"golang.org/x/tools/go/packages"

	"github.com/idemgen/idemgen/generator"
)

// snippet is one ```go block of README.md.
type snippet struct {
	line int // of the opening fence
	code string
}

var skipRE = regexp.MustCompile(`^<!--\s*readme:\s*skip\b.*-->\s*$`)

// snippets extracts the Go blocks of a Markdown document, except those
// marked skip.
func snippets(t *testing.T, md string) []snippet {
	var out []snippet
	lines := strings.Split(md, "\n")
	for i := 0; i < len(lines); i++ {
		if strings.TrimSpace(lines[i]) != "```go" {
			continue
		}
		start := i
		var code []string
		for i++; i < len(lines) && strings.TrimSpace(lines[i]) != "```"; i++ {
			code = append(code, lines[i])
		}
		if start > 0 && skipRE.MatchString(strings.TrimSpace(lines[start-1])) {
			continue
		}
		out = append(out, snippet{line: start + 1, code: strings.Join(code, "\n") + "\n"})
	}
	return out
}

// imports are available to every example; unused ones are fine.
const imports = `import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log"
	"net/http"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/examples/payments/db"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// Every import is used, so that idemgen (which reports unused imports, as
// the compiler would) accepts the example packages.
var (
	_ = bytes.NewReader
	_ = context.Background
	_ = json.Marshal
	_ = fmt.Sprint
	_ = log.Println
	_ = http.NewServeMux
	_ = os.Getenv
	_ = time.Now
	_ pgx.Tx
	_ *pgxpool.Pool
	_ = db.New
	_ *idem.Store
	_ *kafka.Consumer
)
`

// prelude declares what the examples use without declaring it.
const prelude = `
var (
	ctx         = context.Background()
	pool        *pgxpool.Pool
	store       *idem.Store
	req         *http.Request
	mux         = http.NewServeMux()
	providerURL = "http://127.0.0.1:8081"
)

type Order struct{ ID string }

type OrderAck struct{ ID string }
`

func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Dir(filepath.Dir(filepath.Dir(file)))
}

// TestREADMEExamplesCompile type-checks every Go example of README.md, each
// in its own package of a temporary module that requires this repository.
func TestREADMEExamplesCompile(t *testing.T) {
	root := repoRoot()
	md, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	snips := snippets(t, string(md))
	if len(snips) == 0 {
		t.Fatal("no Go examples found in README.md")
	}
	mod := t.TempDir()
	gomod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	requires := string(gomod[strings.Index(string(gomod), "require"):])
	// The module path lies under this repository's, so the copied example
	// may import its internal packages (internal/crash).
	writeFile(t, filepath.Join(mod, "go.mod"), "module github.com/idemgen/idemgen/internal/readme/examples\n\ngo 1.26\n\n"+
		"require github.com/idemgen/idemgen v0.0.0-00010101000000-000000000000\n\n"+
		"replace github.com/idemgen/idemgen => "+root+"\n\n"+requires)
	sum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(mod, "go.sum"), string(sum))

	example, err := filepath.Glob(filepath.Join(root, "examples", "payments", "*"))
	if err != nil {
		t.Fatal(err)
	}
	byDir := map[string]snippet{}
	var declDirs []string // examples that are declarations, where directives can be
	for _, s := range snips {
		dir := fmt.Sprintf("line%d", s.line)
		byDir[dir] = s
		src, declared, isBody := snippetFile(t, s)
		// An excerpt of generated output stands in for idem_gen.go: idemgen
		// on its directory would see its names declared twice.
		if !isBody && !strings.Contains(s.code, "// "+generator.Header) {
			declDirs = append(declDirs, "./"+dir)
		}
		writeFile(t, filepath.Join(mod, dir, "readme.go"), src)
		writeFile(t, filepath.Join(mod, dir, "prelude.go"), string(without(t, "package main\n\n"+imports+prelude, declared)))
		for _, path := range example {
			if strings.HasSuffix(path, "_test.go") {
				continue
			}
			if info, err := os.Stat(path); err != nil || info.IsDir() {
				continue // db is imported, not copied
			}
			data, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if strings.HasSuffix(path, ".go") {
				data = without(t, string(data), declared)
			}
			writeFile(t, filepath.Join(mod, dir, filepath.Base(path)), string(data))
		}
	}

	env := append(os.Environ(), "GOFLAGS=-mod=mod", "GOPROXY=off", "GOWORK=off")
	pkgs, err := packages.Load(&packages.Config{
		Mode: packages.NeedName | packages.NeedTypes | packages.NeedSyntax | packages.NeedTypesInfo,
		Dir:  mod,
		Env:  env,
	}, "./...")
	if err != nil {
		t.Fatal(err)
	}
	if len(pkgs) != len(snips) {
		t.Fatalf("loaded %d packages for %d examples", len(pkgs), len(snips))
	}
	// The directives of the examples are valid too: idemgen generates from
	// every example package without an error.
	// Only errors at README lines are the README's: idemgen also judges how
	// the copied example files use the generated names, and an example that
	// declares consumers in another order than examples/payments gives
	// IdemConsumers another parameter order than its main.go calls.
	if _, err := generator.Generate(context.Background(), generator.Config{Dir: mod, Env: env}, declDirs...); err != nil {
		var list generator.ErrorList
		if !errors.As(err, &list) {
			t.Fatalf("idemgen on the README examples: %v", err)
		}
		var mine []string
		for _, e := range list {
			if filepath.Base(e.Pos.Filename) == "README.md" {
				mine = append(mine, e.Error())
			}
		}
		if len(mine) > 0 {
			t.Errorf("idemgen on the README examples (each in the directory line<N> of its fence):\n%s", strings.Join(mine, "\n"))
		}
	}
	for _, pkg := range pkgs {
		s := byDir[filepath.Base(pkg.PkgPath)]
		var msgs []string
		for _, e := range pkg.Errors {
			if e.Kind == packages.TypeError && isSoft(pkg, e) {
				continue
			}
			// go list compiles the package too and reports the compiler's
			// text, unused imports included, as one error; the type
			// checker's errors above say the same with positions.
			if e.Kind == packages.ListError && strings.HasPrefix(e.Msg, "# ") && len(pkg.TypeErrors) > 0 {
				continue
			}
			msgs = append(msgs, e.Error())
		}
		if len(msgs) > 0 {
			t.Errorf("README.md:%d: the example does not compile:\n%s\n---\n%s", s.line, strings.Join(msgs, "\n"), s.code)
		}
	}
}

// isSoft reports whether e is a soft type error (declared and not used,
// imported and not used), which an example may have.
func isSoft(pkg *packages.Package, e packages.Error) bool {
	for _, te := range pkg.TypeErrors {
		if te.Soft && te.Fset.Position(te.Pos).String() == e.Pos && te.Msg == e.Msg {
			return true
		}
	}
	return false
}

// snippetFile returns the source file for s, the names it declares at
// package level ("T.Method" for methods), and whether it is a function body.
func snippetFile(t *testing.T, s snippet) (string, map[string]bool, bool) {
	head := "package main\n\n" + imports + "\n"
	// Errors are reported at README.md's own lines.
	code := fmt.Sprintf("//line README.md:%d\n%s", s.line+1, s.code)
	fset := token.NewFileSet()
	src := head + code
	if _, err := parser.ParseFile(fset, "", s.code, parser.PackageClauseOnly); err == nil {
		src = code // a whole file, imports and all
	}
	f, err := parser.ParseFile(fset, "readme.go", src, parser.ParseComments)
	if err != nil {
		// Not declarations: statements, compiled as a function body.
		return head + "func _() {\n" + code + "}\n", map[string]bool{}, true
	}
	declared := map[string]bool{}
	for _, d := range f.Decls {
		for _, name := range declNames(d) {
			declared[name] = true
		}
		// A function without a body is a signature: give it one.
		if fd, ok := d.(*ast.FuncDecl); ok && fd.Body == nil {
			fd.Body = &ast.BlockStmt{List: []ast.Stmt{&ast.ExprStmt{X: &ast.CallExpr{
				Fun: ast.NewIdent("panic"), Args: []ast.Expr{&ast.BasicLit{Kind: token.STRING, Value: `"README example"`}},
			}}}}
		}
	}
	var buf bytes.Buffer
	if err := format.Node(&buf, fset, f); err != nil {
		t.Fatalf("README.md:%d: %v", s.line, err)
	}
	return buf.String(), declared, false
}

// declNames returns the names a top-level declaration declares.
func declNames(d ast.Decl) []string {
	switch d := d.(type) {
	case *ast.FuncDecl:
		if d.Recv != nil && len(d.Recv.List) == 1 {
			return []string{recvName(d.Recv.List[0].Type) + "." + d.Name.Name}
		}
		return []string{d.Name.Name}
	case *ast.GenDecl:
		var names []string
		for _, spec := range d.Specs {
			switch spec := spec.(type) {
			case *ast.TypeSpec:
				names = append(names, spec.Name.Name)
			case *ast.ValueSpec:
				for _, n := range spec.Names {
					if n.Name != "_" {
						names = append(names, n.Name)
					}
				}
			}
		}
		return names
	}
	return nil
}

func recvName(x ast.Expr) string {
	switch x := x.(type) {
	case *ast.StarExpr:
		return recvName(x.X)
	case *ast.IndexExpr:
		return recvName(x.X)
	case *ast.Ident:
		return x.Name
	}
	return ""
}

// without returns the Go file src minus the top-level declarations of the
// names in drop, so an example can replace them.
func without(t *testing.T, src string, drop map[string]bool) []byte {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "", src, parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	var keep []ast.Decl
	for _, d := range f.Decls {
		if gd, ok := d.(*ast.GenDecl); ok && gd.Tok != token.IMPORT {
			var specs []ast.Spec
			for _, spec := range gd.Specs {
				if !anyDropped(declNames(&ast.GenDecl{Specs: []ast.Spec{spec}}), drop) {
					specs = append(specs, spec)
				}
			}
			if len(specs) == 0 {
				continue
			}
			gd.Specs = specs
			keep = append(keep, gd)
			continue
		}
		if !anyDropped(declNames(d), drop) {
			keep = append(keep, d)
		}
	}
	f.Decls = keep
	// Comments of dropped declarations would float; keep only the file's
	// header (idemgen recognizes its own files by it), and doc comments.
	var header []*ast.CommentGroup
	for _, cg := range f.Comments {
		if cg.End() < f.Package {
			header = append(header, cg)
		}
	}
	f.Comments = header
	// Imports only the dropped declarations used would not compile.
	used := map[string]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		if sel, ok := n.(*ast.SelectorExpr); ok {
			if x, ok := sel.X.(*ast.Ident); ok {
				used[x.Name] = true
			}
		}
		return true
	})
	for _, imp := range append([]*ast.ImportSpec{}, f.Imports...) {
		path, _ := strconv.Unquote(imp.Path.Value)
		name := ""
		if imp.Name != nil {
			name = imp.Name.Name
		}
		if name == "_" || name == "." || used[importName(name, path)] {
			continue
		}
		astutil.DeleteNamedImport(fset, f, name, path)
	}
	var buf bytes.Buffer
	if err := format.Node(&buf, fset, f); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// importName is the name an import declares: its alias, or the last
// element of its path that is not a major version (pgx for .../pgx/v5).
func importName(alias, path string) string {
	if alias != "" {
		return alias
	}
	elems := strings.Split(path, "/")
	name := elems[len(elems)-1]
	if len(elems) > 1 && regexp.MustCompile(`^v[0-9]+$`).MatchString(name) {
		name = elems[len(elems)-2]
	}
	return name
}

func anyDropped(names []string, drop map[string]bool) bool {
	for _, n := range names {
		if drop[n] {
			return true
		}
	}
	return false
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}
