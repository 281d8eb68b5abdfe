package generator_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemgen/idemgen/generator"
)

// TestGoListMatchesGoPackages checks that the loader's own go list driver
// returns, for both of the vet-like loader's loads, what go/packages
// returns: files of every kind, ignored files, modules, the import graph
// with the dependencies, and export data.
func TestGoListMatchesGoPackages(t *testing.T) {
	mod := newModule(t)
	dir := filepath.Join(mod, "golist")
	write(t, filepath.Join(dir, "a.go"), `package golist

import (
	"context"

	"github.com/jackc/pgx/v5"

	"example.com/golden/golist/sub"
)

func F(context.Context, pgx.Tx) { sub.F() }
`)
	write(t, filepath.Join(dir, "ignored.go"), "//go:build never\n\npackage golist\n")
	write(t, filepath.Join(dir, "idem_gen.go"), "//go:build !idemgen\n\npackage golist\n")
	write(t, filepath.Join(dir, "sub", "sub.go"), "package sub\n\nimport \"strings\"\n\nfunc F() { _ = strings.ToUpper(\"\") }\n")
	write(t, filepath.Join(dir, "sub", "sub_amd64.s"), "// no code\n")
	write(t, filepath.Join(dir, "sub", "sub.syso"), "")
	write(t, filepath.Join(dir, "other", "other.go"), "package other\n\nimport _ \"example.com/golden/golist\"\n")

	cfg := generator.Config{Dir: dir, Env: append(goEnv(), "GOPACKAGESDRIVER=off")}
	for _, patterns := range [][]string{{"."}, {"./..."}, {"./sub", "."}, {"context", "github.com/jackc/pgx/v5"}} {
		diff, err := generator.GoListMatches(context.Background(), cfg, patterns...)
		if err != nil {
			t.Fatalf("%v: %v", patterns, err)
		}
		if diff != "" {
			t.Errorf("%v: go list and go/packages differ:\n%s", patterns, diff)
		}
	}
}

// TestGenerateGoCommands checks that Generate on one package runs the go
// command twice (the package's files, its dependencies' export data) and no
// more: go/packages asks the go version before each load, two extra
// processes on the critical path of every run.
func TestGenerateGoCommands(t *testing.T) {
	env, log := loggedGoCommand(t)
	mod := newModule(t)
	dir := filepath.Join(mod, "gocmds")
	write(t, filepath.Join(dir, "a.go"), `package gocmds

import (
	"context"

	"github.com/jackc/pgx/v5"
)

type Req struct{ A int }
type Resp struct{ B string }

//idem:http route="POST /op" status=201
func Op(ctx context.Context, tx pgx.Tx, r Req) (Resp, error) { return Resp{}, nil }
`)
	files, err := generator.Generate(context.Background(), generator.Config{Dir: dir, Env: env}, ".")
	if err != nil || len(files) != 1 {
		t.Fatalf("Generate: %v %v", files, err)
	}
	lines := goCommands(t, log)
	if len(lines) != 2 {
		t.Errorf("Generate ran %d go commands, want 2 (the package, its dependencies' export data):\n%s", len(lines), strings.Join(lines, "\n"))
	}
}

// loggedGoCommand puts a stand-in for the go command first on PATH that
// logs each command line to the file log and runs the real one, and returns
// the environment for Generate (without GOPACKAGESDRIVER, so that
// go/packages runs the go command too).
func loggedGoCommand(t *testing.T) (env []string, log string) {
	t.Helper()
	log = filepath.Join(t.TempDir(), "log")
	env = goStandIn(t, func(goBin string) string {
		return "echo \"$*\" >> '" + log + "'\nexec '" + goBin + "' \"$@\"\n"
	})
	return env, log
}

