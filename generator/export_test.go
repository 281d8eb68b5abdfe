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
