//go:build !idemcrash

package crash

import "context"

// Point marks a place where the crash tests kill or stall the process.
// Without the idemcrash build tag it compiles to nothing.
func Point(context.Context, string) {}
