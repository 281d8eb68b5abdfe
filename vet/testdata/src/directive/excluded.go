//go:build neverbuilt

package directive

//idem:consume topic=orders // want `//idem:consume is not generated in this run: the current build tags exclude this file`
func Excluded() {}

//idemvet:ignore directive this file is for the windows build, vetted there
//idem:consume topic=orders
func ExcludedSilenced() {}
