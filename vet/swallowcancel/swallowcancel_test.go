package swallowcancel_test

import (
	"path/filepath"
	"testing"

	"golang.org/x/tools/go/analysis/analysistest"

	"github.com/idemgen/idemgen/vet/swallowcancel"
)

// TestSwallowCancel checks swallowed cancellation (nil return, continue,
// cleared error, <-ctx.Done()), dropped errors of the transaction's calls,
// and the true negatives: re-raised cancellation, an explicit rollback, a
// function without a transaction, an ignored finding.
func TestSwallowCancel(t *testing.T) {
	dir, err := filepath.Abs("../testdata")
	if err != nil {
		t.Fatal(err)
	}
	analysistest.Run(t, dir, swallowcancel.Analyzer, "swallowcancel")
}
