// Package runtime is what idemgen-generated code and the services that use it
// import: the PostgreSQL store (queries compiled by sqlc from the SQL in
// templates/), the Idempotency-Key HTTP engine, and the helpers that carry an
// operation's key to downstream calls.
//
// It imports no broker client. Generated code imports it under the name idem:
//
//	import idem "github.com/idemgen/idemgen/runtime"
package runtime
