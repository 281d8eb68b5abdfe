package generator

import (
	"bufio"
	"bytes"
	"fmt"
	"go/build"
	"go/build/constraint"
	"hash/fnv"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"unicode"
)

// buildConfig is the user's build configuration: the tags they asked for
// (with -tags or GOFLAGS), and how idemgen loads with LoadTag added.
type buildConfig struct {
	tags      []string
	loadFlags []string      // the user's, with LoadTag added
	userFlags []string      // the user's: the build the generated files are for
	ctx       build.Context // the user's build, to judge which files it selects

	// overlay holds the contents the vet-like loader parses in place of
	// the files on disk: those an -overlay in loadFlags gives the go
	// command (recheck's, see withOverlay).
	overlay map[string][]byte
}

// withOverlay returns the user's own build (without LoadTag, as recheck
// loads) with the files of overlay replaced or added: the go command reads
// them through the -overlay file jsonFile, which maps the same paths to
// copies of these contents, and the vet-like loader parses them from
// overlay. The -overlay flag on the command line replaces one in GOFLAGS,
// as go/packages' own Config.Overlay does.
func (bc *buildConfig) withOverlay(jsonFile string, overlay map[string][]byte) *buildConfig {
	c := *bc
	c.loadFlags = append(slices.Clone(bc.userFlags), "-overlay="+jsonFile)
	c.overlay = overlay
	return &c
}

func newBuildConfig(cfg Config) *buildConfig {
	env := cfg.Env
	if env == nil {
		env = os.Environ()
	}
	getenv := func(name string) string {
		v := ""
		for _, kv := range env {
			if k, val, ok := strings.Cut(kv, "="); ok && k == name {
				v = val // the last one wins, as in exec.Cmd
			}
		}
		return v
	}

	// A -tags flag on the command line replaces the one in GOFLAGS, so
	// idemgen's own tag must be merged into whichever applies.
	bc := &buildConfig{}
	var flags []string
	tagsGiven := false
	for i := 0; i < len(cfg.BuildFlags); i++ {
		f := cfg.BuildFlags[i]
		name, value, hasValue := strings.Cut(strings.TrimPrefix(f, "-"), "=")
		if name != "-tags" && name != "tags" {
			flags = append(flags, f)
			continue
		}
		if !hasValue && i+1 < len(cfg.BuildFlags) {
			i++
			value = cfg.BuildFlags[i]
		}
		tagsGiven = true
		bc.tags = splitTags(value)
	}
	if !tagsGiven {
		for _, f := range strings.Fields(getenv("GOFLAGS")) {
			name, value, _ := strings.Cut(strings.TrimPrefix(f, "-"), "=")
			if name == "-tags" || name == "tags" {
				bc.tags = splitTags(value)
			}
		}
	}
	bc.userFlags = slices.Clone(flags)
	if len(bc.tags) > 0 {
		bc.userFlags = append(bc.userFlags, "-tags="+strings.Join(bc.tags, ","))
	}
	bc.loadFlags = append(flags, "-tags="+strings.Join(append(slices.Clone(bc.tags), LoadTag), ","))

	bc.ctx = build.Default
	bc.ctx.BuildTags = bc.tags
	if v := getenv("GOOS"); v != "" {
		bc.ctx.GOOS = v
	}
	if v := getenv("GOARCH"); v != "" {
		bc.ctx.GOARCH = v
	}
	switch getenv("CGO_ENABLED") {
	case "0":
		bc.ctx.CgoEnabled = false
	case "1":
		bc.ctx.CgoEnabled = true
	}
	return bc
}

func splitTags(s string) []string {
	return strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' })
}

// selects reports whether the user's build (without LoadTag) compiles path.
func (bc *buildConfig) selects(path string) bool {
	ok, err := bc.ctx.MatchFile(filepath.Dir(path), filepath.Base(path))
	return err == nil && ok
}

// fileConstraint returns the build constraint of the Go file at path: its
// //go:build line (or // +build lines) and the GOOS/GOARCH its name implies,
// or nil if it has none.
func fileConstraint(path string) (constraint.Expr, error) {
	src, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var goBuild constraint.Expr
	var plusBuild []constraint.Expr
	sc := bufio.NewScanner(bytes.NewReader(src))
	sc.Buffer(nil, len(src)+1)
	inBlock := false
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case inBlock:
			if strings.Contains(line, "*/") {
				inBlock = false
			}
			continue
		case line == "":
			continue
		case strings.HasPrefix(line, "/*"):
			inBlock = !strings.Contains(line, "*/")
			continue
		case !strings.HasPrefix(line, "//"):
		case constraint.IsGoBuild(line):
			if goBuild, err = constraint.Parse(line); err != nil {
				return nil, err
			}
			continue
		case constraint.IsPlusBuild(line):
			x, err := constraint.Parse(line)
			if err != nil {
				return nil, err
			}
			plusBuild = append(plusBuild, x)
			continue
		default:
			continue
		}
		break // the package clause or another declaration: constraints end
	}
	expr := goBuild
	if expr == nil {
		for _, x := range plusBuild {
			expr = and(expr, x)
		}
	}
	for _, tag := range impliedTags(filepath.Base(path)) {
		expr = and(expr, &constraint.TagExpr{Tag: tag})
	}
	return expr, nil
}

func and(x, y constraint.Expr) constraint.Expr {
	if x == nil {
		return y
	}
	return &constraint.AndExpr{X: x, Y: y}
}

