// Package relayhook lets this module's benchmarks reach into idem.Relay
// without widening its public API.
package relayhook

// DisableNotify turns LISTEN/NOTIFY off on an *idem.Relay (passed as any to
// avoid an import cycle), leaving only polling. Set by package idem; call it
// before Run. It exists to measure what NOTIFY buys; there is no other reason
// to turn it off.
var DisableNotify func(relay any)
