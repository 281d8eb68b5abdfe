//go:build !idemcrash

package runtime

// crashPoint marks a place where the crash tests kill the process. Without
// the idemcrash build tag it compiles to nothing.
func crashPoint(string) {}
