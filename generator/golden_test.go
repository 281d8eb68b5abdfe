package generator_test

import (
	"context"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/tools/txtar"

	"github.com/idemgen/idemgen/generator"
)

var update = flag.Bool("update", false, "rewrite the want sections of testdata/golden/*.txtar")

// repoRoot is the module root, two levels up from this file's package.
func repoRoot(t testing.TB) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	return filepath.Dir(filepath.Dir(file))
}

// newModule creates a temporary module that requires this repository (via a
// replace directive) with the same dependency versions, so golden inputs can
// import pgx and the runtime without the network.
func newModule(t testing.TB) string {
	t.Helper()
	root := repoRoot(t)
	dir := t.TempDir()
	gomod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	b.WriteString("module example.com/golden\n\ngo 1.26\n\n")
	b.WriteString("require github.com/idemgen/idemgen v0.0.0-00010101000000-000000000000\n\n")
	b.WriteString("replace github.com/idemgen/idemgen => " + root + "\n\n")
	// The repository's own requirements pin every dependency version.
	if i := strings.Index(string(gomod), "require"); i >= 0 {
		b.WriteString(string(gomod[i:]))
	}
	write(t, filepath.Join(dir, "go.mod"), b.String())
	sum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(dir, "go.sum"), string(sum))
	return dir
}

// goEnv keeps the go command offline and lenient about go.mod in test modules.
func goEnv() []string {
	return append(os.Environ(), "GOFLAGS=-mod=mod", "GOPROXY=off", "GOWORK=off")
}

func write(t testing.TB, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestGolden runs every testdata/golden/*.txtar case. A case holds an input
// package (its files at the archive's top level) and either want/idem_gen.go
// (the exact generated file) or want/errors (the exact error output). Every
// wanted idem_gen.go is then compiled with its package.
func TestGolden(t *testing.T) {
	cases, err := filepath.Glob(filepath.Join(repoRoot(t), "testdata", "golden", "*.txtar"))
	if err != nil || len(cases) == 0 {
		t.Fatalf("no golden cases: %v", err)
	}
	mod := newModule(t)
	var compiled []string
	t.Run("cases", func(t *testing.T) {
		for _, path := range cases {
			name := strings.TrimSuffix(filepath.Base(path), ".txtar")
			ar, err := txtar.ParseFile(path)
			if err != nil {
				t.Fatal(err)
			}
			dir := filepath.Join(mod, name)
			wantGen, wantErrs := -1, -1
			for i, f := range ar.Files {
				switch f.Name {
				case "want/idem_gen.go":
					wantGen = i
				case "want/errors":
					wantErrs = i
				default:
					write(t, filepath.Join(dir, f.Name), string(f.Data))
				}
			}
			if (wantGen < 0) == (wantErrs < 0) {
				t.Fatalf("%s: want exactly one of want/idem_gen.go and want/errors", name)
			}
			if wantGen >= 0 {
				compiled = append(compiled, "./"+name)
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				files, err := generator.Generate(context.Background(), generator.Config{Dir: dir, Env: goEnv()}, ".")
				var got []byte
				want := wantGen
				if err != nil {
					got = []byte(err.Error() + "\n")
					want = wantErrs
				} else {
					if len(files) != 1 || files[0].Path != filepath.Join(dir, generator.FileName) {
						t.Fatalf("files = %v, want one %s", paths(files), generator.FileName)
					}
					got = files[0].Content
					// The package must build with the generated file.
					write(t, files[0].Path, string(got))
				}
				if *update {
					if want < 0 {
						want = wantGen + wantErrs + 1 // the one that exists
					}
					ar.Files[want].Data = got
					if err := os.WriteFile(path, txtar.Format(ar), 0o644); err != nil {
						t.Fatal(err)
					}
					return
				}
				switch {
				case err != nil && wantErrs < 0:
					t.Fatalf("unexpected errors:\n%s", got)
				case err == nil && wantGen < 0:
					t.Fatalf("generated a file, want errors:\n%s", ar.Files[wantErrs].Data)
				}
				if diff := cmp.Diff(string(ar.Files[want].Data), string(got)); diff != "" {
					t.Errorf("%s mismatch (-want +got), rerun with -update to accept:\n%s", ar.Files[want].Name, diff)
				}
			})
		}
	})
	if t.Failed() || *update {
		return
	}
	// Every golden output is compiled (and vetted) with its package.
	sort.Strings(compiled)
	cmd := exec.Command("go", append([]string{"vet"}, compiled...)...)
	cmd.Dir, cmd.Env = mod, goEnv()
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go vet of the golden outputs: %v\n%s", err, out)
	}
}

func paths(files []generator.File) []string {
	var p []string
	for _, f := range files {
		p = append(p, f.Path)
	}
	return p
}
