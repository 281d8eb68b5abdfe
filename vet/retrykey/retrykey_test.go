package retrykey_test

import (
	"path/filepath"
	"testing"

	"golang.org/x/tools/go/analysis/analysistest"

	"github.com/idemgen/idemgen/vet/retrykey"
)

// TestRetryKey checks the findings, the true negatives (a key created once
// before the loop, a key derived from the operation, one operation per item,
// GET, a loop that does not retry, an ignored finding) and that the
// suggested fixes hoist key creation above the loop.
func TestRetryKey(t *testing.T) {
	dir, err := filepath.Abs("../testdata")
	if err != nil {
		t.Fatal(err)
	}
	analysistest.RunWithSuggestedFixes(t, dir, retrykey.Analyzer, "retrykey")
}
