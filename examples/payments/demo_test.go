package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/idemgen/idemgen/internal/pgtest"
)

// The README's first command runs this demo; it must pass its own checks.
func TestDemo(t *testing.T) {
	t.Setenv("DATABASE_URL", pgtest.Schema(t))
	var out bytes.Buffer
	if err := runDemo(context.Background(), &out); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "all checks passed") || strings.Contains(out.String(), "FAIL") {
		t.Fatalf("demo output:\n%s", out.String())
	}
}
