package generator

import "context"

// WithGoPackagesLoader returns ctx that makes Generate skip loadLikeVet and
// load with go/packages, so tests can compare the two loaders.
func WithGoPackagesLoader(ctx context.Context) context.Context {
	return context.WithValue(ctx, goPackagesOnly{}, true)
}

// GuessDeps is guessDeps under cfg's build configuration.
func GuessDeps(cfg Config, patterns ...string) []string {
	return guessDeps(cfg, newBuildConfig(cfg), patterns)
}

// GoListMatches loads patterns in the vet-like loader's two modes with
// goList and with packages.Load, and returns the first difference between
// the packages they return (with their dependencies), or "".
func GoListMatches(ctx context.Context, cfg Config, patterns ...string) (string, error) {
	return goListMatches(ctx, cfg, newBuildConfig(cfg), patterns)
}
