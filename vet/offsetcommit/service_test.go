package offsetcommit_test

import (
	"path/filepath"
	"testing"

	"golang.org/x/tools/go/analysis/analysistest"

	"github.com/idemgen/idemgen/vet/offsetcommit"
)

// TestOffsetCommitService checks the service shapes a review found (vetfix):
// an offset marked in a defer (it runs also when the commit fails), committed
// from a goroutine started before the commit, and marked before a helper that
// commits (same package, and another package through the commitsTx fact);
// not reported: a defer that marks only if err == nil, the helper or
// pgx.BeginFunc first, a defer in a function that commits no transaction.
func TestOffsetCommitService(t *testing.T) {
	dir, err := filepath.Abs("../testdata")
	if err != nil {
		t.Fatal(err)
	}
	analysistest.Run(t, dir, offsetcommit.Analyzer, "offsetcommitservice", "offsetstore")
}
