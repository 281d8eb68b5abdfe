// Command idemgen generates idempotent wrappers for functions annotated with
// //idem: directives. Usage:
//
//	idemgen [gen] [-tags list] [packages]     write idem_gen.go files (default ".")
//	idemgen check [-tags list] [packages]     exit 0 if generated code is current, 1 if not
//	idemgen diff  [-tags list] [packages]     print what gen would change; exit like check
//	idemgen schema                            print the SQL schema idem.Migrate applies
//	idemgen vet   [-tags list] [packages]     report mistakes that double-charge or lose events
//
// check and diff never write, and exit 2 on an error, like diff(1).
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/rogpeppe/go-internal/diff"

	"github.com/idemgen/idemgen/generator"
	"github.com/idemgen/idemgen/internal/shutdown"
	"github.com/idemgen/idemgen/internal/suggest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// Exit codes. check and diff follow diff(1): 0 same, 1 different, 2 trouble.
const (
	exitOK      = 0
	exitDiffers = 1
	exitError   = 2
)

func main() {
	ctx, stop := shutdown.Context("idemgen")
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cmd := "gen"
	if len(args) > 0 {
		switch args[0] {
		case "gen", "check", "diff", "schema":
			cmd, args = args[0], args[1:]
		case "vet":
			return runVet(ctx, args[1:], stdout, stderr)
		case "help", "-h", "-help", "--help":
			fmt.Fprint(stdout, usage)
			return exitOK
		}
	}
	fset := flag.NewFlagSet("idemgen "+cmd, flag.ContinueOnError)
	fset.SetOutput(stderr)
	fset.Usage = func() { fmt.Fprint(stderr, usage) }
	tags := fset.String("tags", "", "comma-separated build tags, as for go build")
	if err := fset.Parse(args); err != nil {
		return exitError
	}
	cfg := generator.Config{
		Warn: func(w *generator.Error) {
			w.Msg = "warning: " + w.Msg
			fmt.Fprintln(stderr, w)
		},
	}
	if *tags != "" {
		cfg.BuildFlags = []string{"-tags=" + *tags}
	}

	switch cmd {
	case "schema":
		fmt.Fprint(stdout, idem.Schema())
		return exitOK
	case "gen":
		files, err := generator.Generate(ctx, cfg, fset.Args()...)
		if err != nil {
			fmt.Fprintln(stderr, err)
			commandHint(fset.Args(), stderr)
			return 1
		}
		if err := write(files); err != nil {
			fmt.Fprintln(stderr, "idemgen:", err)
			return 1
		}
		return exitOK
	default: // check, diff
		files, err := generator.Generate(ctx, cfg, fset.Args()...)
		if err != nil {
			fmt.Fprintln(stderr, err)
			commandHint(fset.Args(), stderr)
			return exitError
		}
		return compare(files, cmd == "diff", stdout, stderr)
	}
}

// commands are idemgen's subcommands, for commandHint.
var commands = []string{"gen", "check", "diff", "schema", "vet", "help"}

// commandHint follows a failed load whose first package argument looks like
// a mistyped subcommand ("idemgen chek": gen of a package "chek", which the
// go command reports as "package chek is not in std") with the command it
// probably was. It says nothing when that word is not close to a command.
// (The go command takes a bare word as an import path even when a directory
// of that name exists here: a directory is named ./chek.)
func commandHint(pkgs []string, stderr io.Writer) {
	if len(pkgs) == 0 {
		return
	}
	word := pkgs[0]
	for _, c := range word {
		if c < 'a' || c > 'z' {
			return // a path, a pattern, or flags: not a command word
		}
	}
	if hint := suggest.DidYouMean(word, commands); hint != "" {
		fmt.Fprintf(stderr, "idemgen: %q is not a command%s (commands: %s; packages default to \".\")\n",
			word, hint, strings.Join(commands, ", "))
	}
}

const usage = `usage:
  idemgen [gen] [-tags list] [packages]   write idem_gen.go for each package with //idem: directives
  idemgen check [-tags list] [packages]   exit 0 if generated code is current, 1 if not, 2 on error
  idemgen diff  [-tags list] [packages]   print the unified diff gen would apply; exit codes as check
  idemgen schema                          print the SQL that idem.Migrate applies
  idemgen vet   [-tags list] [packages]   report mistakes that double-charge or lose events; exit 1 on findings
packages default to "."; GOFLAGS and the go command's environment apply.
`

