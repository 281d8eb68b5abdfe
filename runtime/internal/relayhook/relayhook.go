// Package relayhook lets this module's benchmarks reach into idem.Relay
// without widening its public API.
package relayhook

// DisableNotify turns LISTEN/NOTIFY off on an *idem.Relay (passed as any to
// avoid an import cycle), leaving only polling. Set by package idem; call it
// before Run. It exists to measure what NOTIFY buys; there is no other reason
// to turn it off.
var DisableNotify func(relay any)

// AfterClaim, if set, is called by a leading relay right after it claimed a
// non-empty batch, before it checks its lease and produces. Tests set it
// (before Run, in a child process) to freeze the process exactly there: the
// window the lease check before producing exists for.
var AfterClaim func()

// OnClaimed sets, on one *idem.Relay (passed as any, like DisableNotify),
// a hook that relay calls right after it claimed a non-empty batch, where
// AfterClaim is called, with the ids of the rows it claimed (PUBLISHING
// under its token until it marks them). Set by package idem; call it before
// Run. Unlike AfterClaim it reaches only that relay, so an in-process test
// that runs in parallel with others' relays can hold a batch in flight and
// act on the outbox meanwhile (e.g. requeue parked rows), then return.
var OnClaimed func(relay any, hook func(ids []int64))

// BeforeMark, if set, is called by a leading relay right before it marks a
// published batch, the mark's bounded context already running. Tests set it
// (before Run, in a child process) to freeze the process as if with the mark
// in flight: on waking, the mark fails on its spent context.
var BeforeMark func()

// InRenewal, if set, is called by a leading relay inside each lease renewal's
// transaction, after the renewing UPDATE and before the commit. Tests set it
// (before Run, in a child process) to freeze the process in the middle of a
// renewal: on waking, the renewal fails on its spent context.
var InRenewal func()
