package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"sort"
	"strings"

	"golang.org/x/tools/go/analysis/checker"
	"golang.org/x/tools/go/packages"

	"github.com/idemgen/idemgen/vet"
	"github.com/idemgen/idemgen/vet/txescape"
)

const vetUsage = `usage: idemgen vet [-tags list] [-test=false] [-txescape.allowreads] [packages]
Runs idemgen's checks (retrykey, swallowcancel, offsetcommit, txescape,
directive) and prints each finding as file:line:col: message (check).
Exit 0: no findings; 1: findings; 2: the packages could not be loaded or
type-checked. Silence one finding with //idemvet:ignore CHECK REASON on its
line or the line above. Under go vet, use cmd/idemgen-vet as the -vettool.
`

// runVet is idemgen vet: the analyzers of package vet over patterns, with
// the go/packages driver (checker), printing file:line:col diagnostics.
func runVet(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fset := flag.NewFlagSet("idemgen vet", flag.ContinueOnError)
	fset.SetOutput(stderr)
	fset.Usage = func() { fmt.Fprint(stderr, vetUsage) }
	tags := fset.String("tags", "", "comma-separated build tags, as for go build")
	tests := fset.Bool("test", true, "also check _test.go files (as go vet does)")
	allowReads := fset.Bool("txescape.allowreads", false, "allow reads outside the operation's transaction in //idem: functions")
	if err := fset.Parse(args); err != nil {
		return exitError
	}
	if err := txescape.Analyzer.Flags.Set("allowreads", fmt.Sprint(*allowReads)); err != nil {
		fmt.Fprintln(stderr, "idemgen vet:", err)
		return exitError
	}
	patterns := fset.Args()
	if len(patterns) == 0 {
		patterns = []string{"."}
	}
	cfg := &packages.Config{Context: ctx, Mode: packages.LoadSyntax, Tests: *tests}
	if *tags != "" {
		cfg.BuildFlags = []string{"-tags=" + *tags}
	}
	pkgs, err := packages.Load(cfg, patterns...)
	if err != nil {
		fmt.Fprintln(stderr, "idemgen vet:", err)
		return exitError
	}
	if len(pkgs) == 0 {
		// The go command answers some patterns (a wildcard over a module
		// whose dependencies are missing) with no packages and no error:
		// checking nothing must not pass.
		fmt.Fprintf(stderr, "idemgen vet: no packages match %s\n", strings.Join(patterns, " "))
		return exitError
	}
	broken := false
	packages.Visit(pkgs, nil, func(p *packages.Package) {
		for _, e := range p.Errors {
			fmt.Fprintln(stderr, e)
			broken = true
		}
	})
	if broken {
		return exitError
	}
	graph, err := checker.Analyze(vet.Analyzers(), pkgs, nil)
	if err != nil {
		fmt.Fprintln(stderr, "idemgen vet:", err)
		return exitError
	}
	type finding struct {
		file            string
		line, col       int
		msg, check, out string
	}
	seen := map[string]bool{}
	var findings []finding
	for act := range graph.All() {
		if !act.IsRoot {
			continue
		}
		if act.Err != nil {
			fmt.Fprintf(stderr, "idemgen vet: %s on %s: %v\n", act.Analyzer.Name, act.Package.PkgPath, act.Err)
			return exitError
		}
		for _, d := range act.Diagnostics {
			p := act.Package.Fset.Position(d.Pos)
			// Tests: true loads a package twice (with and without its
			// tests); report each finding once.
			out := fmt.Sprintf("%s:%d:%d: %s (%s)", relPath(p.Filename), p.Line, p.Column, d.Message, act.Analyzer.Name)
			if seen[out] {
				continue
			}
			seen[out] = true
			findings = append(findings, finding{relPath(p.Filename), p.Line, p.Column, d.Message, act.Analyzer.Name, out})
		}
	}
	sort.Slice(findings, func(i, j int) bool {
		a, b := findings[i], findings[j]
		if a.file != b.file {
			return a.file < b.file
		}
		if a.line != b.line {
			return a.line < b.line
		}
		if a.col != b.col {
			return a.col < b.col
		}
		return a.out < b.out
	})
	for _, f := range findings {
		fmt.Fprintln(stdout, strings.ReplaceAll(f.out, "\n", "\n\t"))
	}
	if len(findings) > 0 {
		return exitDiffers
	}
	return exitOK
}
