package generator_test

import (
	"context"
	"flag"
	"fmt"
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
// package (its files at the archive's top level) and either the exact
// generated files (want/idem_gen.go, want/idem_gen_integration.go, ...) or
// want/errors (the exact error output); want/warnings, if present, is the
// exact warning output. Every wanted generated file is then compiled with its
// package. A comment line "-- tags: a,b" in the archive's comment sets build
// tags.
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
			wantFiles := map[string]int{} // generated file name → archive index
			wantErrs, wantWarns := -1, -1
			for i, f := range ar.Files {
				switch {
				case f.Name == "want/errors":
					wantErrs = i
				case f.Name == "want/warnings":
					wantWarns = i
				case strings.HasPrefix(f.Name, "want/"):
					wantFiles[strings.TrimPrefix(f.Name, "want/")] = i
				default:
					write(t, filepath.Join(dir, f.Name), string(f.Data))
				}
			}
			if (len(wantFiles) == 0) == (wantErrs < 0) {
				t.Fatalf("%s: want either generated files under want/ or want/errors", name)
			}
			if len(wantFiles) > 0 {
				compiled = append(compiled, "./"+name)
			}
			var flags []string
			for _, line := range strings.Split(string(ar.Comment), "\n") {
				if tags, ok := strings.CutPrefix(line, "-- tags: "); ok {
					flags = append(flags, "-tags="+tags)
				}
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				var warnings strings.Builder
				cfg := generator.Config{Dir: dir, Env: goEnv(), BuildFlags: flags, Warn: func(e *generator.Error) {
					warnings.WriteString(e.Error() + "\n")
				}}
				files, err := generator.Generate(context.Background(), cfg, ".")
				// go/packages, the loader for the unusual cases, gives the
				// same files, errors and warnings as the fast loader.
				fastWarnings := warnings.String()
				warnings.Reset()
				slowFiles, slowErr := generator.Generate(generator.WithGoPackagesLoader(context.Background()), cfg, ".")
				if diff := cmp.Diff(fmt.Sprint(slowErr), fmt.Sprint(err)); diff != "" {
					t.Errorf("errors of the go/packages loader (-) and the fast loader (+) differ:\n%s", diff)
				}
				if diff := cmp.Diff(slowFiles, files); diff != "" {
					t.Errorf("files of the go/packages loader (-) and the fast loader (+) differ:\n%s", diff)
				}
				if fastWarnings != warnings.String() {
					t.Errorf("warnings differ: fast loader:\n%s\ngo/packages:\n%s", fastWarnings, warnings.String())
				}
				warnings.Reset()
				warnings.WriteString(fastWarnings)
				got := map[int][]byte{}
				if err != nil {
					if wantErrs < 0 {
						t.Fatalf("unexpected errors:\n%s", err)
					}
					got[wantErrs] = []byte(err.Error() + "\n")
				} else {
					if wantErrs >= 0 {
						t.Fatalf("generated files, want errors:\n%s", ar.Files[wantErrs].Data)
					}
					var names, wantNames []string
					for _, f := range files {
						names = append(names, strings.TrimPrefix(f.Path, dir+string(filepath.Separator)))
						// The package must build with the generated files.
						write(t, f.Path, string(f.Content))
					}
					for n := range wantFiles {
						wantNames = append(wantNames, n)
					}
					sort.Strings(wantNames)
					if diff := cmp.Diff(wantNames, names); diff != "" && !*update {
						t.Fatalf("generated files (-want +got):\n%s", diff)
					}
					for _, f := range files {
						i, ok := wantFiles[filepath.Base(f.Path)]
						if !ok {
							i = len(ar.Files)
							ar.Files = append(ar.Files, txtar.File{Name: "want/" + filepath.Base(f.Path)})
						}
						got[i] = f.Content
					}
				}
				if wantWarns >= 0 || warnings.Len() > 0 {
					if wantWarns < 0 {
						wantWarns = len(ar.Files)
						ar.Files = append(ar.Files, txtar.File{Name: "want/warnings"})
					}
					got[wantWarns] = []byte(warnings.String())
				}
				if *update {
					for i, data := range got {
						ar.Files[i].Data = data
					}
					if err := os.WriteFile(path, txtar.Format(ar), 0o644); err != nil {
						t.Fatal(err)
					}
					return
				}
				for i, data := range got {
					if diff := cmp.Diff(string(ar.Files[i].Data), string(data)); diff != "" {
						t.Errorf("%s mismatch (-want +got), rerun with -update to accept:\n%s", ar.Files[i].Name, diff)
					}
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
