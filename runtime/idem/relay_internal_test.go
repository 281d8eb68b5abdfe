package idem

import (
	"errors"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// last_error must be text PostgreSQL accepts whatever the broker said: no
// NUL (SQLSTATE 22021), valid UTF-8, bounded.
func TestRelayErrorText(t *testing.T) {
	got := relayErrorText(errors.New("a\x00b\xff\xfec" + strings.Repeat("€", 3000)))
	if strings.ContainsRune(got, 0) || !utf8.ValidString(got) || len(got) > maxRelayErrorText+len("…") {
		t.Fatalf("not storable: %d bytes, valid %v, NUL %v", len(got), utf8.ValidString(got), strings.ContainsRune(got, 0))
	}
	if !strings.HasPrefix(got, `a\0b`+"\uFFFD\uFFFDc€") || !strings.HasSuffix(got, "€…") {
		t.Fatalf("text not kept recognizably: %q…", got[:20])
	}
	if got := relayErrorText(errors.New("")); got == "" {
		t.Fatal("an empty error stored as empty text: a failing row would look like it never failed")
	}
}

// The backoff grows from base, stays within [d/2, d], and never passes the cap.
func TestRelayBackoff(t *testing.T) {
	var b backoff
	prevMax := time.Duration(0)
	for i := 0; i < 40; i++ {
		d := b.next(100*time.Millisecond, 2*time.Second)
		want := min(100*time.Millisecond<<min(i, 10), 2*time.Second)
		if d < want/2 || d > want {
			t.Fatalf("step %d: %v, want within [%v, %v]", i, d, want/2, want)
		}
		prevMax = max(prevMax, d)
	}
	if prevMax > 2*time.Second {
		t.Fatalf("backoff %v past its cap", prevMax)
	}
	b.reset()
	if d := b.next(100*time.Millisecond, 2*time.Second); d > 100*time.Millisecond {
		t.Fatalf("after reset: %v", d)
	}
}