// impliedTags returns the GOOS and GOARCH a file name such as x_linux.go or
// x_linux_amd64.go restricts the file to (go/build's rules).
func impliedTags(name string) []string {
	name = strings.TrimSuffix(name, ".go")
	name = strings.TrimSuffix(name, "_test")
	i := strings.Index(name, "_")
	if i < 0 {
		return nil
	}
	parts := strings.Split(name[i+1:], "_")
	n := len(parts)
	if n >= 2 && knownOS[parts[n-2]] && knownArch[parts[n-1]] {
		return []string{parts[n-2], parts[n-1]}
	}
	if n >= 1 && (knownOS[parts[n-1]] || knownArch[parts[n-1]]) {
		return []string{parts[n-1]}
	}
	return nil
}

// knownOS and knownArch are go/build's lists (internal/syslist).
var knownOS = setOf("aix", "android", "darwin", "dragonfly", "freebsd", "hurd", "illumos", "ios", "js",
	"linux", "nacl", "netbsd", "openbsd", "plan9", "solaris", "wasip1", "windows", "zos")

var knownArch = setOf("386", "amd64", "amd64p32", "arm", "armbe", "arm64", "arm64be", "loong64", "mips",
	"mipsle", "mips64", "mips64le", "mips64p32", "mips64p32le", "ppc", "ppc64", "ppc64le", "riscv",
	"riscv64", "s390", "s390x", "sparc", "sparc64", "wasm")

func setOf(names ...string) map[string]bool {
	m := map[string]bool{}
	for _, n := range names {
		m[n] = true
	}
	return m
}

// group is the functions and types of one package whose files share a build
// constraint; each group is generated into its own file.
type group struct {
	expr   constraint.Expr // nil: no constraint
	file   string          // idem_gen.go or idem_gen_<words>.go
	suffix string          // appended to package-level generated names: "" or e.g. "Integration"

	https    []*httpFunc
	consumes []*consumeFunc
	outboxes []*outboxType

	registerName, consumersName string
}

// newGroup names the generated file and functions of constraint expr.
func newGroup(expr constraint.Expr) *group {
	if expr == nil {
		return &group{file: FileName}
	}
	words := exprWords(expr)
	// The words name one constraint only when they read back unambiguously:
	// (a || b) && c and a || (b && c) both spell a_or_b_and_c, tags Foo and
	// foo both spell foo. Such a constraint gets a hash of its exact text, so
	// that two constraints never share a file (one would overwrite the other
	// and check would never agree with gen).
	if !spellable(expr) {
		h := fnv.New32a()
		h.Write([]byte(expr.String()))
		words = append(words, fmt.Sprintf("%08x", h.Sum32()))
	}
	// The file name must not imply a GOOS, GOARCH or test file of its own
	// (idem_gen_not_windows.go would be windows-only).
	if name := "idem_gen_" + strings.Join(words, "_"); len(impliedTags(name+".go")) > 0 || strings.HasSuffix(name, "_test") {
		words = append(words, "tags")
	}
	var suffix strings.Builder
	for _, w := range words {
		r := []rune(w)
		r[0] = unicode.ToUpper(r[0])
		suffix.WriteString(string(r))
	}
	return &group{expr: expr, file: "idem_gen_" + strings.Join(words, "_") + ".go", suffix: suffix.String()}
}

// spellable reports whether exprWords(x) names x alone, up to the
// associativity of one operator: lower-case tags of letters and digits
// that are not one of the words the spelling itself uses, negation of tags
// only, and not both && and ||.
func spellable(x constraint.Expr) bool {
	ops := map[string]bool{}
	var ok func(x constraint.Expr) bool
	ok = func(x constraint.Expr) bool {
		switch x := x.(type) {
		case *constraint.TagExpr:
			switch x.Tag {
			case "and", "or", "not", "tags":
				return false
			}
			for _, r := range x.Tag {
				if !('a' <= r && r <= 'z' || '0' <= r && r <= '9') {
					return false
				}
			}
			return true
		case *constraint.NotExpr:
			_, isTag := x.X.(*constraint.TagExpr)
			return isTag && ok(x.X)
		case *constraint.AndExpr:
			ops["and"] = true
			return ok(x.X) && ok(x.Y)
		case *constraint.OrExpr:
			ops["or"] = true
			return ok(x.X) && ok(x.Y)
		}
		return false
	}
	return ok(x) && len(ops) < 2
}

// exprWords spells a constraint as file-name words: integration,
// not_windows, linux_and_amd64.
func exprWords(x constraint.Expr) []string {
	switch x := x.(type) {
	case *constraint.TagExpr:
		return []string{strings.Map(func(r rune) rune {
			if r < unicode.MaxASCII && (unicode.IsLetter(r) || unicode.IsDigit(r)) {
				return unicode.ToLower(r)
			}
			return '_'
		}, x.Tag)}
	case *constraint.NotExpr:
		return append([]string{"not"}, exprWords(x.X)...)
	case *constraint.AndExpr:
		return append(append(exprWords(x.X), "and"), exprWords(x.Y)...)
	case *constraint.OrExpr:
		return append(append(exprWords(x.X), "or"), exprWords(x.Y)...)
	}
	return []string{"x"}
}

// buildLine is the //go:build line of g's generated file.
func (g *group) buildLine() string {
	not := &constraint.NotExpr{X: &constraint.TagExpr{Tag: LoadTag}}
	if g.expr == nil {
		return "//go:build " + not.String()
	}
	return "//go:build " + (&constraint.AndExpr{X: g.expr, Y: not}).String()
}
