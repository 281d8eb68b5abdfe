// Command idembench runs idemgen's side-by-side benchmarks and prints one
// table of ratios, all measured in the same run. Run it from the module root:
//
//	go run ./cmd/idembench            # short mode, a few minutes
//	go run ./cmd/idembench -long      # more rounds, 1M rows of history, 100k bursts, cold caches
//	go run ./cmd/idembench -only http,relay
//
// Each benchmark (go test -bench, one iteration) prints its rows as lines
// starting with benchkit.Prefix; idembench collects them in order. What
// each row measures, and what limits it, is in BENCHMARKS.md.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/idemgen/idemgen/internal/benchkit"
)

// suite is one go test -bench invocation.
type suite struct {
	name, pkg, bench string
	// benchtime is go test's -benchtime: 1x (the rounds are inside the
	// benchmark) unless set.
	benchtime string
	// longOnly suites run in long mode only.
	longOnly bool
	// prepare, if set, is a command run once before the suite.
	prepare []string
}

var suites = []suite{
	{name: "http", pkg: "./runtime/idem", bench: "^BenchmarkHTTPSideBySide$"},
	{name: "http-remote", pkg: "./runtime/idem", bench: "^BenchmarkHTTPRemoteDB$"},
	{name: "consumer", pkg: "./runtime/kafka", bench: "^BenchmarkConsumerSideBySide$"},
	// A backlog on one partition of two, the other idle: the consumer's
	// rate where pausing a partition that is behind costs most. A few
	// seconds; no baseline.
	{name: "consumer-skew", pkg: "./runtime/kafka", bench: "^BenchmarkConsumerSkewed$"},
	{name: "relay", pkg: "./runtime/kafka", bench: "^BenchmarkRelaySideBySide$"},
	{name: "rss", pkg: "./internal/rssbench", bench: "^BenchmarkPeakRSS$"},
	{name: "storage", pkg: "./runtime/idem", bench: "^BenchmarkOutboxAtScale$"},
	// The generator's benchmark has no rounds inside: one iteration of
	// idemgen, check and go vet takes under a second warm, and one such
	// iteration's ratio moved 0.64–0.80 between runs here; five give their
	// sums' ratio. It loads a module of its own offline (GOPROXY=off), which
	// needs every module of this one's build list in the module cache; on a
	// fresh machine `go run` has fetched only what idembench itself builds.
	{name: "generator", pkg: "./generator", bench: "^BenchmarkGenerateVsVet$", benchtime: "5x",
		prepare: []string{"go", "mod", "download"}},
	// The cold-cache run compiles the standard library and pgx twice
	// (30–80 s each): long mode only, one iteration.
	{name: "generator", pkg: "./generator", bench: "^BenchmarkGenerateVsVetCold$", longOnly: true},
}

func main() {
	long := flag.Bool("long", false, "long mode: more rounds, and the figures at 1M rows of history")
	only := flag.String("only", "", "comma-separated suites to run (http, http-remote, consumer, consumer-skew, relay, rss, storage, generator); empty: all")
	verbose := flag.Bool("v", false, "also print the benchmarks' own output")
	flag.Parse()
	if err := run(*long, *only, *verbose, os.Stdout); err != nil {
		slog.Error("idembench failed", "err", err)
		os.Exit(1)
	}
}