// goStandIn puts a shell script first on PATH as the go command, its body
// script(the real go command's path) after the #! line, and returns the
// environment for Generate (without GOPACKAGESDRIVER, so that go/packages
// runs the go command too). It skips the test where there is no shell or
// no go command.
func goStandIn(t *testing.T, script func(goBin string) string) []string {
	t.Helper()
	if runtime.GOOS == "windows" {
		t.Skip("the go command's stand-in is a shell script")
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command")
	}
	bin := t.TempDir()
	write(t, filepath.Join(bin, "go"), "#!/bin/sh\n"+script(goBin))
	if err := os.Chmod(filepath.Join(bin, "go"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", bin+string(os.PathListSeparator)+os.Getenv("PATH"))
	return append(goEnv(), "GOPACKAGESDRIVER=off", "PATH="+os.Getenv("PATH"))
}

// goCommands returns the command lines loggedGoCommand logged.
func goCommands(t *testing.T, log string) []string {
	t.Helper()
	out, err := os.ReadFile(log)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSpace(string(out)), "\n")
}

// TestRecheckUsesExportData checks that the second load of a package that
// uses a name this run generates (recheck, with the files it would write as
// an overlay) type-checks only that package from source: its go list does
// not compile it (-export=false), and a second go list, with the same
// overlay, builds its dependencies' export data. go/packages with an
// overlay lists with -export=true and -deps=true but then type-checks every
// dependency from source (pgx, net/http, ...), most of the time of a
// recheck; it also runs two more go lists first (the GOARCH and compiler,
// the release tags).
func TestRecheckUsesExportData(t *testing.T) {
	env, log := loggedGoCommand(t)
	mod := newModule(t)
	dir := filepath.Join(mod, "recheck")
	write(t, filepath.Join(dir, "a.go"), `package recheck

import (
	"context"
	"net/http"

	"github.com/jackc/pgx/v5"
)

type Req struct{ A int }
type Resp struct{ B string }

//idem:http route="POST /op" status=201
func Op(ctx context.Context, tx pgx.Tx, r Req) (Resp, error) { return Resp{}, nil }

// A use of a generated name: judged again once the name exists.
func routes(mux *http.ServeMux) { RegisterIdemRoutes(mux, nil) }
`)
	files, err := generator.Generate(context.Background(), generator.Config{Dir: dir, Env: env}, ".")
	if err != nil || len(files) != 1 {
		t.Fatalf("Generate: %v %v", files, err)
	}
	var overlaid []string
	for _, line := range goCommands(t, log) {
		if strings.Contains(line, "-overlay=") {
			overlaid = append(overlaid, line)
		}
	}
	if len(overlaid) != 2 ||
		!strings.Contains(overlaid[0], "-export=false") || !strings.HasSuffix(overlaid[0], " -- example.com/golden/recheck") ||
		!strings.Contains(overlaid[1], "-export=true") || !strings.Contains(overlaid[1], "-deps=false") {
		t.Errorf("recheck's go commands with the overlay:\n%s\nwant two go lists: the package without compiling it, then its dependencies' export data", strings.Join(overlaid, "\n"))
	}
}

// TestGoflagsOverlayAddedFile: a file that only a GOFLAGS -overlay adds is
// listed by the go command but is not on disk. The loader reads files from
// disk: it reports that, naming the file, where it used to leave a nil
// syntax tree that buildModel dereferenced (a panic), and where go/packages
// would drop the file and its directives without a word.
func TestGoflagsOverlayAddedFile(t *testing.T) {
	mod := newModule(t)
	dir := filepath.Join(mod, "ovl")
	write(t, filepath.Join(dir, "a.go"), "package ovl\n")
	added := filepath.Join(dir, "added.go")
	content := filepath.Join(t.TempDir(), "added.go.txt")
	write(t, content, `package ovl

import (
	"context"

	"github.com/jackc/pgx/v5"
)

type Req struct{ A int }

//idem:http route="POST /ov"
func Ov(ctx context.Context, tx pgx.Tx, r Req) (Req, error) { return r, nil }
`)
	overlay := filepath.Join(t.TempDir(), "overlay.json")
	write(t, overlay, `{"Replace":{"`+added+`":"`+content+`"}}`)
	env := append(goEnv(), "GOPACKAGESDRIVER=off", "GOFLAGS=-mod=mod -overlay="+overlay)
	files, err := generator.Generate(context.Background(), generator.Config{Dir: dir, Env: env}, ".")
	if err == nil || !strings.Contains(err.Error(), added) || !strings.Contains(err.Error(), "overlay") {
		t.Fatalf("Generate with a GOFLAGS overlay adding %s: files %v, error %v; want an error naming the file and the overlay", added, files, err)
	}
}

// TestRecheckCancelled: a run cancelled while it checks a package again
// with the files it would write (recheck) returns context.Canceled. recheck
// took a failed load for "not loaded" and Generate went on with the errors
// of the first load: with none but uses of generated names it returned the
// files, and idemgen gen, interrupted, wrote them.
func TestRecheckCancelled(t *testing.T) {
	// The go command's stand-in stops at recheck's first go command (the
	// only one with an -overlay), after saying so, until it is interrupted.
	started := filepath.Join(t.TempDir(), "started")
	env := goStandIn(t, func(goBin string) string {
		return "case \"$*\" in *-overlay=*) touch '" + started + "'; exec sleep 60;; esac\nexec '" + goBin + "' \"$@\"\n"
	})
	mod := newModule(t)
	dir := filepath.Join(mod, "cancel")
	write(t, filepath.Join(dir, "a.go"), `package cancel

import (
	"context"
	"net/http"

	"github.com/jackc/pgx/v5"
)

type Req struct{ A int }

//idem:http route="POST /op"
func Op(ctx context.Context, tx pgx.Tx, r Req) (Req, error) { return r, nil }

func routes(mux *http.ServeMux) { RegisterIdemRoutes(mux, nil) }
`)
	for _, loader := range []struct {
		name string
		ctx  context.Context
	}{{"fast", context.Background()}, {"go/packages", generator.WithGoPackagesLoader(context.Background())}} {
		t.Run(loader.name, func(t *testing.T) {
			os.Remove(started)
			ctx, cancel := context.WithCancel(loader.ctx)
			defer cancel()
			type result struct {
				files []generator.File
				err   error
			}
			done := make(chan result, 1)
			go func() {
				files, err := generator.Generate(ctx, generator.Config{Dir: dir, Env: env}, ".")
				done <- result{files, err}
			}()
			deadline := time.After(time.Minute)
		wait:
			for {
				select {
				case r := <-done:
					t.Fatalf("Generate returned before recheck's go command started: files %v, error %v", paths(r.files), r.err)
				case <-deadline:
					t.Fatal("recheck's go command did not start in a minute")
				case <-time.After(10 * time.Millisecond):
					if _, err := os.Stat(started); err == nil {
						break wait
					}
				}
			}
			cancel()
			r := <-done
			if !errors.Is(r.err, context.Canceled) {
				t.Errorf("Generate cancelled during recheck: files %v, error %v; want context.Canceled", paths(r.files), r.err)
			}
		})
	}
}

// TestRecheckLoadFails: when recheck cannot load the packages (here every
// go command with an -overlay fails, as when the go command finds no
// usable temporary directory), a package whose only errors were uses of
// generated names must not pass unchecked: c calls a.RegisterIdemRoutes
// with too few arguments, and gen would write a's idem_gen.go while c does
// not build.
func TestRecheckLoadFails(t *testing.T) {
	env := goStandIn(t, func(goBin string) string {
		return "case \"$*\" in *-overlay=*) echo 'no temporary directory' >&2; exit 1;; esac\nexec '" + goBin + "' \"$@\"\n"
	})
	mod := newModule(t)
	write(t, filepath.Join(mod, "recheckfail", "a", "a.go"), `package a

import (
	"context"

	"github.com/jackc/pgx/v5"
)

type Svc struct{}

//idem:http route="POST /x"
func (s *Svc) Do(ctx context.Context, tx pgx.Tx, in string) (string, error) { return in, nil }
`)
	write(t, filepath.Join(mod, "recheckfail", "c", "c.go"), `package c

import (
	"net/http"

	"example.com/golden/recheckfail/a"
)

func Setup(mux *http.ServeMux) { a.RegisterIdemRoutes(mux) }
`)
	for _, loader := range []string{"fast", "go/packages"} {
		t.Run(loader, func(t *testing.T) {
			ctx := context.Background()
			if loader == "go/packages" {
				ctx = generator.WithGoPackagesLoader(ctx)
			}
			files, err := generator.Generate(ctx, generator.Config{Dir: mod, Env: env}, "./recheckfail/...")
			if err == nil || !strings.Contains(err.Error(), "recheckfail/c/c.go: could not type-check package example.com/golden/recheckfail/c") {
				t.Fatalf("recheck's load failed: files %d, error %v; want an error for package c", len(files), err)
			}
		})
	}
}

// lateCancel is a context cancelled the first time Err is asked after the
// file marker exists: a cancellation that comes right after a go command
// has exited, which no go command of the run sees.
type lateCancel struct {
	context.Context
	marker string
	once   sync.Once
	done   chan struct{}
}

func (c *lateCancel) Done() <-chan struct{} { return c.done }

func (c *lateCancel) Err() error {
	if _, err := os.Stat(c.marker); err == nil {
		c.once.Do(func() { close(c.done) })
	}
	select {
	case <-c.done:
		return context.Canceled
	default:
		return nil
	}
}

// TestCancelledAfterRecheck: a run cancelled after recheck's last go
// command exited (while the packages are type-checked) returns
// context.Canceled, not files an interrupted idemgen gen would write.
func TestCancelledAfterRecheck(t *testing.T) {
	marker := filepath.Join(t.TempDir(), "rechecked")
	// Every recheck go command (the only ones with -overlay) runs, then
	// marks that one has finished.
	env := goStandIn(t, func(goBin string) string {
		return "case \"$*\" in *-overlay=*) '" + goBin + "' \"$@\"; rc=$?; touch '" + marker + "'; exit $rc;; esac\nexec '" + goBin + "' \"$@\"\n"
	})
	mod := newModule(t)
	write(t, filepath.Join(mod, "latecancel", "a.go"), `package latecancel

import (
	"context"
	"net/http"

	"github.com/jackc/pgx/v5"
	"github.com/idemgen/idemgen/runtime/idem"
)

type Svc struct{}

//idem:http route="POST /x"
func (s *Svc) Do(ctx context.Context, tx pgx.Tx, in string) (string, error) { return in, nil }

func Setup(mux *http.ServeMux) { RegisterIdemRoutes(mux, (*idem.HTTP)(nil), &Svc{}) }
`)
	for _, loader := range []string{"fast", "go/packages"} {
		t.Run(loader, func(t *testing.T) {
			os.Remove(marker)
			var ctx context.Context = &lateCancel{Context: context.Background(), marker: marker, done: make(chan struct{})}
			if loader == "go/packages" {
				ctx = generator.WithGoPackagesLoader(ctx)
			}
			files, err := generator.Generate(ctx, generator.Config{Dir: mod, Env: env}, "./latecancel")
			if _, statErr := os.Stat(marker); statErr != nil {
				t.Fatalf("recheck ran no go command: %v (files %d, error %v)", statErr, len(files), err)
			}
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("Generate cancelled after recheck's go commands: files %d, error %v; want context.Canceled", len(files), err)
			}
		})
	}
}