// write brings the tree in line with files: writes what changed (leaving
// unchanged files untouched, so their mtime stays) and deletes orphans.
//
// All or nothing, as far as the file system allows: every changed file is
// first written in full to a temporary file beside it, and only when all of
// them are does any rename or deletion happen. A file that cannot be written
// (a read-only or missing directory, a full disk) so leaves the tree as it
// was, rather than regenerated up to that package and stale after it.
func write(files []generator.File) error {
	type staged struct{ tmp, path string }
	var renames []staged
	var removes []string
	cleanup := func() {
		for _, s := range renames {
			os.Remove(s.tmp)
		}
	}
	for _, f := range files {
		old, err := os.ReadFile(f.Path)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			cleanup()
			return err
		}
		switch {
		case f.Content == nil:
			removes = append(removes, f.Path)
		case err == nil && sameContent(old, f.Content):
		default:
			tmp, err := writeTemp(f)
			if err != nil {
				cleanup()
				return fmt.Errorf("write %s: %w", f.Path, err)
			}
			renames = append(renames, staged{tmp, f.Path})
		}
	}
	for i, s := range renames {
		if err := os.Rename(s.tmp, s.path); err != nil {
			renames = renames[i:]
			cleanup()
			return fmt.Errorf("write %s: %w", s.path, err)
		}
	}
	for _, path := range removes {
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("delete orphaned %s: %w", path, err)
		}
	}
	return nil
}

// writeTemp writes f's content to a new temporary file in f's directory
// and returns its name, so that a rename puts it in place whole: an
// interrupted run never leaves a half-written file behind.
func writeTemp(f generator.File) (string, error) {
	tmp, err := os.CreateTemp(filepath.Dir(f.Path), ".idem_gen-*.tmp")
	if err != nil {
		return "", err
	}
	_, err = tmp.Write(f.Content)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(tmp.Name(), 0o644)
	}
	if err != nil {
		os.Remove(tmp.Name())
		return "", err
	}
	return tmp.Name(), nil
}

// compare reports how the tree differs from files: a changed, missing or
// orphaned generated file. With printDiff it prints a unified diff, else the
// names of the files that differ.
func compare(files []generator.File, printDiff bool, stdout, stderr io.Writer) int {
	code := exitOK
	for _, f := range files {
		old, err := os.ReadFile(f.Path)
		missing := errors.Is(err, fs.ErrNotExist)
		if err != nil && !missing {
			fmt.Fprintln(stderr, "idemgen:", err)
			return exitError
		}
		if sameContent(old, f.Content) && (f.Content != nil) == !missing {
			continue
		}
		code = exitDiffers
		name := relPath(f.Path)
		if printDiff {
			oldName, newName := name, name
			if missing {
				oldName = "/dev/null"
			}
			if f.Content == nil {
				newName = "/dev/null"
			}
			stdout.Write(diff.Diff(oldName, old, newName, f.Content))
			continue
		}
		switch {
		case missing:
			fmt.Fprintf(stdout, "%s: missing; run idemgen\n", name)
		case f.Content == nil:
			fmt.Fprintf(stdout, "%s: orphaned (no //idem: directives left); run idemgen to delete it\n", name)
		default:
			fmt.Fprintf(stdout, "%s: out of date; run idemgen\n", name)
		}
	}
	return code
}

// sameContent reports whether a generated file on disk, old, is the file
// idemgen would write, gen: byte for byte, or with CRLF line endings (a
// checkout with git's core.autocrlf, the default on Windows runners, has
// them). The compiler reads both alike; check called such a tree out of
// date and diff showed every line changed.
func sameContent(old, gen []byte) bool {
	if bytes.Equal(old, gen) {
		return true
	}
	return gen != nil && bytes.Contains(old, []byte("\r\n")) && bytes.Equal(bytes.ReplaceAll(old, []byte("\r\n"), []byte("\n")), gen)
}

func relPath(path string) string {
	if wd, err := os.Getwd(); err == nil {
		if r, err := filepath.Rel(wd, path); err == nil {
			return r
		}
	}
	return path
}
