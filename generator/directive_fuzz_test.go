package generator

import (
	"go/token"
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzParseDirective feeds arbitrary directive lines to the parser. No input
// may panic; every rejection is an error positioned on the directive's line,
// within it; an accepted directive has a known kind and only that kind's
// options, each once. Run longer with:
//
//	go test ./generator -run '^$' -fuzz FuzzParseDirective -fuzztime 1m
func FuzzParseDirective(f *testing.F) {
	for _, seed := range []string{
		`//idem:http route="POST /payments" status=201 ttl=24h`,
		`//idem:http`,
		`//idem:http rout="POST /x" stauts=201`,
		`//idem:http route="POST /f status=201`,
		"//idem:http route=`POST /raw` wait=0 key=optional header=X-Request-Id scope=\"a b\"",
		`//idem:consume topic=orders.confirmed context=billing id=EventID decode=dec`,
		`//idem:consume context=billing`,
		`//idem:outbox topic=billing.charged key=OrderID`,
		`//idem:`,
		`//idem:htp route=x`,
		`//idem:http ttl route=x"y" =v ==`,
		"//idem:http\troute=\"GET /\"\t status=299",
		`//idem:http route="\xff"`,
	} {
		f.Add(seed)
	}
	pos := token.Position{Filename: "f.go", Line: 7, Column: 1, Offset: 100}
	f.Fuzz(func(t *testing.T, text string) {
		if !strings.HasPrefix(text, directivePrefix) {
			text = directivePrefix + text
		}
		if strings.ContainsAny(text, "\n\r") {
			return // a // comment cannot span lines
		}
		d, errs := parseDirective(text, pos)
		for _, e := range errs {
			if e.Pos.Filename != pos.Filename || e.Pos.Line != pos.Line {
				t.Fatalf("error %q at %v, not on the directive's line", e.Msg, e.Pos)
			}
			if e.Pos.Column < pos.Column || e.Pos.Column > pos.Column+len(text) {
				t.Fatalf("error %q at column %d, outside the %d-byte directive", e.Msg, e.Pos.Column, len(text))
			}
			if e.Msg == "" || !utf8.ValidString(e.Msg) && utf8.ValidString(text) {
				t.Fatalf("empty or invalid message for %q", text)
			}
		}
		if d == nil {
			if len(errs) == 0 {
				t.Fatalf("%q: no directive and no error", text)
			}
			return
		}
		spec, ok := kinds[d.Kind]
		if !ok {
			t.Fatalf("%q: parsed unknown kind %q", text, d.Kind)
		}
		seen := map[string]bool{}
		for _, o := range d.Options {
			if _, known := spec.options[o.Name]; !known || seen[o.Name] {
				t.Fatalf("%q: accepted option %q (unknown or repeated)", text, o.Name)
			}
			seen[o.Name] = true
			if err := spec.options[o.Name](o.Value); err != nil {
				t.Fatalf("%q: accepted invalid value %q for %s: %v", text, o.Value, o.Name, err)
			}
		}
		if len(errs) == 0 {
			for _, r := range spec.required {
				if !seen[r] {
					t.Fatalf("%q: accepted without required option %s", text, r)
				}
			}
		}
	})
}
