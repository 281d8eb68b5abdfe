package swallowcancel_test

import (
	"path/filepath"
	"testing"

	"golang.org/x/tools/go/analysis/analysistest"

	"github.com/idemgen/idemgen/vet/swallowcancel"
)

// TestSwallowCancelService checks the service shapes a review found
// (vetfix): a worker loop's "case <-ctx.Done(): return nil" with the
// transaction begun in another case, and a cancellation handled after the
// commit, are not reported (no transaction is open there); a closure that
// uses the caller's tx (errgroup), err != nil && errors.Is(...), a switch,
// if err := ctx.Err(); err != nil, a negated test whose cancelled case falls
// through to return nil, and a dropped QueryRow(...).Scan are.
func TestSwallowCancelService(t *testing.T) {
	dir, err := filepath.Abs("../testdata")
	if err != nil {
		t.Fatal(err)
	}
	analysistest.Run(t, dir, swallowcancel.Analyzer, "swallowcancelservice")
}
