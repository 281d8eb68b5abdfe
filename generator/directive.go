package generator

import (
	"fmt"
	"go/token"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/idemgen/idemgen/internal/suggest"
)

// directivePrefix starts every idemgen directive. Like //go:generate, there is
// no space after the slashes; go/ast's CommentGroup.Text drops such lines, so
// directives are read from CommentGroup.List.
const directivePrefix = "//idem:"

// A Directive is one parsed //idem: line.
type Directive struct {
	Kind    string         // http, consume or outbox
	Pos     token.Position // of the "//"
	Options []Option       // in source order; names are unique
}

// An Option is one name=value pair of a directive.
type Option struct {
	Name  string
	Value string // unquoted
	Pos   token.Position
}

// Option returns the value of the named option, and whether it was given.
func (d *Directive) Option(name string) (Option, bool) {
	for _, o := range d.Options {
		if o.Name == name {
			return o, true
		}
	}
	return Option{}, false
}

// target is what a directive kind may annotate.
type target int

const (
	targetFunc target = iota
	targetType
)

// kindSpec is the grammar of one directive kind.
type kindSpec struct {
	target   target
	options  map[string]func(string) error // validators
	required []string
	shape    string // what the annotated declaration must look like, for errors
}

// kinds is the whole directive grammar.
var kinds = map[string]kindSpec{
	"http": {
		target: targetFunc,
		options: map[string]func(string) error{
			"route":  validRoute,
			"status": validStatus,
			"ttl":    validPositiveDuration,
			"header": validHeaderName,
			"scope":  validStoredText,
			"wait":   validNonNegativeDuration,
			"key":    oneOf("required", "optional"),
			"ignore": validIgnore,
		},
		shape: "func(ctx context.Context, tx pgx.Tx, req Req) (Resp, error)",
	},
	"consume": {
		target: targetFunc,
		options: map[string]func(string) error{
			"topic":   validTopic,
			"context": validStoredText,
			"id":      validIdent,
			"decode":  validFuncName,
		},
		required: []string{"topic"},
		shape:    "func(ctx context.Context, tx pgx.Tx, ev Event) error",
	},
	"outbox": {
		target: targetType,
		options: map[string]func(string) error{
			"topic": validTopic,
			"key":   validIdent,
		},
		required: []string{"topic"},
		shape:    "a struct type",
	},
}

// parseDirective parses text, a comment starting with directivePrefix, at pos.
// It returns the directive (nil if the kind is unknown) and every problem
// found, each at the column of the offending part.
func parseDirective(text string, pos token.Position) (*Directive, []*Error) {
	var errs []*Error
	invalid := map[string]bool{} // options given with a value that failed validation
	at := func(off int) token.Position {
		p := pos
		p.Column += off
		p.Offset += off
		return p
	}
	fail := func(off int, format string, args ...any) {
		errs = append(errs, &Error{Pos: at(off), Msg: fmt.Sprintf(format, args...)})
	}

	i := len(directivePrefix)
	start := i
	for i < len(text) && !isSpace(text[i]) {
		i++
	}
	kind := text[start:i]
	spec, ok := kinds[kind]
	if !ok {
		names := sortedKeys(kinds)
		if kind == "" {
			fail(start, "missing directive kind after //idem: (want one of %s)", strings.Join(names, ", "))
		} else {
			fail(start, "unknown directive //idem:%s%s (want one of %s)", kind, suggest.DidYouMean(kind, names), strings.Join(names, ", "))
		}
		return nil, errs
	}
	d := &Directive{Kind: kind, Pos: pos}

	for {
		for i < len(text) && isSpace(text[i]) {
			i++
		}
		if i >= len(text) {
			break
		}
		nameStart := i
		for i < len(text) && text[i] != '=' && !isSpace(text[i]) {
			i++
		}
		name := text[nameStart:i]
		if i >= len(text) || text[i] != '=' {
			fail(nameStart, "option %q of //idem:%s has no value: write %s=VALUE", name, kind, name)
			continue
		}
		i++ // '='
		valStart := i
		var value string
		if i < len(text) && (text[i] == '"' || text[i] == '`') {
			q, err := strconv.QuotedPrefix(text[i:])
			if err != nil {
				fail(valStart, "option %s of //idem:%s: unterminated or invalid quoted value", name, kind)
				break
			}
			value, _ = strconv.Unquote(q)
			i += len(q)
			if i < len(text) && !isSpace(text[i]) {
				fail(i, "option %s of //idem:%s: want a space after the quoted value", name, kind)
				for i < len(text) && !isSpace(text[i]) {
					i++
				}
				continue
			}
		} else {
			for i < len(text) && !isSpace(text[i]) {
				i++
			}
			value = text[valStart:i]
		}

		validate, known := spec.options[name]
		switch {
		case name == "":
			fail(nameStart, "missing option name before '=' in //idem:%s", kind)
		case !known:
			names := sortedKeys(spec.options)
			fail(nameStart, "unknown option %q for //idem:%s%s (valid options: %s)", name, kind, suggest.DidYouMean(name, names), strings.Join(names, ", "))
		case hasOption(d, name):
			fail(nameStart, "option %s given twice in //idem:%s", name, kind)
		default:
			if err := validate(value); err != nil {
				fail(valStart, "option %s of //idem:%s: %v", name, kind, err)
				invalid[name] = true
				continue
			}
			d.Options = append(d.Options, Option{Name: name, Value: value, Pos: at(nameStart)})
		}
	}
	for _, r := range spec.required {
		// A required option given with a bad value has its own error.
		if !hasOption(d, r) && !invalid[r] {
			fail(0, "//idem:%s needs option %s=...", kind, r)
		}
	}
	return d, errs
}

