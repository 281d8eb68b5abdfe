package vet_test

import (
	"fmt"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	"golang.org/x/tools/go/analysis/checker"
	"golang.org/x/tools/go/packages"

	"github.com/idemgen/idemgen/vet"
)

// corpus is real code the checks run over: modules already in the module
// cache because this repository (or tools/go.mod, for sqlc) depends on them.
// Patterns a module's own go.mod could not resolve offline are left out.
var corpus = []struct {
	name     string
	dir      string // relative to the repository root: whose build list
	tests    bool   // include _test.go files
	patterns []string
}{
	{"pgx", ".", true, []string{"github.com/jackc/pgx/v5/..."}},
	{"franz-go", ".", false, []string{
		"github.com/twmb/franz-go/pkg/kgo/...", "github.com/twmb/franz-go/pkg/kfake/...",
		"github.com/twmb/franz-go/pkg/sasl/...", "github.com/twmb/franz-go/pkg/kversion/...",
	}},
	{"x/tools", ".", false, []string{"golang.org/x/tools/go/...", "golang.org/x/tools/internal/..."}},
	{"sqlc", "tools", false, []string{"github.com/sqlc-dev/sqlc/..."}},
}

// reviewed is every finding the checks make on the corpus, each read and
// judged (see the README's "idemgen vet" section). A finding not listed
// fails the test: review it, then fix the check or list it here.
var reviewed = map[string]string{
	// A test that ignores tx.Commit's error: a true finding (harmless in
	// a test, a lost write in a service).
	"pgx/batch_test.go:856 swallowcancel": "true: tx.Commit(ctx) as a statement",
}

// TestCorpus runs every check over the corpus and compares the findings
// with the reviewed list. Packages that do not load offline (a dependency
// missing from the module cache) are skipped and counted; the test fails
// if a corpus entry loads no package at all.
func TestCorpus(t *testing.T) {
	_, file, _, _ := runtime.Caller(0)
	root := filepath.Dir(filepath.Dir(file))
	t.Setenv("GOPROXY", "off")
	got := map[string]string{}
	for _, c := range corpus {
		cfg := &packages.Config{Mode: packages.LoadSyntax, Dir: filepath.Join(root, c.dir), Tests: c.tests}
		pkgs, err := packages.Load(cfg, c.patterns...)
		if err != nil {
			t.Fatalf("%s: load: %v", c.name, err)
		}
		var ok []*packages.Package
		skipped := 0
		for _, p := range pkgs {
			broken := false
			packages.Visit([]*packages.Package{p}, nil, func(q *packages.Package) { broken = broken || len(q.Errors) > 0 })
			if broken {
				skipped++
				continue
			}
			ok = append(ok, p)
		}
		if len(ok) == 0 {
			t.Fatalf("%s: no package of %s loaded (%d skipped)", c.name, strings.Join(c.patterns, " "), skipped)
		}
		graph, err := checker.Analyze(vet.Analyzers(), ok, nil)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		n := 0
		for act := range graph.All() {
			if !act.IsRoot {
				continue
			}
			if act.Err != nil {
				t.Errorf("%s: %s on %s: %v", c.name, act.Analyzer.Name, act.Package.PkgPath, act.Err)
			}
			for _, d := range act.Diagnostics {
				p := act.Package.Fset.Position(d.Pos)
				key := fmt.Sprintf("%s/%s:%d %s", c.name, filepath.Base(p.Filename), p.Line, act.Analyzer.Name)
				if _, dup := got[key]; !dup {
					n++
				}
				got[key] = fmt.Sprintf("%s: %s", p, d.Message)
			}
		}
		t.Logf("%s: %d packages checked, %d skipped (not loadable offline), %d findings", c.name, len(ok), skipped, n)
	}
	keys := slices.Sorted(func(yield func(string) bool) {
		for k := range got {
			if !yield(k) {
				return
			}
		}
	})
	for _, k := range keys {
		if _, ok := reviewed[k]; !ok {
			t.Errorf("unreviewed finding %s\n\t%s", k, got[k])
		}
	}
	for k := range reviewed {
		if _, ok := got[k]; !ok {
			t.Errorf("reviewed finding %s is no longer reported; update the list", k)
		}
	}
}
