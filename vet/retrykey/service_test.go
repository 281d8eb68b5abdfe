package retrykey_test

import (
	"path/filepath"
	"testing"

	"golang.org/x/tools/go/analysis/analysistest"

	"github.com/idemgen/idemgen/vet/retrykey"
)

// TestRetryKeyService checks the service shapes a review found (vetfix):
// for range 3; for {} counting attempts with a break; a closure handed to a
// retry helper (inline or in a variable); a key renewed in the loop under a
// condition or in a struct field; a request with a body built before the loop
// and resent; a method in a local variable; header map assignment; and the
// negatives: an event loop that skips with continue, a lazy key, a bodiless
// request resent, a closure run once, a method variable that may be GET. Its
// golden file checks the hoisting fixes, a labeled loop keeping its label.
func TestRetryKeyService(t *testing.T) {
	dir, err := filepath.Abs("../testdata")
	if err != nil {
		t.Fatal(err)
	}
	analysistest.RunWithSuggestedFixes(t, dir, retrykey.Analyzer, "retrykeyservice")
}
