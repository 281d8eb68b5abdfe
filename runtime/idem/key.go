package idem

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/idemgen/idemgen/runtime/internal/principal"
)

// Key identifies one idempotent operation: the scope (by default the wrapped
// function's qualified name), the principal the service derived from the
// request, and the client's Idempotency-Key.
type Key struct {
	Scope     string
	Principal string
	Key       string
}

// Derive returns a key for a downstream call named name, made from k alone:
// every retry of the same operation derives the same value, so a payment
// provider sees one key however often the operation is repeated. Derive it
// once, before any retry loop, and send it on every attempt.
func (k Key) Derive(name string) string {
	sum := hashParts(k.Scope, k.Principal, k.Key, name)
	return hex.EncodeToString(sum[:])[:32]
}

// hashParts is SHA-256 over length-prefixed parts, so ("ab","c") and
// ("a","bc") never hash alike. The parts are hashed in one piece from a
// buffer on the stack (when they fit), not through a hash.Hash, which is
// allocated, as is its Sum.
func hashParts(parts ...string) [sha256.Size]byte {
	buf := make([]byte, 0, 512)
	for _, s := range parts {
		buf = binary.LittleEndian.AppendUint64(buf, uint64(len(s)))
		buf = append(buf, s...)
	}
	return sha256.Sum256(buf)
}

// MaxPrincipalLength is the longest principal stored as it is, in bytes.
// Longer principals, principals that are not valid UTF-8 or hold a NUL byte
// (PostgreSQL's text cannot store one), and principals that begin with
// "idem-sha256:" are stored as "idem-sha256:" followed by the
// hex SHA-256 of the principal: every principal has a valid, bounded storage
// form, and no principal stored as it is can equal another's hashed form.
const MaxPrincipalLength = principal.MaxLength

// storedPrincipal is the form of p in idem_keys.principal (shared with
// runtime/admin, which must find the row an operator names by the
// principal the service saw).
func storedPrincipal(p string) string { return principal.Stored(p) }

// storageKey is the row identity of k: its principal in stored form.
func (k Key) storageKey() Key {
	k.Principal = storedPrincipal(k.Principal)
	return k
}

// lockID is the 64-bit advisory-lock key that marks k as in flight. A
// collision between two keys in flight at the same moment (odds about n²/2⁶⁵
// for n keys in flight) only makes one wait for the other, as a duplicate
// would; the row itself still decides what is stored. ClaimKey XORs it with
// the idem_keys table's OID: advisory locks are per database, and the same
// key in another schema's table is another key.
func (k Key) lockID() int64 {
	sum := hashParts("idem.key", k.Scope, k.Principal, k.Key)
	return int64(binary.BigEndian.Uint64(sum[:]))
}

// parseKey accepts the key as a bare token (as Stripe and most clients send
// it) or as an RFC 8941 sf-string (as the IETF draft writes it): a value that
// begins with a double quote is an sf-string, decoded with its two escapes
// (\" and \\); anything else in quotes (an unbalanced quote, another escape,
// a bare quote inside, text after the closing quote) is malformed. Bare
// `q"x` and quoted `"q\"x"` are the same key.
func parseKey(values []string) (string, error) {
	if len(values) != 1 {
		return "", errors.New("send exactly one key")
	}
	k := values[0]
	if strings.HasPrefix(k, `"`) {
		var err error
		if k, err = decodeSFString(k); err != nil {
			return "", err
		}
	}
	switch {
	case k == "":
		return "", errors.New("key is empty")
	case len(k) > MaxKeyLength:
		return "", fmt.Errorf("key is %d bytes; at most %d are allowed", len(k), MaxKeyLength)
	}
	for i := 0; i < len(k); i++ {
		if c := k[i]; c < 0x21 || c > 0x7e {
			return "", fmt.Errorf("key has a byte 0x%02x at offset %d; only visible ASCII is allowed", c, i)
		}
	}
	return k, nil
}

// decodeSFString decodes an RFC 8941 sf-string (section 4.2.5), s beginning
// with its opening quote.
func decodeSFString(s string) (string, error) {
	var b strings.Builder
	for i := 1; i < len(s); i++ {
		switch c := s[i]; {
		case c == '\\':
			i++
			if i == len(s) || (s[i] != '"' && s[i] != '\\') {
				return "", errors.New(`malformed quoted key: only \" and \\ may follow a backslash`)
			}
			b.WriteByte(s[i])
		case c == '"':
			if i != len(s)-1 {
				return "", errors.New("malformed quoted key: text after the closing quote")
			}
			return b.String(), nil
		case c < 0x20 || c > 0x7e:
			return "", fmt.Errorf("malformed quoted key: byte 0x%02x", c)
		default:
			b.WriteByte(c)
		}
	}
	return "", errors.New("malformed quoted key: no closing quote")
}

type keyCtx struct{}
type headerCtx struct{}
type principalCtx struct{}

// opCtx is the context of an //idem:http function: in one node, where three
// context.WithValue would make three, it holds what ResponseHeader,
// PrincipalFromContext and KeyFromContext read (the key only when the
// request has one; otherwise the lookup goes on to the parent, as it would
// without the node).
type opCtx struct {
	context.Context
	header    http.Header
	principal string
	key       *Key
}

func (c *opCtx) Value(k any) any {
	switch k.(type) {
	case headerCtx:
		return c.header
	case principalCtx:
		return c.principal
	case keyCtx:
		if c.key != nil {
			return *c.key
		}
	}
	return c.Context.Value(k)
}

// KeyFromContext returns the key of the idempotent operation running under
// ctx: for //idem:http, the request's key; for //idem:consume, the consumer
// context as Scope and the event id as Key. It reports false outside a
// wrapped function, and inside one whose endpoint allowed a request without
// a key.
func KeyFromContext(ctx context.Context) (Key, bool) {
	k, ok := ctx.Value(keyCtx{}).(Key)
	return k, ok
}

// PrincipalFromContext returns the principal of the //idem:http request
// running under ctx, as HTTPConfig.Principal returned it (not its stored
// form). It is set for every request, with or without a key; it reports
// false outside a wrapped function.
func PrincipalFromContext(ctx context.Context) (string, bool) {
	p, ok := ctx.Value(principalCtx{}).(string)
	return p, ok
}

// ResponseHeader returns the header of the response being built for the
// //idem:http function running under ctx. Headers set here are sent; those on
// the allow-list (see HTTPConfig.ReplayHeaders) are also stored and replayed.
// Outside a wrapped function it returns a fresh header that goes nowhere.
func ResponseHeader(ctx context.Context) http.Header {
	if h, ok := ctx.Value(headerCtx{}).(http.Header); ok {
		return h
	}
	return http.Header{}
}
