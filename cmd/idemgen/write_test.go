package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idemgen/idemgen/generator"
)

// TestWriteAllOrNothing: when one generated file of a run cannot be written
// (its directory is read-only, gone, or full), no other file of the run is
// changed or deleted. Files were written one by one, so a run over ./...
// that failed at its third package left the first two regenerated and an
// orphan of the first deleted: a tree half of one version, half of another.
// The error names the file idemgen meant to write, not its temporary file.
func TestWriteAllOrNothing(t *testing.T) {
	dir := t.TempDir()
	a := filepath.Join(dir, "a", "idem_gen.go")
	orphan := filepath.Join(dir, "b", "idem_gen.go")
	for _, p := range []string{a, orphan} {
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("// old\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	gone := filepath.Join(dir, "c", "idem_gen.go") // its directory does not exist
	err := write([]generator.File{
		{Path: a, Content: []byte("// new\n")},
		{Path: orphan},
		{Path: gone, Content: []byte("// new\n")},
	})
	if err == nil {
		t.Fatal("write succeeded with a file in a missing directory")
	}
	if !strings.Contains(err.Error(), gone) {
		t.Errorf("error %q does not name %s", err, gone)
	}
	for _, p := range []string{a, orphan} {
		if b, err := os.ReadFile(p); err != nil || string(b) != "// old\n" {
			t.Errorf("%s after the failed write: %q, %v; want it untouched", p, b, err)
		}
	}
	for _, d := range []string{filepath.Dir(a), filepath.Dir(orphan)} {
		tmps, _ := filepath.Glob(filepath.Join(d, ".idem_gen-*"))
		if len(tmps) > 0 {
			t.Errorf("temporary files left behind: %v", tmps)
		}
	}
}
