package main

import (
	"strings"
	"testing"

	"github.com/idemgen/idemgen/internal/benchkit"
)

// A benchmark that only reports testing.B metrics (the generator's) becomes
// rows: ratios named by their unit, seconds as "s", ns/op left out, and the
// issue's target attached.
func TestParseMetrics(t *testing.T) {
	rows := parseMetrics("generator", "BenchmarkGenerateVsVet-2   \t       1\t12860312140 ns/op\t         7.732 check-s\t         6.146 check/vet\t         3.869 gen-s\t         3.075 gen/vet")
	if len(rows) != 4 {
		t.Fatalf("%d rows, want 4: %+v", len(rows), rows)
	}
	want := map[string][2]string{"check-s": {"s", ""}, "check/vet": {"ratio", "≤ 0.7"}, "gen-s": {"s", ""}, "gen/vet": {"ratio", "≤ 0.7"}}
	for _, r := range rows {
		w, ok := want[r.Name]
		if !ok || r.Unit != w[0] || r.Target != w[1] || r.Section != "generator" || r.Value <= 0 {
			t.Errorf("row %+v", r)
		}
	}
}

// The cold-cache benchmark's metrics become rows too, in seconds and a
// ratio, without the warm figure's target.
func TestParseMetricsCold(t *testing.T) {
	rows := parseMetrics("generator", "BenchmarkGenerateVsVetCold-2 \t       1\t98000000000 ns/op\t        41.20 cold-check-s\t         0.8500 cold-check/vet\t        48.50 cold-vet-s")
	want := map[string]string{"cold-check-s": "s", "cold-check/vet": "ratio", "cold-vet-s": "s"}
	if len(rows) != len(want) {
		t.Fatalf("%d rows, want %d: %+v", len(rows), len(want), rows)
	}
	for _, r := range rows {
		if want[r.Name] != r.Unit || r.Target != "" || r.Value <= 0 {
			t.Errorf("row %+v", r)
		}
	}
}

// BenchmarkOneRow is the suite TestRunPrintsRowsBeforeAFailure runs.
func BenchmarkOneRow(b *testing.B) {
	benchkit.Emit(benchkit.Row{Section: "Test", Name: "one row", Value: 1, Unit: "ratio"})
}

// A suite that fails does not lose the rows of the suites before it (a
// long run's first suites take many minutes): they are printed, the table
// is marked incomplete, and the error is returned.
func TestRunPrintsRowsBeforeAFailure(t *testing.T) {
	old := suites
	t.Cleanup(func() { suites = old })
	suites = []suite{
		{name: "ok", pkg: ".", bench: "^BenchmarkOneRow$"},
		{name: "broken", pkg: "./no-such-package", bench: "."},
	}
	var out strings.Builder
	err := run(false, "", false, &out)
	if err == nil || !strings.Contains(err.Error(), "suite broken") {
		t.Fatalf("err = %v, want suite broken's", err)
	}
	if !strings.Contains(out.String(), "one row") || !strings.Contains(out.String(), "short mode, INCOMPLETE") {
		t.Fatalf("output:\n%s", out.String())
	}
}
