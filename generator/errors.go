package generator

import (
	"fmt"
	"go/token"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/tools/go/packages"
)

// Error is one problem in the user's code, at a position.
type Error struct {
	Pos token.Position // Filename is relative to Config.Dir where possible
	Msg string
}

func (e *Error) Error() string {
	if !e.Pos.IsValid() {
		if e.Pos.Filename != "" {
			return e.Pos.Filename + ": " + e.Msg
		}
		return e.Msg
	}
	return fmt.Sprintf("%s:%d:%d: %s", e.Pos.Filename, e.Pos.Line, e.Pos.Column, e.Msg)
}

// ErrorList is every problem found in one run, sorted by position. Generate
// reports all of them at once rather than stopping at the first.
type ErrorList []*Error

func (l ErrorList) Error() string {
	msgs := make([]string, len(l))
	for i, e := range l {
		msgs[i] = e.Error()
	}
	return strings.Join(msgs, "\n")
}

// errorSink collects errors with positions made relative to dir.
type errorSink struct {
	dir  string
	errs ErrorList
}

func (s *errorSink) add(pos token.Position, format string, args ...any) {
	s.errs = append(s.errs, &Error{Pos: s.rel(pos), Msg: fmt.Sprintf(format, args...)})
}

// addLoadErrors adds a package's load and type errors. The type checker
// reports the other half of an error ("A redeclared" and "\tother
// declaration of A") as a second error starting with a tab; sorted by
// position on its own, it came first, a line that explains nothing, before
// the error it belongs to. It is kept under that error, as go build prints
// it.
func (s *errorSink) addLoadErrors(list []packages.Error) {
	var last *Error
	for _, e := range list {
		pos := s.rel(parsePos(e.Pos))
		if rest, ok := strings.CutPrefix(e.Msg, "\t"); ok && last != nil {
			last.Msg += "\n\t" + (&Error{Pos: pos, Msg: rest}).Error()
			continue
		}
		last = &Error{Pos: pos, Msg: e.Msg}
		s.errs = append(s.errs, last)
	}
}

func (s *errorSink) rel(pos token.Position) token.Position {
	if pos.Filename != "" && s.dir != "" && filepath.IsAbs(pos.Filename) {
		if r, err := filepath.Rel(s.dir, pos.Filename); err == nil && !strings.HasPrefix(r, "..") {
			pos.Filename = r
		}
	}
	return pos
}

// result returns the sorted, de-duplicated errors, or nil.
func (s *errorSink) result() error {
	if len(s.errs) == 0 {
		return nil
	}
	sort.SliceStable(s.errs, func(i, j int) bool {
		a, b := s.errs[i].Pos, s.errs[j].Pos
		if a.Filename != b.Filename {
			return a.Filename < b.Filename
		}
		if a.Line != b.Line {
			return a.Line < b.Line
		}
		if a.Column != b.Column {
			return a.Column < b.Column
		}
		return s.errs[i].Msg < s.errs[j].Msg
	})
	out := s.errs[:0]
	for i, e := range s.errs {
		if i > 0 && e.Error() == s.errs[i-1].Error() {
			continue
		}
		out = append(out, e)
	}
	return out
}

// parsePos parses go/packages' "file:line:col" (or "file:line", or "-")
// error positions.
func parsePos(s string) token.Position {
	var pos token.Position
	parts := strings.Split(s, ":")
	nums := []*int{&pos.Column, &pos.Line}
	for len(parts) > 1 && len(nums) > 0 {
		n, err := strconv.Atoi(parts[len(parts)-1])
		if err != nil {
			break
		}
		*nums[0] = n
		nums = nums[1:]
		parts = parts[:len(parts)-1]
	}
	if pos.Column != 0 && pos.Line == 0 { // only "file:line" was given
		pos.Line, pos.Column = pos.Column, 0
	}
	if name := strings.Join(parts, ":"); name != "-" {
		pos.Filename = name
	}
	return pos
}
