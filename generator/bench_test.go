package generator_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/idemgen/idemgen/generator"
)

// BenchmarkGenerateVsVet times, side by side in each iteration, on one
// package of 1,000 //idem:http functions (20 files):
//
//   - gen:   generator.Generate, what `idemgen` does before writing;
//   - check: Generate plus the comparison with the file on disk;
//   - vet:   `go vet` on the same package (it type-checks it too).
//
// Each iteration edits a comment in one file first, so no result comes from
// a cache. It reports the ratios to vet. Run:
//
//	go test ./generator -run '^$' -bench GenerateVsVet -benchtime 3x
func BenchmarkGenerateVsVet(b *testing.B) {
	dir, cfg := bigPackage(b)
	edit := func(i int) {
		p := filepath.Join(dir, "f00.go")
		src, _ := os.ReadFile(p)
		src = bytes.Replace(src, []byte(fmt.Sprintf("// edit %d\n", i)), []byte(fmt.Sprintf("// edit %d\n", i+1)), 1)
		write(b, p, string(src))
	}
	var gen, check, vet time.Duration
	b.ResetTimer()
	for i := 0; i < 3*b.N; i += 3 {
		edit(i)
		start := time.Now()
		if _, err := generator.Generate(context.Background(), cfg, "."); err != nil {
			b.Fatal(err)
		}
		gen += time.Since(start)

		edit(i + 1)
		start = time.Now()
		files, err := generator.Generate(context.Background(), cfg, ".")
		if err != nil {
			b.Fatal(err)
		}
		onDisk, _ := os.ReadFile(files[0].Path)
		if !bytes.Equal(onDisk, files[0].Content) {
			b.Fatal("check: generated file differs")
		}
		check += time.Since(start)

		edit(i + 2)
		start = time.Now()
		cmd := exec.Command("go", "vet", ".")
		cmd.Dir, cmd.Env = dir, goEnv()
		if out, err := cmd.CombinedOutput(); err != nil {
			b.Fatalf("go vet: %v\n%s", err, out)
		}
		vet += time.Since(start)
	}
	n := float64(b.N)
	b.ReportMetric(gen.Seconds()/n, "gen-s")
	b.ReportMetric(check.Seconds()/n, "check-s")
	b.ReportMetric(vet.Seconds()/n, "vet-s")
	b.ReportMetric(gen.Seconds()/vet.Seconds(), "gen/vet")
	b.ReportMetric(check.Seconds()/vet.Seconds(), "check/vet")
}

// BenchmarkGenerateVsVetCold is the cold-cache counterpart of
// BenchmarkGenerateVsVet, on the same package: in each iteration `idemgen
// check` (Generate plus the comparison with the file on disk, in process)
// and `go vet` each get a fresh, empty GOCACHE of their own, so both compile
// the standard library and every dependency (pgx) first; the module cache
// is kept (nothing is downloaded). It reports the seconds and check's ratio
// to vet. Each takes 30–80 s on a loaded 2-core machine, so idembench runs
// it in long mode only. Run:
//
//	go test ./generator -run '^$' -bench GenerateVsVetCold -benchtime 1x
func BenchmarkGenerateVsVetCold(b *testing.B) {
	dir, cfg := bigPackage(b)
	var check, vet time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		cfg.Env = append(goEnv(), "GOCACHE="+b.TempDir())
		start := time.Now()
		files, err := generator.Generate(context.Background(), cfg, ".")
		if err != nil {
			b.Fatal(err)
		}
		onDisk, _ := os.ReadFile(files[0].Path)
		if !bytes.Equal(onDisk, files[0].Content) {
			b.Fatal("check: generated file differs")
		}
		check += time.Since(start)

		start = time.Now()
		cmd := exec.Command("go", "vet", ".")
		cmd.Dir, cmd.Env = dir, append(goEnv(), "GOCACHE="+b.TempDir())
		if out, err := cmd.CombinedOutput(); err != nil {
			b.Fatalf("go vet: %v\n%s", err, out)
		}
		vet += time.Since(start)
	}
	n := float64(b.N)
	b.ReportMetric(check.Seconds()/n, "cold-check-s")
	b.ReportMetric(vet.Seconds()/n, "cold-vet-s")
	b.ReportMetric(check.Seconds()/vet.Seconds(), "cold-check/vet")
}

// bigPackage writes, in a fresh module, one package of 1,000 //idem:http
// functions in 20 files, and its generated file; it returns the package's
// directory and the generator's configuration for it.
func bigPackage(b *testing.B) (string, generator.Config) {
	mod := newModule(b)
	dir := filepath.Join(mod, "big")
	const files, perFile = 20, 50
	for f := 0; f < files; f++ {
		var src bytes.Buffer
		fmt.Fprintf(&src, "package big\n\nimport (\n\t\"context\"\n\n\t\"github.com/jackc/pgx/v5\"\n)\n\n// edit 0\n")
		for i := 0; i < perFile; i++ {
			n := f*perFile + i
			fmt.Fprintf(&src, "type Req%d struct{ A int }\ntype Resp%d struct{ B string }\n\n", n, n)
			fmt.Fprintf(&src, "//idem:http route=\"POST /op%d\" status=201\nfunc Op%d(ctx context.Context, tx pgx.Tx, r Req%d) (Resp%d, error) { return Resp%d{}, nil }\n\n", n, n, n, n, n)
		}
		write(b, filepath.Join(dir, fmt.Sprintf("f%02d.go", f)), src.String())
	}
	cfg := generator.Config{Dir: dir, Env: goEnv()}
	out, err := generator.Generate(context.Background(), cfg, ".")
	if err != nil {
		b.Fatal(err)
	}
	write(b, out[0].Path, string(out[0].Content))
	return dir, cfg
}
