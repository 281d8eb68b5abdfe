package main

import "testing"

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
