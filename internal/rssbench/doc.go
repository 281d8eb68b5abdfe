// Package rssbench holds the peak-memory benchmark (BenchmarkPeakRSS, run
// by `go run ./cmd/idembench -only rss`): the HTTP service, the Kafka
// consumer and the outbox relay each handle a burst in a child process of
// their own (the test binary run again), and the parent reads the child's
// resident-set high-water mark (VmHWM) next to a baseline measured the same
// way. What each child does is in BENCHMARKS.md, "What each row measures".
//
// The package has no code outside its tests; this file is its
// documentation.
package rssbench
