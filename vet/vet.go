// Package vet lists idemgen's go/analysis checks: the mistakes that
// double-charge or lose events in the code around the generated wrappers
// (and inside the wrapped functions). idemgen vet runs them over packages;
// cmd/idemgen-vet runs them under go vet -vettool.
//
// One check per mistake:
//   - retrykey: a retry loop sends POST/PUT/PATCH/DELETE without an
//     Idempotency-Key created once before the loop;
//   - swallowcancel: in a function with a transaction, cancellation is
//     swallowed (returns nil, continues, clears the error), or an error of
//     the transaction's own calls is dropped;
//   - offsetcommit: a Kafka offset is committed or marked before the
//     database transaction's Commit;
//   - txescape: an //idem:http or //idem:consume function commits or rolls
//     back the operation's tx, or writes through a pool, a conn, or sqlc
//     Queries not built from that tx;
//   - directive: //idem: directives the generator rejects or never reads
//     (test files, files excluded by build constraints).
//
// A finding is silenced, deliberately and with a reason, by the comment
// //idemvet:ignore CHECK REASON at the end of its line or on the line above.
package vet

import (
	"golang.org/x/tools/go/analysis"

	"github.com/idemgen/idemgen/vet/directive"
	"github.com/idemgen/idemgen/vet/offsetcommit"
	"github.com/idemgen/idemgen/vet/retrykey"
	"github.com/idemgen/idemgen/vet/swallowcancel"
	"github.com/idemgen/idemgen/vet/txescape"
)

// Analyzers returns every idemgen vet check, in the order they are
// documented.
func Analyzers() []*analysis.Analyzer {
	return []*analysis.Analyzer{
		retrykey.Analyzer,
		swallowcancel.Analyzer,
		offsetcommit.Analyzer,
		txescape.Analyzer,
		directive.Analyzer,
	}
}