func hasOption(d *Directive, name string) bool {
	_, ok := d.Option(name)
	return ok
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' }

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// Option validators. Each returns an error that completes the sentence
// "option NAME of //idem:KIND: ...".

func validNonEmpty(v string) error {
	if strings.TrimSpace(v) == "" {
		return fmt.Errorf("must not be empty")
	}
	return nil
}

// validStoredText checks a value the runtime stores in a PostgreSQL text
// column (a scope in idem_keys, a context in idem_processed_events): one it
// cannot store ("a\x00b", "\xff") passed, and every request of the
// endpoint failed, or every record of the consumer became a dead letter.
func validStoredText(v string) error {
	if err := validNonEmpty(v); err != nil {
		return err
	}
	if !utf8.ValidString(v) || strings.ContainsRune(v, 0) {
		return fmt.Errorf("%q: PostgreSQL's text cannot store it (a NUL byte or invalid UTF-8)", v)
	}
	return nil
}

// validTopic checks a Kafka topic name as brokers do (Kafka's
// Topic.validate): 1 to 249 of [a-zA-Z0-9._-], not "." or "..". A
// topic the broker refuses passed, and the relay parked every event of
// the outbox type, or the consumer never received one.
func validTopic(v string) error {
	if err := validNonEmpty(v); err != nil {
		return err
	}
	if v == "." || v == ".." {
		return fmt.Errorf("%q is not a valid Kafka topic name", v)
	}
	if len(v) > 249 {
		return fmt.Errorf("Kafka topic names are at most 249 characters; this one has %d", len(v))
	}
	for _, r := range v {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return fmt.Errorf("%q: Kafka topic names hold only ASCII letters, digits, '.', '_' and '-'", v)
		}
	}
	return nil
}

func validIdent(v string) error {
	if !token.IsIdentifier(v) {
		return fmt.Errorf("%q is not a Go field name", v)
	}
	if !token.IsExported(v) {
		return fmt.Errorf("field %s is unexported; JSON encoding only sees exported fields", v)
	}
	return nil
}

func validFuncName(v string) error {
	if !token.IsIdentifier(v) {
		return fmt.Errorf("%q is not a Go function name", v)
	}
	return nil
}

// validRoute checks a route as http.ServeMux would, and first for what
// ServeMux lets through but generated code cannot hold: the route is also
// written into the wrapper's doc comment, where a NUL or invalid UTF-8 does
// not gofmt and a line break ends the comment. No request path matches such
// a route anyway.
func validRoute(v string) error {
	if !utf8.ValidString(v) {
		return fmt.Errorf("%q: a route must be valid UTF-8", v)
	}
	if strings.IndexFunc(v, unicode.IsControl) >= 0 {
		return fmt.Errorf("%q: a route holds no control characters", v)
	}
	method, path, hasMethod := strings.Cut(v, " ")
	if !hasMethod {
		method, path = "", v
	}
	if hasMethod && (method == "" || strings.ToUpper(method) != method || strings.IndexFunc(method, func(r rune) bool { return !unicode.IsLetter(r) }) >= 0) {
		return fmt.Errorf("%q: want \"METHOD /path\", e.g. \"POST /payments\"", v)
	}
	if !strings.HasPrefix(path, "/") {
		return fmt.Errorf("%q: the path must start with '/' (want \"METHOD /path\", e.g. \"POST /payments\")", v)
	}
	// http.ServeMux is the judge of what a pattern is: it panics on a bad one.
	var err error
	func() {
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("%q is not a valid http.ServeMux pattern: %v", v, r)
			}
		}()
		http.NewServeMux().Handle(v, http.NotFoundHandler())
	}()
	return err
}

func validStatus(v string) error {
	n, err := strconv.Atoi(v)
	if err != nil || n < 200 || n > 299 {
		return fmt.Errorf("%q: want a 2xx status code such as 200 or 201 (errors choose their status with idem.Error)", v)
	}
	return nil
}

func validPositiveDuration(v string) error {
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		return fmt.Errorf("%q: want a positive Go duration such as 24h or 90m", v)
	}
	return nil
}

func validNonNegativeDuration(v string) error {
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		return fmt.Errorf("%q: want a Go duration such as 5s, or 0 for no wait", v)
	}
	return nil
}

func validHeaderName(v string) error {
	if v == "" {
		return fmt.Errorf("must not be empty")
	}
	for _, r := range v {
		if r > unicode.MaxASCII || !(unicode.IsLetter(r) || unicode.IsDigit(r) || strings.ContainsRune("!#$%&'*+-.^_`|~", r)) {
			return fmt.Errorf("%q is not a valid header name", v)
		}
	}
	return nil
}

func oneOf(values ...string) func(string) error {
	return func(v string) error {
		for _, w := range values {
			if v == w {
				return nil
			}
		}
		return fmt.Errorf("%q: want one of %s", v, strings.Join(values, ", "))
	}
}