func run(long bool, only string, verbose bool, out io.Writer) error {
	want := map[string]bool{}
	for _, s := range strings.Split(only, ",") {
		if s = strings.TrimSpace(s); s != "" {
			want[s] = true
		}
	}
	var rows []benchkit.Row
	var failed error
	start := time.Now()
	for _, s := range suites {
		if len(want) > 0 && !want[s.name] {
			continue
		}
		if s.name == "storage" && !long && !want["storage"] {
			continue // 1M rows of history: long mode only
		}
		if s.longOnly && !long {
			continue
		}
		fmt.Fprintf(os.Stderr, "idembench: %s (%s)...\n", s.name, s.pkg)
		got, err := runSuite(s, long, verbose)
		if err != nil {
			// The suites before it may have taken many minutes: their
			// rows are still printed.
			failed = fmt.Errorf("suite %s: %w", s.name, err)
			break
		}
		rows = append(rows, got...)
	}
	mode := "short"
	if long {
		mode = "long"
	}
	if failed != nil {
		mode += " mode, INCOMPLETE (a suite failed, see below)"
	} else {
		mode += " mode"
	}
	fmt.Fprintf(out, "idembench, %s, %s, %s\n\n", mode, time.Now().UTC().Format(time.DateTime+" UTC"), time.Since(start).Round(time.Second))
	tw := tabwriter.NewWriter(out, 0, 0, 1, ' ', tabwriter.Debug)
	fmt.Fprintln(tw, " Section\t Measurement\t Value\t Unit\t Target\t Detail")
	fmt.Fprintln(tw, " ---\t ---\t ---\t ---\t ---\t ---")
	for _, r := range rows {
		fmt.Fprintf(tw, " %s\t %s\t %s\t %s\t %s\t %s\n", r.Section, r.Name, format(r.Value), r.Unit, r.Target, r.Detail)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	return failed
}

func format(v float64) string {
	switch {
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.2f", v)
}

// runSuite runs one benchmark for one iteration (its rounds are inside) and
// returns the rows it printed.
func runSuite(s suite, long, verbose bool) ([]benchkit.Row, error) {
	benchtime := s.benchtime
	if benchtime == "" {
		benchtime = "1x"
	}
	if len(s.prepare) > 0 {
		prep := exec.Command(s.prepare[0], s.prepare[1:]...)
		if out, err := prep.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("%s: %w\n%s", strings.Join(s.prepare, " "), err, out)
		}
	}
	cmd := exec.Command("go", "test", "-count=1", "-run", "^$", "-bench", s.bench, "-benchtime", benchtime, "-timeout", "60m", s.pkg)
	cmd.Env = os.Environ()
	if long {
		cmd.Env = append(cmd.Env, "IDEMBENCH_LONG=1")
	}
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	var rows, metrics []benchkit.Row
	var tail []string // the output, for the error message
	sc := bufio.NewScanner(stdout)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if verbose {
			fmt.Fprintln(os.Stderr, line)
		}
		if j, ok := strings.CutPrefix(line, benchkit.Prefix); ok {
			var r benchkit.Row
			if err := json.Unmarshal([]byte(j), &r); err != nil {
				return nil, fmt.Errorf("bad row %q: %w", line, err)
			}
			rows = append(rows, r)
			continue
		}
		if strings.HasPrefix(line, "Benchmark") {
			metrics = append(metrics, parseMetrics(s.name, line)...)
		}
		if tail = append(tail, line); len(tail) > 40 {
			tail = tail[1:]
		}
	}
	if err := cmd.Wait(); err != nil {
		return nil, fmt.Errorf("%w\n%s", err, strings.Join(tail, "\n"))
	}
	if len(rows) == 0 {
		rows = metrics // a benchmark that only reports metrics (the generator's)
	}
	if len(rows) == 0 {
		return nil, fmt.Errorf("no rows printed\n%s", strings.Join(tail, "\n"))
	}
	return rows, nil
}

// targets are the targets for metrics of benchmarks that report
// only testing.B metrics.
var targets = map[string]string{"gen/vet": "≤ 0.7", "check/vet": "≤ 0.7"}

// parseMetrics turns a benchmark result line ("BenchmarkX-2 1 123 ns/op
// 3.1 gen/vet ...") into rows, one per custom metric.
func parseMetrics(section, line string) []benchkit.Row {
	f := strings.Fields(line)
	var rows []benchkit.Row
	for i := 2; i+1 < len(f); i += 2 {
		var v float64
		if _, err := fmt.Sscan(f[i], &v); err != nil || f[i+1] == "ns/op" {
			continue
		}
		unit, name := f[i+1], f[i+1]
		switch {
		case strings.Contains(unit, "/"):
			unit = "ratio"
		case strings.HasSuffix(unit, "-s"):
			unit = "s"
		}
		rows = append(rows, benchkit.Row{Section: section, Name: name, Value: v, Unit: unit, Target: targets[name]})
	}
	return rows
}
