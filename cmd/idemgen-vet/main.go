// Command idemgen-vet runs idemgen's vet checks under the go command:
//
//	go install github.com/idemgen/idemgen/cmd/idemgen-vet
//	go vet -vettool=$(which idemgen-vet) ./...
//
// It is a unitchecker binary, the protocol go vet speaks; idemgen vet runs the
// same checks without go vet. Flags are go vet's, e.g. -txescape.allowreads,
// -json, or -retrykey=false to turn one check off.
package main

import (
	"golang.org/x/tools/go/analysis/unitchecker"

	"github.com/idemgen/idemgen/vet"
)

func main() { unitchecker.Main(vet.Analyzers()...) }
