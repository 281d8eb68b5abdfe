package idem

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/idemgen/idemgen/runtime/internal/db"
)

// The hot path's hand-written encodings give exactly the bytes of the
// general code they replace: fingerprints and stored headers live in
// idem_keys, and lock ids are shared with processes running an older
// version during a rolling deploy, so a single different byte would make a
// retry a 422, or two processes run one key at once.

// hashPartsFmt is hashParts as it was written first, through a hash.Hash.
func hashPartsFmt(parts ...string) []byte {
	h := sha256.New()
	for _, s := range parts {
		var n [8]byte
		binary.LittleEndian.PutUint64(n[:], uint64(len(s)))
		h.Write(n[:])
		h.Write([]byte(s))
	}
	return h.Sum(nil)
}

// fingerprintFmt is fingerprint as it was written first, with fmt.
func fingerprintFmt(method string, bound, body []byte) []byte {
	f := sha256.New()
	fmt.Fprintf(f, "%s\x00%d\x00", method, len(bound))
	f.Write(bound)
	f.Write(body)
	return f.Sum(nil)
}

func TestHashPartsUnchanged(t *testing.T) {
	long := strings.Repeat("x", 700) // past hashParts' stack buffer
	for _, parts := range [][]string{
		{}, {""}, {"idem.key", "scope", "", "k-1"}, {"ab", "c"}, {"a", "bc"},
		{"idem.key", long, "idem-sha256:" + long, strings.Repeat("k", MaxKeyLength)},
		{"scope", "principal", "key", "charge"},
	} {
		got := hashParts(parts...)
		if want := hashPartsFmt(parts...); !bytes.Equal(got[:], want) {
			t.Errorf("hashParts(%.40q) = %x, want %x", parts, got, want)
		}
	}
	k := Key{Scope: "pkg.Charge", Principal: "tenant-1", Key: "k-1"}
	if got, want := k.Derive("psp"), fmt.Sprintf("%x", hashPartsFmt(k.Scope, k.Principal, k.Key, "psp"))[:32]; got != want {
		t.Errorf("Derive = %s, want %s", got, want)
	}
	if got, want := k.lockID(), int64(binary.BigEndian.Uint64(hashPartsFmt("idem.key", k.Scope, k.Principal, k.Key))); got != want {
		t.Errorf("lockID = %d, want %d", got, want)
	}
}

func TestFingerprintUnchanged(t *testing.T) {
	for _, c := range []struct {
		method      string
		bound, body []byte
	}{
		{"POST", nil, nil}, {"POST", nil, []byte(`{"order":"o-1","amount":100}`)},
		{"GET", []byte("id\x00123"), nil}, {"PATCH", bytes.Repeat([]byte("b"), 12345), []byte("{}")},
		{strings.Repeat("M", 100), []byte("x"), bytes.Repeat([]byte("y"), 1<<16)},
	} {
		if got, want := fingerprint(c.method, c.bound, c.body), fingerprintFmt(c.method, c.bound, c.body); !bytes.Equal(got, want) {
			t.Errorf("fingerprint(%.20q, %d bytes, %d bytes) = %x, want %x", c.method, len(c.bound), len(c.body), got, want)
		}
	}
}

func TestEncodeHeadersIsJSON(t *testing.T) {
	for _, h := range []http.Header{
		{}, nil,
		{"Content-Type": {"application/json"}},
		{"Content-Type": {"application/json"}, "Location": {"/payments/1"}},
		{"Content-Type": {"application/json", "text/plain"}},
		{"Content-Type": {"text/html; <b>&"}},
		{"Location": {"/x"}},
		{"Content-Type": {}},
	} {
		got, err := encodeHeaders(h)
		want, werr := json.Marshal(h)
		if err != nil || werr != nil || got != string(want) {
			t.Errorf("encodeHeaders(%v) = %s, %v; want %s, %v", h, got, err, want, werr)
		}
	}
}

// A stored jsonOnlyHeaders replays as json.Unmarshal decodes it.
func TestReplayJSONOnlyHeaders(t *testing.T) {
	want := http.Header{}
	if err := json.Unmarshal([]byte(jsonOnlyHeaders), &want); err != nil {
		t.Fatal(err)
	}
	in := &request{fingerprint: []byte{1}}
	for _, stored := range []string{jsonOnlyHeaders, `{"Content-Type":["application/json"],"Location":["/x"]}`, `{}`} {
		out, err := replay(t.Context(), db.GetKeyRow{Fingerprint: []byte{1}, StatusCode: 201, Headers: []byte(stored), Body: []byte("{}")}, in)
		w := http.Header{}
		if err == nil {
			err = json.Unmarshal([]byte(stored), &w)
		}
		if err != nil || fmt.Sprint(out.header) != fmt.Sprint(w) || !out.replayed || out.status != 201 {
			t.Errorf("replay of %s: %+v, %v; want header %v", stored, out, err, w)
		}
	}
	if fmt.Sprint(want) != fmt.Sprint(http.Header{"Content-Type": {"application/json"}}) {
		t.Errorf("jsonOnlyHeaders decodes to %v", want)
	}
}

// isJSON's shortcut for the exact "application/json" agrees with the parse.
func TestIsJSON(t *testing.T) {
	for ct, want := range map[string]bool{
		"application/json": true, "application/json; charset=utf-8": true, "Application/JSON": true,
		"application/problem+json": true, "text/plain": false, "application/jsonx": false,
	} {
		if got := isJSON(ct); got != want {
			t.Errorf("isJSON(%q) = %v, want %v", ct, got, want)
		}
	}
}
