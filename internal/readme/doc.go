// Package readme holds the test that compiles every Go example of the
// repository's README.md, so that an example cannot drift from the API it
// documents. It has no code of its own.
//
// The examples are found automatically: every ```go block is compiled, in a
// package that holds the payments example (examples/payments) and a few
// package-level variables (ctx, pool, store, req, mux, providerURL), with
// the standard and idemgen imports available. A block with a package clause
// is a whole file. Any other block is compiled as top-level declarations if
// it parses as such (declarations the example package also has are replaced
// by the block's), otherwise as the body of a function. A function declared
// without a body is a signature and gets one. "Declared and not used" is not
// an error in an example. idemgen must accept the directives of every
// example.
//
// A block that is not code (a signature shape, a before/after sketch) is
// marked with a comment on the line above its fence:
//
//	<!-- readme: skip (why) -->
package readme
