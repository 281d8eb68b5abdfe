package generator_test

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/tools/go/packages"

	"github.com/idemgen/idemgen/generator"
)

// TestGuessDeps checks that the direct dependencies read from a package's
// files, before go list runs, are the ones go list then reports for the
// loading build (the user's tags plus idemgen's, no tests, no generated
// files), so that the export data go list is asked for early is used.
func TestGuessDeps(t *testing.T) {
	mod := newModule(t)
	dir := filepath.Join(mod, "guess")
	write(t, filepath.Join(dir, "a.go"), `package guess

import (
	"context"
	"unsafe"

	"github.com/jackc/pgx/v5"

	"example.com/golden/guess/sub"
)

var _ = unsafe.Sizeof(0)

func F(context.Context, pgx.Tx) { sub.F() }
`)
	write(t, filepath.Join(dir, "tagged.go"), "//go:build integration\n\npackage guess\n\nimport \"os\"\n\nvar _ = os.Args\n")
	write(t, filepath.Join(dir, "other.go"), "//go:build other\n\npackage guess\n\nimport \"flag\"\n\nvar _ = flag.Args\n")
	write(t, filepath.Join(dir, "idem_gen.go"), "//go:build !idemgen\n\npackage guess\n\nimport \"net/http\"\n\nvar _ http.Handler\n")
	write(t, filepath.Join(dir, "a_test.go"), "package guess\n\nimport \"testing\"\n\nvar _ testing.TB\n")
	write(t, filepath.Join(dir, "sub", "sub.go"), "package sub\n\nfunc F() {}\n")

	cfg := generator.Config{Dir: dir, Env: goEnv(), BuildFlags: []string{"-tags=integration"}}
	pkgs, err := packages.Load(&packages.Config{
		Mode:       packages.NeedImports,
		Dir:        dir,
		Env:        cfg.Env,
		BuildFlags: []string{"-tags=integration," + generator.LoadTag},
	}, ".")
	if err != nil || len(pkgs) != 1 || len(pkgs[0].Errors) > 0 {
		t.Fatalf("go list: %v %v", err, pkgs)
	}
	var want []string
	for _, imp := range pkgs[0].Imports {
		if imp.ID != "unsafe" {
			want = append(want, imp.ID)
		}
	}
	slices.Sort(want)
	if diff := cmp.Diff(want, generator.GuessDeps(cfg, ".")); diff != "" {
		t.Errorf("guessed dependencies (-go list +guess):\n%s", diff)
	}
	// Patterns go list expands itself are not guessed.
	for _, pattern := range []string{"./...", "example.com/golden/guess"} {
		if got := generator.GuessDeps(cfg, pattern); got != nil {
			t.Errorf("GuessDeps(%q) = %v, want nil", pattern, got)
		}
	}
}

// TestCgoBothLoaders checks that a package using cgo, whose compiled files
// are cgo's output rather than its own files, gives the same files and
// errors with the fast loader as with go/packages.
func TestCgoBothLoaders(t *testing.T) {
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Skip("cgo needs a C compiler")
	}
	mod := newModule(t)
	dir := filepath.Join(mod, "cgo")
	write(t, filepath.Join(dir, "c.go"), `package cgo

// typedef struct { int n; } pair;
import "C"

import (
	"context"

	"github.com/jackc/pgx/v5"
)

type Req struct{ N int }

//idem:http route="POST /twice"
func Twice(ctx context.Context, tx pgx.Tx, in Req) (C.pair, error) { return C.pair{}, nil }
`)
	cfg := generator.Config{Dir: dir, Env: append(goEnv(), "CGO_ENABLED=1")}
	files, err := generator.Generate(context.Background(), cfg, ".")
	slowFiles, slowErr := generator.Generate(generator.WithGoPackagesLoader(context.Background()), cfg, ".")
	if diff := cmp.Diff(fmt.Sprint(slowErr), fmt.Sprint(err)); diff != "" {
		t.Errorf("errors of go/packages (-) and the fast loader (+) differ:\n%s", diff)
	}
	if diff := cmp.Diff(slowFiles, files); diff != "" {
		t.Errorf("files of go/packages (-) and the fast loader (+) differ:\n%s", diff)
	}
}
