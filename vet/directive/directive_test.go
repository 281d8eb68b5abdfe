package directive_test

import (
	"path/filepath"
	"testing"

	"golang.org/x/tools/go/analysis/analysistest"

	"github.com/idemgen/idemgen/vet/directive"
)

// TestDirective checks that the generator's messages reach vet (detached
// directive, typo in the kind and in an option, a space after //, the wrong
// shape), that directives in a _test.go file and in a file excluded by build
// constraints are reported, that malformed //idemvet:ignore comments are,
// and that a correct directive is not.
func TestDirective(t *testing.T) {
	dir, err := filepath.Abs("../testdata")
	if err != nil {
		t.Fatal(err)
	}
	analysistest.Run(t, dir, directive.Analyzer, "directive")
}
