//go:build !idemcrash

package runtime

import "context"

// crashPoint marks a place where the crash tests kill or stall the process.
// Without the idemcrash build tag it compiles to nothing.
func crashPoint(context.Context, string) {}
