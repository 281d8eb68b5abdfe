// Package suggest finds the name a typo was probably meant to be.
package suggest

import (
	"fmt"
	"strings"
)

// DidYouMean suggests the closest of names to s, if one is close enough to
// be a typo (edit distance under 3, case ignored): `; did you mean "x"?`,
// or "" when none is.
func DidYouMean(s string, names []string) string {
	best, bestDist := "", 3
	for _, n := range names {
		if d := editDistance(strings.ToLower(s), n); d < bestDist {
			best, bestDist = n, d
		}
	}
	if best == "" {
		return ""
	}
	return fmt.Sprintf("; did you mean %q?", best)
}

// editDistance is the Levenshtein distance between a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
