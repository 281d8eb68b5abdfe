// Package idem is what idemgen-generated code and the services that use it
// import: the PostgreSQL store (queries compiled by sqlc from the SQL in
// templates/), the Idempotency-Key HTTP engine, the broker-agnostic event
// processor and outbox relay, and the helpers that carry an operation's key
// to downstream calls.
//
// It imports no broker client; runtime/kafka adapts it to Kafka. The package
// is named for what it does, so it is imported without an alias and never
// shadows the standard library's runtime:
//
//	import "github.com/idemgen/idemgen/runtime/idem"
package idem
