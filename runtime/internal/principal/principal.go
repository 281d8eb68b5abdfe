// Package principal holds the storage form of an idempotency key's
// principal, shared by the runtime that writes idem_keys (runtime/idem) and
// the operator's API that looks keys up in it (runtime/admin): both must map
// a caller's principal to the same row.
package principal

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"unicode/utf8"
)

// MaxLength is the longest principal stored as it is, in bytes.
const MaxLength = 255

// HashedPrefix starts the stored form of a principal that is not stored as
// it is.
const HashedPrefix = "idem-sha256:"

// Stored is the form of p in idem_keys.principal: p itself, or, for a
// principal over MaxLength bytes, not valid UTF-8, holding a NUL byte
// (PostgreSQL's text cannot store one) or beginning with HashedPrefix,
// HashedPrefix followed by the hex SHA-256 of p.
func Stored(p string) string {
	if len(p) <= MaxLength && utf8.ValidString(p) && !strings.ContainsRune(p, 0) &&
		!strings.HasPrefix(p, HashedPrefix) {
		return p
	}
	sum := sha256.Sum256([]byte(p))
	return HashedPrefix + hex.EncodeToString(sum[:])
}
