package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/rogpeppe/go-internal/testscript"
)

// TestMain lets the test binary act as the idemgen command inside scripts,
// so `exec idemgen` and `go generate` run the real main, exit codes included.
// With IDEMGEN_TEST_MAIN=1 it is the idemgen command itself, for tests that
// signal a real process.
func TestMain(m *testing.M) {
	if os.Getenv("IDEMGEN_TEST_MAIN") == "1" {
		main()
	}
	testscript.Main(m, map[string]func(){
		"idemgen": func() { main() },
	})
}

// TestScripts runs testdata/script/*.txtar: each is a module that requires
// this repository through a replace directive, driven by idemgen and the go
// command as a user would.
func TestScripts(t *testing.T) {
	root := repoRoot(t)
	gomod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	gosum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	requires := string(gomod[strings.Index(string(gomod), "require"):])
	goenv := map[string]string{}
	for _, name := range []string{"GOCACHE", "GOMODCACHE", "GOPATH", "GOROOT"} {
		out, err := exec.Command("go", "env", name).Output()
		if err != nil {
			t.Fatal(err)
		}
		goenv[name] = strings.TrimSpace(string(out))
	}

	testscript.Run(t, testscript.Params{
		Dir: "testdata/script",
		Setup: func(env *testscript.Env) error {
			for k, v := range goenv {
				env.Setenv(k, v)
			}
			// Offline: every dependency is already in the module cache.
			env.Setenv("GOPROXY", "off")
			env.Setenv("GOFLAGS", "-mod=mod")
			env.Setenv("GOWORK", "off")
			env.Setenv("GOTOOLCHAIN", "local")
			// The race detector options of this test (CI: atexit_sleep_ms=0,
			// see .ci/run) for the idemgen runs, this test binary: testscript
			// starts commands without GORACE.
			if v := os.Getenv("GORACE"); v != "" {
				env.Setenv("GORACE", v)
			}
			mod := "module example.com/svc\n\ngo 1.26\n\n" +
				"require github.com/idemgen/idemgen v0.0.0-00010101000000-000000000000\n\n" +
				"replace github.com/idemgen/idemgen => " + root + "\n\n" + requires
			if err := os.WriteFile(filepath.Join(env.WorkDir, "go.mod"), []byte(mod), 0o644); err != nil {
				return err
			}
			return os.WriteFile(filepath.Join(env.WorkDir, "go.sum"), gosum, 0o644)
		},
		Cmds: map[string]func(ts *testscript.TestScript, neg bool, args []string){
			"idem": cmdIdem,
			"crlf": cmdCRLF,
		},
	})
}

// cmdCRLF runs "crlf FILE": rewrites FILE with CRLF line endings, as a git
// checkout with core.autocrlf does.
func cmdCRLF(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) != 1 {
		ts.Fatalf("usage: crlf FILE")
	}
	b, err := os.ReadFile(ts.MkAbs(args[0]))
	ts.Check(err)
	ts.Check(os.WriteFile(ts.MkAbs(args[0]), bytes.ReplaceAll(b, []byte("\n"), []byte("\r\n")), 0o644))
}

// cmdIdem runs "idem CODE ARGS..." : the idemgen binary with ARGS, failing
// the script unless it exits with exactly CODE. (testscript's exec only
// tells success from failure; check and diff promise 0, 1 and 2.)
func cmdIdem(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) < 1 {
		ts.Fatalf("usage: idem CODE [args...]")
	}
	want, err := strconv.Atoi(args[0])
	if err != nil {
		ts.Fatalf("idem: bad exit code %q", args[0])
	}
	bin, err := exec.LookPath("idemgen")
	if err != nil {
		ts.Fatalf("idem: %v", err)
	}
	var env []string
	for _, name := range []string{"PATH", "HOME", "GOCACHE", "GOMODCACHE", "GOPATH", "GOROOT", "GOPROXY", "GOFLAGS", "GOWORK", "GOTOOLCHAIN", "TMPDIR", "GOOS", "GOARCH", "CGO_ENABLED", "CC", "GORACE"} {
		env = append(env, name+"="+ts.Getenv(name))
	}
	cmd := exec.CommandContext(context.Background(), bin, args[1:]...)
	cmd.Dir = ts.MkAbs(".")
	cmd.Env = env
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	code := 0
	var exitErr *exec.ExitError
	if errors.As(err, &exitErr) {
		code = exitErr.ExitCode()
	} else if err != nil {
		ts.Fatalf("idem: %v", err)
	}
	ts.Stdout().Write(stdout.Bytes())
	ts.Stderr().Write(stderr.Bytes())
	if code != want {
		ts.Fatalf("idemgen %s exited %d, want %d\nstdout:\n%s\nstderr:\n%s", strings.Join(args[1:], " "), code, want, stdout.String(), stderr.String())
	}
}

func repoRoot(t *testing.T) string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Dir(filepath.Dir(filepath.Dir(file)))
}
