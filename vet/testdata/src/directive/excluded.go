//go:build neverbuilt

package directive

//idem:consume topic=orders // want `//idem:consume in a file excluded by the build constraints in use: idemgen reads the files go build compiles`
func Excluded() {}
