package offsetcommit_test

import (
	"path/filepath"
	"testing"

	"golang.org/x/tools/go/analysis/analysistest"

	"github.com/idemgen/idemgen/vet/offsetcommit"
)

// TestOffsetCommit checks offsets committed or marked before the database
// commit (straight line, in a poll loop, before pgx.BeginFunc), and the true
// negatives: commit then offset round a loop, the "already processed"
// branch that acknowledges and skips, an early return, an ignored finding.
func TestOffsetCommit(t *testing.T) {
	dir, err := filepath.Abs("../testdata")
	if err != nil {
		t.Fatal(err)
	}
	analysistest.Run(t, dir, offsetcommit.Analyzer, "offsetcommit")
}
