package txescape_test

import (
	"path/filepath"
	"testing"

	"golang.org/x/tools/go/analysis/analysistest"

	"github.com/idemgen/idemgen/vet/txescape"
)

func testdata(t *testing.T) string {
	dir, err := filepath.Abs("../testdata")
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestTxEscape checks Commit/Rollback on the operation's tx, writes and reads
// through a pool, a conn and sqlc Queries not built from the tx, and the
// true negatives: db.New(tx), Queries.WithTx(tx), a savepoint, an
// unannotated function that owns its transaction, the generated wrapper's
// shape, an ignored finding.
func TestTxEscape(t *testing.T) {
	analysistest.Run(t, testdata(t), txescape.Analyzer, "txescape")
}

// TestTxEscapeAllowReads checks -txescape.allowreads: constant SELECTs and
// sqlc Get* methods pass; SELECT ... FOR UPDATE, INSERT ... RETURNING and
// other sqlc methods are still writes.
func TestTxEscapeAllowReads(t *testing.T) {
	if err := txescape.Analyzer.Flags.Set("allowreads", "true"); err != nil {
		t.Fatal(err)
	}
	defer txescape.Analyzer.Flags.Set("allowreads", "false")
	analysistest.Run(t, testdata(t), txescape.Analyzer, "txescapereads")
}
