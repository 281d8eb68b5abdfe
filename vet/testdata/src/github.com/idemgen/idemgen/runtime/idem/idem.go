// Package idem is a minimal stub of github.com/idemgen/idemgen/runtime/idem for the analyzers' tests.
package idem

import "context"

func WithCallName(ctx context.Context, name string) context.Context { return ctx }
