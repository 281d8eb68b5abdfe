// Command idemctl is the operator's tool for idemgen's tables: outbox
// status and repair, dead letters, idempotency keys. It talks to the
// database at $DATABASE_URL (its search_path selects the schema) and, to
// replay dead letters, to Kafka at $KAFKA_BROKERS.
//
// It is a separate binary from idemgen on purpose: it runs on production
// hosts and in operators' shells, so it links only the runtime (pgx,
// franz-go), not the generator's golang.org/x/tools; and it never needs a Go
// toolchain or the service's source.
//
// Every command that changes something prints what it would do and does it
// only with --yes. Exit status: 0 done (or a dry run), 1 refused or not
// found, 2 usage or error.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"math"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/internal/shutdown"
	"github.com/idemgen/idemgen/runtime/admin"
	"github.com/idemgen/idemgen/runtime/idem"
)

const usage = `usage: idemctl <command> [flags]

Outbox:
  outbox status                            counts per state, oldest pending age, active relay
  outbox parked   [--topic T] [--id N] [--limit N] [--after ID]
                                           list parked events with their last error,
                                           oldest first, a page of --limit (default 100)
  outbox requeue  (--all | --id N | --topic T) [--yes]
                                           parked -> pending, with a fresh attempt budget
                                           (--all, --topic: committed 1,000 at a time)
  outbox purge    (--published | --parked) --older-than DURATION [--yes]
                                           delete rows published / parked more than
                                           DURATION ago (a parked row with no parking
                                           time, parked by an older version, is kept)
  outbox purge    --parked --id N [--yes]  delete one parked row, whatever its age

Dead letters:
  deadletters list    [--context C] [--topic T] [--all] [--limit N] [--after ID]
                                           not yet replayed ones (--all: replayed too),
                                           a page of --limit (default 100)
  deadletters show    --id N [--max-bytes 4096 | --full]
                                           key, value and headers, escaped; each cut at
                                           --max-bytes bytes (its full size noted), the
                                           first 100 headers; --full: everything, whole
  deadletters replay  --id N [--yes] [--timeout 30s] [--processed-event-age 168h] [--force]
                                           re-produce to its topic (needs KAFKA_BROKERS),
                                           mark it replayed once the broker acked; one
                                           older than the janitor's ProcessedEventAge is
                                           refused without --force (other contexts that
                                           applied it would apply it again)
  deadletters discard --id N [--yes]

Idempotency keys (scoped: name the scope, the principal and the key):
  keys show    --scope S --principal P --key K [--max-bytes 4096 | --full]
                                           the stored response (status, body, headers),
                                           bounded as deadletters show is
  keys release --scope S --principal P --key K [--yes]
                                           delete a stored key so the next request runs
                                           anew; refused while a request holds it

Environment:
  DATABASE_URL     PostgreSQL (default postgres://postgres@127.0.0.1:5432/postgres);
                   its search_path selects the schema with idemgen's tables
  KAFKA_BROKERS    comma-separated seed brokers, for deadletters replay
  IDEMCTL_TIMEOUT  how long a command may wait for the database (default 1m; replay
                   adds its --timeout, and up to 15s to settle the mark once the broker
                   acked; purge and requeue: each batch): a database that never answers
                   is an error (exit 2), not a hang

Without --yes a mutating command only prints what it would do (a dry run).
Exit status: 0 done or dry run, 1 refused or not found, 2 usage or error.
`

const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// defaultTimeout bounds a command's database work unless IDEMCTL_TIMEOUT says
// otherwise. Without a bound, a database behind a partition (connections
// accepted, or packets dropped, and never answered) hangs idemctl until the
// operator gives up on it; pgx has no connect or query timeout of its own.
const defaultTimeout = time.Minute

// dryRunShown is how many rows a dry run lists; it counts them all.
const dryRunShown = 20

// exit codes
const (
	exitOK      = 0
	exitRefused = 1
	exitError   = 2
)

func main() {
	ctx, stop := shutdown.Context("idemctl")
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// errRefused marks an outcome that is not a failure of idemctl but a "no":
// not found, or in flight.
type errRefused struct{ error }

func (e errRefused) Unwrap() error { return e.error }

type usageError string

func (e usageError) Error() string { return string(e) }

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		fmt.Fprint(stdout, usage)
		if len(args) == 0 {
			return exitError
		}
		return exitOK
	}
	if len(args) < 2 {
		fmt.Fprintf(stderr, "idemctl: %s needs a subcommand\n\n%s", args[0], usage)
		return exitError
	}
	timeout := defaultTimeout
	if v := os.Getenv("IDEMCTL_TIMEOUT"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			fmt.Fprintf(stderr, "idemctl: IDEMCTL_TIMEOUT=%q: want a positive duration such as 30s\n", v)
			return exitError
		}
		timeout = d
	}
	c := &cli{out: stdout, ctx: ctx, base: ctx, timeout: timeout}
	cmds := map[string]func([]string) error{
		"outbox status":       c.outboxStatus,
		"outbox parked":       c.outboxParked,
		"outbox requeue":      c.outboxRequeue,
		"outbox purge":        c.outboxPurge,
		"deadletters list":    c.deadLettersList,
		"deadletters show":    c.deadLettersShow,
		"deadletters replay":  c.deadLettersReplay,
		"deadletters discard": c.deadLettersDiscard,
		"keys show":           c.keysShow,
		"keys release":        c.keysRelease,
	}
	name := args[0] + " " + args[1]
	fn, ok := cmds[name]
	if !ok {
		fmt.Fprintf(stderr, "idemctl: unknown command %q\n\n%s", name, usage)
		return exitError
	}
	defer c.close()
	err := fn(args[2:])
	var u usageError
	var refused errRefused
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, flag.ErrHelp):
		// "idemctl outbox parked --help" printed nothing at all.
		fmt.Fprint(stdout, usage)
		return exitOK
	case errors.As(err, &u):
		fmt.Fprintf(stderr, "idemctl %s: %v\n", name, err)
		return exitError
	case errors.Is(err, admin.ErrProducedNotMarked):
		// Before the timeout case: a mark cut short by the command's
		// deadline must not read as "the database did not answer" alone.
		fmt.Fprintf(stderr, "idemctl %s: %v\n%s", name, err, c.notMarkedAdvice)
		return exitError
	case c.timedOut():
		fmt.Fprintf(stderr, "idemctl %s: gave up after %v (IDEMCTL_TIMEOUT): the database at %s did not answer in time: %v\n", name, c.deadline, c.dbHost(), err)
		return exitError
	case errors.As(err, &refused), errors.Is(err, admin.ErrNotFound), errors.Is(err, admin.ErrInFlight):
		fmt.Fprintf(stderr, "idemctl %s: %v\n", name, err)
		return exitRefused
	case isUndefinedTable(err):
		// A wrong or missing search_path is the usual cause: say so.
		fmt.Fprintf(stderr, "idemctl %s: %v\nidemctl: no idemgen tables in the schema DATABASE_URL selects: set its search_path to the service's schema (postgres://...?search_path=myschema); idem.Migrate or `idemgen schema` creates them\n", name, err)
		return exitError
	default:
		fmt.Fprintf(stderr, "idemctl %s: %v\n", name, err)
		return exitError
	}
}

// isUndefinedTable reports PostgreSQL's "relation does not exist" (42P01).
func isUndefinedTable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "42P01"
}

type cli struct {
	// ctx is the command's context: base (cancelled by SIGINT) under the
	// command's deadline once admin() ran.
	ctx, base context.Context
	// batchTimedOut: one batch of a purge, bounded on its own, timed out.
	batchTimedOut bool
	out           io.Writer
	pool          *pgxpool.Pool
	// timeout bounds the command's database work (IDEMCTL_TIMEOUT); extra
	// is added to it by commands that also wait on something else (replay's
	// broker ack). deadline is the bound in force once admin() ran.
	timeout, extra, deadline time.Duration
	cancel                   context.CancelFunc
	// processedAge is replay's --processed-event-age.
	processedAge time.Duration
	// notMarkedAdvice is what replay tells the operator when the record was
	// produced but the dead letter not marked (admin.ErrProducedNotMarked).
	notMarkedAdvice string
	// maxBytes bounds each field deadletters show and keys show print
	// (key, value, body, header names and values, ...), and while it is
	// set they list at most maxHeadersShown headers; 0: unbounded (--full).
	// See boundFlags.
	maxBytes int
	host     string
}

// admin connects to DATABASE_URL and puts the command's context under its
// deadline: everything from here on (connecting included) must finish
// within IDEMCTL_TIMEOUT (+ extra).
func (c *cli) admin() (*admin.Admin, error) {
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = defaultDatabaseURL
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	c.host = fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port)
	c.deadline = c.timeout + c.extra
	if c.deadline < c.timeout { // IDEMCTL_TIMEOUT=2562047h plus --timeout 1h wrapped around: "gave up after -1h34m" at once
		c.deadline = math.MaxInt64
	}
	c.ctx, c.cancel = context.WithTimeout(c.ctx, c.deadline)
	pool, err := pgxpool.NewWithConfig(c.ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to DATABASE_URL: %w", err)
	}
	c.pool = pool
	return admin.New(pool), nil
}

// timedOut reports whether the command's own deadline (not an inner one,
// such as replay's --timeout for the broker) ended it.
func (c *cli) timedOut() bool {
	return c.batchTimedOut || c.cancel != nil && errors.Is(c.ctx.Err(), context.DeadlineExceeded)
}

func (c *cli) dbHost() string { return c.host }

// closeWait bounds how long idemctl waits, once its command is done, for
// the pool to close its connections.
const closeWait = time.Second

func (c *cli) close() {
	if c.pool != nil {
		// pgxpool.Close waits up to 15s for each connection's cleanup, and
		// a connection that timed out on a database that stopped answering
		// (a partition) spends all of them sending it a cancel request: a
		// replay whose mark timed out said so after 10s, then sat 15s more
		// before exiting. Past closeWait the cleanup is left to the exit,
		// which closes the sockets.
		done := make(chan struct{})
		go func() {
			c.pool.Close()
			close(done)
		}()
		select {
		case <-done:
		case <-time.After(closeWait):
		}
	}
	if c.cancel != nil {
		c.cancel()
	}
}

func (c *cli) printf(format string, args ...any) { fmt.Fprintf(c.out, format, args...) }

// parse parses flags; positional arguments are refused.
func parse(fs *flag.FlagSet, args []string) error {
	fs.SetOutput(io.Discard)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageError(err.Error())
	}
	if fs.NArg() > 0 {
		return usageError(fmt.Sprintf("unexpected argument %q", fs.Arg(0)))
	}
	// A text column holds no such value: PostgreSQL refused the query
	// ("invalid byte sequence for encoding UTF8", exit 2). A principal may
	// be anything: the runtime stores such a one hashed.
	var bad error
	fs.Visit(func(f *flag.Flag) {
		if v := f.Value.String(); bad == nil && f.Name != "principal" && (!utf8.ValidString(v) || strings.ContainsRune(v, 0)) {
			bad = usageError(fmt.Sprintf("--%s %q is not valid UTF-8 text: no stored row has it", f.Name, v))
		}
	})
	return bad
}

func (c *cli) outboxStatus(args []string) error {
	fs := flag.NewFlagSet("outbox status", flag.ContinueOnError)
	if err := parse(fs, args); err != nil {
		return err
	}
	a, err := c.admin()
	if err != nil {
		return err
	}
	st, err := a.OutboxStatus(c.ctx)
	if err != nil {
		return err
	}
	c.printf("pending     %d\npublishing  %d\npublished   %d\nparked      %d\n", st.Pending, st.Publishing, st.Published, st.Parked)
	if st.OldestPending.IsZero() {
		c.printf("oldest pending: none\n")
	} else {
		c.printf("oldest pending: %s (age %s)\n", st.OldestPending.UTC().Format(time.RFC3339), st.OldestPendingAge.Round(time.Second))
	}
	switch l := st.Leader; {
	case l == nil:
		c.printf("relay leader: none (no relay has led yet)\n")
	case l.Live:
		c.printf("relay leader: %s (lease %s, acquired %s, expires in %s)\n", escape([]byte(l.Holder)), escape([]byte(l.Name)),
			l.AcquiredAt.UTC().Format(time.RFC3339), l.Remaining.Round(time.Second))
	default:
		c.printf("relay leader: none live (last: %s, lease expired %s)\n", escape([]byte(l.Holder)), l.ExpiresAt.UTC().Format(time.RFC3339))
	}
	return nil
}

func (c *cli) outboxParked(args []string) error {
	fs := flag.NewFlagSet("outbox parked", flag.ContinueOnError)
	topic := fs.String("topic", "", "only this topic")
	id := fs.Int64("id", 0, "only this outbox row")
	limit := fs.Int("limit", 100, "list at most this many")
	after := fs.Int64("after", 0, "list rows with an id above this (the next page)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := pageFlags(*limit, *after); err != nil {
		return err
	}
	if *id < 0 {
		return usageError("--id must be positive")
	}
	a, err := c.admin()
	if err != nil {
		return err
	}
	f := admin.OutboxFilter{ID: *id, Topic: *topic}
	total, err := a.CountParkedEvents(c.ctx, f)
	if err != nil {
		return err
	}
	f.After = *after
	rows, err := a.ParkedEvents(c.ctx, f, peek(*limit))
	if err != nil {
		return err
	}
	more := len(rows) > *limit
	rows = rows[:min(len(rows), *limit)]
	c.printf("%d parked\n", total)
	c.printParked(rows)
	c.printPage(len(rows), total, *after, *limit, more, func(i int) int64 { return rows[i].ID })
	return nil
}

// peek is the row count a listing of limit rows asks for: one more, to
// know whether a next page exists.
func peek(limit int) int {
	if limit >= math.MaxInt32 {
		return limit
	}
	return limit + 1
}

// pageFlags checks --limit and --after.
func pageFlags(limit int, after int64) error {
	if limit < 0 {
		return usageError("--limit must not be negative")
	}
	if after < 0 {
		return usageError("--after must not be negative")
	}
	return nil
}

// printPage tells, when a listing shows fewer rows than match, which ones it
// showed and how to get the next page: with 10,000 parked rows an operator
// sees the total and a page, never a flood nor a silently cut list.
//
// more says whether rows follow the page (the listing asked for one row
// beyond it): the last page offered a "next page" that was empty.
func (c *cli) printPage(shown int, total, after int64, limit int, more bool, id func(int) int64) {
	if after == 0 && int64(shown) >= total || limit == 0 {
		// --limit 0 asks for the count alone (it said "none with an id above 0").
		return
	}
	if shown == 0 {
		c.printf("(none with an id above %d)\n", after)
		return
	}
	c.printf("showed %d (ids %d..%d)", shown, id(0), id(shown-1))
	if more {
		c.printf("; next page: --after %d", id(shown-1))
	} else {
		c.printf("; the last page")
	}
	c.printf("\n")
}

func (c *cli) printParked(rows []admin.ParkedEvent) {
	for _, r := range rows {
		parked := "unknown" // parked by a version without idem_outbox.parked_at
		if !r.ParkedAt.IsZero() {
			parked = r.ParkedAt.UTC().Format(time.RFC3339)
		}
		c.printf("id=%d topic=%s event_id=%s key=%s attempts=%d enqueued=%s parked=%s\n  last_error: %s\n", r.ID, escape([]byte(r.Topic)),
			escape([]byte(r.EventID)), escape(r.Key), r.Attempts, r.CreatedAt.UTC().Format(time.RFC3339), parked, escape([]byte(r.LastError)))
	}
}

func (c *cli) outboxRequeue(args []string) error {
	fs := flag.NewFlagSet("outbox requeue", flag.ContinueOnError)
	all := fs.Bool("all", false, "every parked row")
	id := fs.Int64("id", 0, "this outbox row")
	topic := fs.String("topic", "", "every parked row of this topic")
	yes := fs.Bool("yes", false, "do it (without: dry run)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if !*all && *id == 0 && *topic == "" {
		return usageError("say which rows: --all, --id N or --topic T")
	}
	if (*all && (*id != 0 || *topic != "")) || (*id != 0 && *topic != "") {
		return usageError("choose one of --all, --id N and --topic T")
	}
	if *id < 0 {
		return usageError("--id must be positive")
	}
	a, err := c.admin()
	if err != nil {
		return err
	}
	f := admin.OutboxFilter{ID: *id, Topic: *topic}
	if !*yes {
		// The count is the whole selection; the listing only its start.
		total, err := a.CountParkedEvents(c.ctx, f)
		if err != nil {
			return err
		}
		rows, err := a.ParkedEvents(c.ctx, f, dryRunShown)
		if err != nil {
			return err
		}
		if total == 0 && *id != 0 {
			return c.notParked(a, *id, "nothing would be requeued")
		}
		c.printf("dry run: would requeue %d parked row(s) (PARKED -> PENDING, attempts reset); run again with --yes\n", total)
		c.printParked(rows)
		if total > int64(len(rows)) {
			c.printf("… and %d more (outbox parked lists them all)\n", total-int64(len(rows)))
		}
		return nil
	}
	if *id != 0 {
		n, err := a.RequeueParked(c.ctx, f)
		if err != nil {
			return err
		}
		if n == 0 {
			return c.notParked(a, *id, "nothing done")
		}
		c.printf("requeued %d parked row(s)\n", n)
		return nil
	}
	// --all and --topic requeue in batches, each committed: one UPDATE of
	// millions of parked rows (a topic refused for an hour) ran past
	// IDEMCTL_TIMEOUT and rolled back entirely, every time.
	n, err := c.batches(func(ctx context.Context) (int64, bool, error) {
		n, last, err := a.RequeueParkedBatch(ctx, f, requeueBatch)
		f.After = max(f.After, last)
		return n, n == 0, err
	})
	if err != nil {
		c.printf("requeued %d parked row(s) before stopping on an error (run it again for the rest)\n", n)
		return err
	}
	c.printf("requeued %d parked row(s)\n", n)
	return nil
}

// notParked says why outbox row id was not requeued: it does not exist (a
// mistyped id, or a dead letter's: ids of the two tables are unrelated), or
// it is not parked (requeued already, or never parked). "requeued 0 parked
// row(s)" told neither. Exit 0, like a second run of any repair.
func (c *cli) notParked(a *admin.Admin, id int64, outcome string) error {
	st, err := a.OutboxRowStatus(c.ctx, id)
	if errors.Is(err, admin.ErrNotFound) {
		c.printf("outbox row %d does not exist (a dead letter's id is not an outbox row's; outbox parked lists them); %s\n", id, outcome)
		return nil
	}
	if err != nil {
		return err
	}
	c.printf("outbox row %d is %s, not PARKED; %s\n", id, st, outcome)
	return nil
}

// clientNow is the operator's machine's clock (a variable for the tests
// that skew it).
var clientNow = time.Now

// requeueBatch is how many parked rows each batch of a requeue returns to
// PENDING.
const requeueBatch = 1000

func (c *cli) outboxPurge(args []string) error {
	fs := flag.NewFlagSet("outbox purge", flag.ContinueOnError)
	published := fs.Bool("published", false, "delete PUBLISHED rows published before --older-than")
	parked := fs.Bool("parked", false, "delete PARKED rows parked before --older-than (their events are lost)")
	olderThan := fs.Duration("older-than", 0, "age, e.g. 24h")
	id := fs.Int64("id", 0, "with --parked: this parked row, whatever its age")
	yes := fs.Bool("yes", false, "do it (without: dry run)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if !*published && !*parked {
		return usageError("say what to purge: --published and/or --parked")
	}
	if *id != 0 {
		switch {
		case *id < 0:
			return usageError("--id must be positive")
		case *published || !*parked:
			return usageError("--id purges one parked row: use it with --parked alone")
		case *olderThan != 0:
			return usageError("choose one of --id N and --older-than DURATION")
		}
		a, err := c.admin()
		if err != nil {
			return err
		}
		return c.purgeParkedID(a, *id, *yes)
	}
	if *olderThan <= 0 {
		return usageError("--older-than must be a positive duration, e.g. 24h")
	}
	a, err := c.admin()
	if err != nil {
		return err
	}
	// The cutoff is the database's clock less the age: parked_at and
	// published_at are set by it, and the operator's machine may be hours
	// off (ahead by more than --older-than, it deleted rows parked just now).
	now, err := a.Now(c.ctx)
	if err != nil {
		return err
	}
	before := now.Add(-*olderThan)
	var statuses []string
	if *published {
		statuses = append(statuses, admin.StatusPublished)
	}
	if *parked {
		statuses = append(statuses, admin.StatusParked)
	}
	for _, s := range statuses {
		// Parked rows go by when they were parked (parked_at), not by when
		// they were enqueued: an event enqueued a week ago and parked a
		// minute ago is no week-old parked row.
		age := "older than " + olderThan.String()
		if s == admin.StatusParked {
			age = "parked more than " + olderThan.String() + " ago"
		}
		if !*yes {
			n, err := a.CountOutboxBefore(c.ctx, s, before)
			if err != nil {
				return err
			}
			c.printf("dry run: would delete %d %s row(s) %s; run again with --yes\n", n, s, age)
			continue
		}
		n, err := c.purge(a, s, before)
		if err != nil {
			// Committed batches stay: say how many, so a rerun is understood.
			c.printf("deleted %d %s row(s) %s before stopping on an error\n", n, s, age)
			return err
		}
		c.printf("deleted %d %s row(s) %s\n", n, s, age)
	}
	if !*parked {
		return nil
	}
	// A parked row without parked_at was parked by a version of the runtime
	// without the column before the upgrade added it (after it, the
	// idem_outbox_parked_at trigger dates an older replica's parking): how
	// long it has been parked is unknown, so no age selects
	// it. It is kept, and the operator told, so that its event is neither
	// lost unasked nor left unseen. A purge that kept rows did not do all
	// that was asked: exit 1 (refused), like any partial "no".
	unknown, err := a.CountParkedUnknownTime(c.ctx)
	if err != nil || unknown == 0 {
		return err
	}
	kept := fmt.Sprintf("%d parked row(s) with no parking time (parked by an older version of the runtime) were kept; "+
		"outbox parked lists them (parked=unknown): purge each with --parked --id N, or requeue them", unknown)
	if !*yes {
		c.printf("dry run: %s\n", strings.Replace(kept, "were kept", "would be kept", 1))
		return nil
	}
	return errRefused{errors.New(kept)}
}

// purgeParkedID deletes parked row id (with yes; else shows it): an
// operator's explicit choice, whatever its age or parking time.
func (c *cli) purgeParkedID(a *admin.Admin, id int64, yes bool) error {
	if !yes {
		rows, err := a.ParkedEvents(c.ctx, admin.OutboxFilter{ID: id}, 1)
		if err != nil {
			return err
		}
		if len(rows) == 0 {
			return c.notParked(a, id, "nothing would be deleted")
		}
		c.printf("dry run: would delete parked row %d (its event is lost); run again with --yes\n", id)
		c.printParked(rows)
		return nil
	}
	n, err := a.PurgeParked(c.ctx, id)
	if err != nil {
		return err
	}
	if n == 0 {
		return c.notParked(a, id, "nothing done")
	}
	c.printf("deleted parked row %d\n", id)
	return nil
}

// purgeBatch is how many rows each DELETE of a purge removes.
const purgeBatch = 1000

// purge deletes status rows older than before in batches (see batches).
// Under one deadline for the whole command, purging a few million rows gave
// up after a minute of batches answered in milliseconds, saying the
// database "did not answer in time".
func (c *cli) purge(a *admin.Admin, status string, before time.Time) (int64, error) {
	return c.batches(func(ctx context.Context) (int64, bool, error) {
		n, err := a.PurgeOutboxBatch(ctx, status, before, purgeBatch)
		return n, n < purgeBatch, err
	})
}

// batches runs batch until it says it is done, each call bounded by
// IDEMCTL_TIMEOUT on its own, and returns the rows all calls handled: a
// database that does not answer one batch in that time gives up, but work
// whose batches all answer is done however long it takes in all. SIGINT
// stops it between batches (and rolls back the one in flight); the rows of
// the batches before are returned with the error.
func (c *cli) batches(batch func(context.Context) (n int64, done bool, err error)) (int64, error) {
	var total int64
	for {
		if err := c.base.Err(); err != nil {
			return total, err
		}
		ctx, cancel := context.WithTimeout(c.base, c.timeout)
		n, done, err := batch(ctx)
		batchTimedOut := errors.Is(ctx.Err(), context.DeadlineExceeded)
		cancel()
		total += n
		if err != nil {
			if batchTimedOut {
				c.batchTimedOut, c.deadline = true, c.timeout
			}
			return total, err
		}
		if done {
			return total, nil
		}
	}
}

func (c *cli) deadLettersList(args []string) error {
	fs := flag.NewFlagSet("deadletters list", flag.ContinueOnError)
	context := fs.String("context", "", "only this consumer context")
	topic := fs.String("topic", "", "only this topic")
	all := fs.Bool("all", false, "include replayed dead letters (kept until retention)")
	limit := fs.Int("limit", 100, "list at most this many")
	after := fs.Int64("after", 0, "list dead letters with an id above this (the next page)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := pageFlags(*limit, *after); err != nil {
		return err
	}
	a, err := c.admin()
	if err != nil {
		return err
	}
	f := admin.DeadLetterFilter{Context: *context, Topic: *topic, IncludeReplayed: *all}
	total, err := a.CountDeadLetters(c.ctx, f)
	if err != nil {
		return err
	}
	f.After = *after
	rows, err := a.DeadLetters(c.ctx, f, peek(*limit))
	if err != nil {
		return err
	}
	more := len(rows) > *limit
	rows = rows[:min(len(rows), *limit)]
	c.printf("%d dead letter(s)\n", total)
	defer c.printPage(len(rows), total, *after, *limit, more, func(i int) int64 { return rows[i].ID })
	for _, d := range rows {
		c.printf("id=%d context=%s %s/%d@%d attempts=%d value_bytes=%d at=%s%s\n  last_error: %s\n", d.ID, escape([]byte(d.Context)),
			escape([]byte(d.Topic)), d.Partition, d.Offset, d.Attempts, d.ValueLen, d.CreatedAt.UTC().Format(time.RFC3339),
			replayed(d), escape([]byte(d.LastError)))
	}
	return nil
}

func idFlag(fs *flag.FlagSet) *int64 { return fs.Int64("id", 0, "the dead letter's id") }

func needID(id int64) error {
	if id <= 0 {
		return usageError("--id N is required")
	}
	return nil
}

func replayed(d admin.DeadLetter) string {
	if d.ReplayedAt.IsZero() {
		return ""
	}
	return " replayed=" + d.ReplayedAt.UTC().Format(time.RFC3339)
}

func (c *cli) printDeadLetter(d admin.DeadLetter) {
	field := c.field
	c.printf("id:         %d\ncontext:    %s\nrecord:     %s partition %d offset %d\nattempts:   %d\nat:         %s\nlast_error: %s\nkey:        %s\nvalue:      %s\n",
		d.ID, field([]byte(d.Context)), field([]byte(d.Topic)), d.Partition, d.Offset, d.Attempts,
		d.CreatedAt.UTC().Format(time.RFC3339)+replayed(d), field([]byte(d.LastError)), field(d.Key), field(d.Value))
	if !d.HeadersDamaged() {
		c.printf("headers:    %d\n", len(d.Headers))
	} else {
		// Only a row edited by hand has this: show what is there rather
		// than refuse the whole dead letter ("2 header names for 1 values").
		c.printf("headers:    %d names, %d values: DAMAGED, the stored header name and value arrays differ in length "+
			"(the runtime writes them in pairs: the row was edited); paired by position below, which may be misaligned, "+
			"then the unpaired rest; replay refuses this dead letter\n",
			len(d.Headers)+len(d.UnpairedHeaderKeys), len(d.Headers)+len(d.UnpairedHeaderValues))
	}
	total := len(d.Headers) + len(d.UnpairedHeaderKeys) + len(d.UnpairedHeaderValues)
	c.listHeaders(total, func(i int) {
		switch {
		case i < len(d.Headers):
			h := d.Headers[i]
			c.printf("  %s: %s\n", field([]byte(h.Key)), field(h.Value))
		case i < len(d.Headers)+len(d.UnpairedHeaderKeys):
			c.printf("  name without a value: %s\n", field([]byte(d.UnpairedHeaderKeys[i-len(d.Headers)])))
		default:
			c.printf("  value without a name: %s\n", field(d.UnpairedHeaderValues[i-len(d.Headers)-len(d.UnpairedHeaderKeys)]))
		}
	})
}

// maxHeadersShown is how many headers deadletters show and keys show print
// unless --full.
const maxHeadersShown = 100

// defaultMaxBytes is how many bytes of each field deadletters show and keys
// show print by default: a poison record of megabytes flooded the terminal.
const defaultMaxBytes = 4096

// boundFlags adds --max-bytes and --full to fs, for the commands that print
// a stored record or response (deadletters show, keys show), so that both
// take them alike. The function it returns, called once fs is parsed,
// checks them (usage errors) and sets c.maxBytes.
func (c *cli) boundFlags(fs *flag.FlagSet) func() error {
	maxBytes := fs.Int("max-bytes", defaultMaxBytes, "print at most this many bytes of each field (key, value or body, each header), noting its full size")
	full := fs.Bool("full", false, "print every field whole, and every header")
	return func() error {
		seen := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { seen[f.Name] = true })
		switch {
		case *full && seen["max-bytes"]:
			return usageError("choose one of --max-bytes N and --full")
		case *full:
			c.maxBytes = 0
		case *maxBytes <= 0:
			return usageError("--max-bytes must be positive (--full prints every field whole)")
		default:
			c.maxBytes = *maxBytes
		}
		return nil
	}
}

// field is b as escapeMax prints it under --max-bytes.
func (c *cli) field(b []byte) string { return escapeMax(b, c.maxBytes) }

// listHeaders prints header(i) for the first maxHeadersShown of total
// headers (all of them with --full), then how many it left out. Bounded in
// number too: each header cut at --max-bytes still printed a line of its
// own, and a record of 200,000 small headers printed 5 MB.
func (c *cli) listHeaders(total int, header func(i int)) {
	shown := total
	if c.maxBytes > 0 {
		shown = min(total, maxHeadersShown)
	}
	for i := range shown {
		header(i)
	}
	if shown < total {
		c.printf("  … and %d more (first %d of %d headers shown; --full shows all)\n", total-shown, shown, total)
	}
}

func (c *cli) deadLettersShow(args []string) error {
	fs := flag.NewFlagSet("deadletters show", flag.ContinueOnError)
	id := idFlag(fs)
	bound := c.boundFlags(fs)
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := needID(*id); err != nil {
		return err
	}
	if err := bound(); err != nil {
		return err
	}
	a, err := c.admin()
	if err != nil {
		return err
	}
	d, err := a.DeadLetter(c.ctx, *id)
	if err != nil {
		return err
	}
	c.printDeadLetter(d)
	return nil
}

func (c *cli) deadLettersDiscard(args []string) error {
	fs := flag.NewFlagSet("deadletters discard", flag.ContinueOnError)
	id := idFlag(fs)
	yes := fs.Bool("yes", false, "do it (without: dry run)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := needID(*id); err != nil {
		return err
	}
	a, err := c.admin()
	if err != nil {
		return err
	}
	if !*yes {
		d, err := a.DeadLetter(c.ctx, *id)
		if errors.Is(err, admin.ErrNotFound) {
			c.printf("dry run: dead letter %d does not exist; nothing to discard\n", *id)
			return nil
		}
		if err != nil {
			return err
		}
		c.printf("dry run: would delete dead letter %d (%s partition %d offset %d); its record is then lost; run again with --yes\n",
			d.ID, escape([]byte(d.Topic)), d.Partition, d.Offset)
		return nil
	}
	found, err := a.DiscardDeadLetter(c.ctx, *id)
	if err != nil {
		return err
	}
	if !found {
		c.printf("dead letter %d does not exist (already discarded or replayed); nothing done\n", *id)
		return nil
	}
	c.printf("discarded dead letter %d\n", *id)
	return nil
}

func (c *cli) deadLettersReplay(args []string) error {
	fs := flag.NewFlagSet("deadletters replay", flag.ContinueOnError)
	id := idFlag(fs)
	yes := fs.Bool("yes", false, "do it (without: dry run)")
	timeout := fs.Duration("timeout", 30*time.Second, "how long to wait for the broker's ack")
	force := fs.Bool("force", false, "replay a dead letter whose other contexts' processed-event rows may be deleted (they apply it again)")
	age := fs.Duration("processed-event-age", idem.DefaultProcessedEventAge, "the service janitor's ProcessedEventAge")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *age <= 0 {
		return usageError("--processed-event-age must be a positive duration (the janitor's ProcessedEventAge; a janitor that keeps them: --force)")
	}
	c.processedAge = *age
	if err := needID(*id); err != nil {
		return err
	}
	if *timeout <= 0 {
		return usageError("--timeout must be a positive duration")
	}
	c.extra = *timeout // the broker's ack is waited for inside the command's deadline
	a, err := c.admin()
	if err != nil {
		return err
	}
	if !*yes {
		d, err := a.DeadLetter(c.ctx, *id)
		if errors.Is(err, admin.ErrNotFound) {
			c.printf("dry run: dead letter %d does not exist; nothing to replay\n", *id)
			return nil
		}
		if err != nil {
			return err
		}
		if !d.ReplayedAt.IsZero() {
			c.printf("dry run: dead letter %d was replayed already (%s); nothing to replay\n", d.ID, d.ReplayedAt.UTC().Format(time.RFC3339))
			return nil
		}
		if d.HeadersDamaged() {
			c.printf("dry run: would refuse to replay dead letter %d: %v (deadletters show --id %d shows them); discard it or repair the row\n",
				d.ID, admin.ErrUnpairedHeaders, d.ID)
			return nil
		}
		if err := c.forgotten(a, d); err != nil {
			if !*force {
				c.printf("dry run: would refuse to replay dead letter %d without --force:\n  %v\n", d.ID, err)
				return nil
			}
			c.printf("warning (--force): %v\n", err)
		}
		c.printf("dry run: would produce dead letter %d again to topic %s (key %s, %d header(s), %d value bytes), then mark it replayed; run again with --yes\n",
			d.ID, escape([]byte(d.Topic)), escape(d.Key), len(d.Headers), len(d.Value))
		return nil
	}
	if !*force {
		d, err := a.DeadLetter(c.ctx, *id)
		switch {
		case errors.Is(err, admin.ErrNotFound):
			// ReplayDeadLetter says "nothing done".
		case err != nil:
			return err
		case d.ReplayedAt.IsZero():
			if err := c.forgotten(a, d); err != nil {
				return errRefused{fmt.Errorf("%w; nothing done", err)}
			}
		}
	}
	brokers, err := seedBrokers(os.Getenv("KAFKA_BROKERS"))
	if err != nil {
		return err
	}
	// AllowIdempotentProduceCancellation: kgo's idempotent producer would
	// otherwise not fail a record whose produce request it sent when its
	// context ends (it cannot know whether the broker wrote it), and a
	// broker gone silent after the request would hang the replay forever
	// with the dead letter's row locked. Giving up is safe here: the mark
	// rolls back, and if the broker did write the record, a second replay
	// produces a copy that consumers drop by its event id.
	//
	// The client retries a broker it cannot reach until the timeout, and
	// says only "context deadline exceeded": the last connection error is
	// kept to say why there was no ack (refused, unknown host, TLS).
	var dialErr lastDialError
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ProducerLinger(0),
		kgo.AllowIdempotentProduceCancellation(), kgo.WithHooks(&dialErr))
	if err != nil {
		return fmt.Errorf("kafka client: %w", err)
	}
	defer cl.Close()
	var sent bool // the produce request may have reached the broker
	produce := func(ctx context.Context, d admin.DeadLetter) error {
		sent = true
		rec := &kgo.Record{Topic: d.Topic, Key: d.Key, Value: d.Value}
		for _, h := range d.Headers {
			rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: h.Key, Value: h.Value})
		}
		// ProduceSync returns once the broker acked (acks=all by default).
		pctx, cancel := context.WithTimeout(ctx, *timeout)
		defer cancel()
		r, err := cl.ProduceSync(pctx, rec).First()
		if err != nil {
			return err
		}
		// Said before the mark's commit, which may not end the way the
		// operator sees (a second Ctrl-C ends idemctl at once, and so
		// does a kill): the record is out whatever happens next, and an
		// operator who is not told so replays it again.
		c.printf("dead letter %[1]d: record produced to %[2]s partition %[3]d offset %[4]d (the broker acked); marking it replayed "+
			"(if this does not end in \"replayed dead letter %[1]d\", the record is out all the same: do not replay it again, "+
			"see deadletters show --id %[1]d)\n", *id, escape([]byte(r.Topic)), r.Partition, r.Offset)
		return nil
	}
	c.notMarkedAdvice = fmt.Sprintf("idemctl: dead letter %[1]d may still look unreplayed, but its record is in the topic: do not replay it again "+
		"to retry the mark, which produces the record a second time (consumers skip that copy by its event id only while they keep "+
		"its processed-event row, see --processed-event-age). Check `idemctl deadletters show --id %[1]d`: if it says replayed=, the "+
		"mark did commit; if not, once the consumers have applied the record, `idemctl deadletters discard --id %[1]d --yes` "+
		"takes the dead letter off the list\n", *id)
	found, err := a.ReplayDeadLetter(c.ctx, *id, produce)
	if errors.Is(err, admin.ErrUnpairedHeaders) {
		return errRefused{fmt.Errorf("%w (deadletters show --id %d shows them); discard it or repair the row", err, *id)}
	}
	if err != nil && sent && errors.Is(err, context.Canceled) && c.base.Err() != nil && !errors.Is(err, admin.ErrProducedNotMarked) {
		// Interrupted while waiting for the ack: it said only "context
		// canceled", of a record the broker may well have written (with
		// acks=all the leader writes it before the replicas have it).
		return fmt.Errorf("interrupted before the broker acked: dead letter %d stays unreplayed, but the broker may have written its record all the same "+
			"(a second replay produces another copy, which consumers skip by its event id only while they keep its processed-event row): %w", *id, err)
	}
	if err != nil && errors.Is(err, context.DeadlineExceeded) && !c.timedOut() && !errors.Is(err, admin.ErrProducedNotMarked) {
		if derr := dialErr.get(); derr != nil {
			return fmt.Errorf("no ack from KAFKA_BROKERS within --timeout %v (last connection error: %v); dead letter %d stays unreplayed: %w", *timeout, derr, *id, err)
		}
		return fmt.Errorf("no ack from KAFKA_BROKERS within --timeout %v; dead letter %d stays unreplayed: %w", *timeout, *id, err)
	}
	if err != nil {
		return err
	}
	if !found {
		c.printf("dead letter %d does not exist or was replayed already; nothing done\n", *id)
		return nil
	}
	c.printf("replayed dead letter %d: produced and acked, then marked replayed\n", *id)
	return nil
}

// seedBrokers splits KAFKA_BROKERS: "host:port,host:port", spaces around
// the commas allowed. kgo takes each entry verbatim, so " b:9092" (after
// "a:9092, ") was a host name with a leading space that never resolved,
// and an empty entry (a trailing comma) dialed localhost:9092.
func seedBrokers(v string) ([]string, error) {
	if strings.TrimSpace(v) == "" {
		return nil, usageError("replay produces to Kafka: set KAFKA_BROKERS")
	}
	var seeds []string
	for _, s := range strings.Split(v, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			return nil, usageError(fmt.Sprintf("KAFKA_BROKERS=%q has an empty broker address; want host:port[,host:port...]", v))
		}
		seeds = append(seeds, s)
	}
	return seeds, nil
}

// lastDialError is a kgo hook that keeps the last failed broker connection.
type lastDialError struct {
	mu  sync.Mutex
	err error
}

// OnBrokerConnect implements kgo.HookBrokerConnect.
func (h *lastDialError) OnBrokerConnect(_ kgo.BrokerMetadata, _ time.Duration, _ net.Conn, err error) {
	if err != nil {
		h.mu.Lock()
		h.err = err
		h.mu.Unlock()
	}
}

func (h *lastDialError) get() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.err
}

// replayMargin is how much earlier than its dead letter other contexts may
// have applied a record (the failed context retried, or lagged behind the
// others) and still be trusted to remember it.
const replayMargin = 24 * time.Hour

// forgotten returns an error if the other contexts consuming d's topic may
// have forgotten applying it. Replay re-produces the record to its topic,
// and every context consuming it receives it again: one whose
// processed-event row for it the janitor deleted (ProcessedEventAge, 7 days
// by default, while dead letters are kept 30) applies it a second time (a
// second ledger entry, a second charge). It is so if d (less replayMargin)
// is older than the janitor's horizon (now - --processed-event-age), unless
// rows that old are still there (the janitor is off or behind). The
// in-place replay, Processor.ReplayDeadLetter in the service, runs only the
// failed context.
func (c *cli) forgotten(a *admin.Admin, d admin.DeadLetter) error {
	applied := d.CreatedAt.Add(-replayMargin)
	if applied.After(clientNow().Add(-c.processedAge)) {
		return nil
	}
	since, ok, err := a.ProcessedEventsKeptSince(c.ctx)
	if err != nil {
		return err
	}
	if ok && !since.After(applied) {
		return nil // rows from before it are kept: so are the others' rows for it
	}
	kept := "no processed-event rows are kept at all"
	if ok {
		kept = "processed-event rows are kept only since " + since.UTC().Format(time.RFC3339)
	}
	return fmt.Errorf("dead letter %d is from %s, and %s (the janitor's ProcessedEventAge, --processed-event-age %v): a context other than %s "+
		"that applied this event then no longer knows it did, and would apply it again when it is produced to %s once more; replay it in the "+
		"service with Processor.ReplayDeadLetter (only context %s runs), or pass --force if no other context consumes the topic or applying it twice is harmless",
		d.ID, d.CreatedAt.UTC().Format(time.RFC3339), kept, c.processedAge, escape([]byte(d.Context)), escape([]byte(d.Topic)), escape([]byte(d.Context)))
}

func keyFlags(fs *flag.FlagSet) *admin.KeyRef {
	var k admin.KeyRef
	fs.StringVar(&k.Scope, "scope", "", "the endpoint's scope (see the generated Endpoint.Scope)")
	fs.StringVar(&k.Principal, "principal", "", "the caller (tenant, API key) as the service's Principal function returns it; \"\" for services with one principal")
	fs.StringVar(&k.Key, "key", "", "the Idempotency-Key")
	return &k
}

func needKey(fs *flag.FlagSet, k *admin.KeyRef) error {
	seen := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { seen[f.Name] = true })
	if k.Scope == "" || k.Key == "" || !seen["principal"] {
		return usageError("--scope, --principal and --key are required (keys are scoped per principal; pass --principal '' for none)")
	}
	return nil
}

func (c *cli) printKey(k admin.KeyInfo) {
	field := func(s string) string { return c.field([]byte(s)) }
	state := "completed (replayed to retries until it expires)"
	if k.Expired {
		state = "expired (the next request with it runs anew)"
	}
	principal := field(k.Principal)
	if k.StoredPrincipal != k.Principal {
		principal += " (stored as " + field(k.StoredPrincipal) + ")"
	}
	c.printf("scope:       %s\nprincipal:   %s\nkey:         %s\nstate:       %s\nstatus:      %d\ncreated:     %s\nexpires:     %s\nfingerprint: %x\nbody:        %s\n",
		field(k.Scope), principal, field(k.Key), state, k.StatusCode,
		k.CreatedAt.UTC().Format(time.RFC3339), k.ExpiresAt.UTC().Format(time.RFC3339), k.Fingerprint, c.field(k.Body))
	// The stored headers are JSON, {"Name": ["value", ...]}, decoded as the
	// runtime decodes them to replay them, and listed one line per value,
	// as they are sent, in name order (as net/http writes them).
	var header map[string][]string
	if err := json.Unmarshal(k.Headers, &header); err != nil {
		// Only a row edited by hand has this; the runtime cannot replay it.
		c.printf("headers:     %s (not the runtime's form, a JSON object of names to lists of values: %v)\n", c.field(k.Headers), err)
		return
	}
	type line struct{ name, value string }
	var lines []line
	for _, name := range slices.Sorted(maps.Keys(header)) {
		for _, v := range header[name] {
			lines = append(lines, line{name, v})
		}
	}
	c.printf("headers:     %d\n", len(lines))
	c.listHeaders(len(lines), func(i int) {
		c.printf("  %s: %s\n", field(lines[i].name), field(lines[i].value))
	})
}

func (c *cli) keysShow(args []string) error {
	fs := flag.NewFlagSet("keys show", flag.ContinueOnError)
	k := keyFlags(fs)
	bound := c.boundFlags(fs)
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := needKey(fs, k); err != nil {
		return err
	}
	if err := bound(); err != nil {
		return err
	}
	a, err := c.admin()
	if err != nil {
		return err
	}
	info, err := a.Key(c.ctx, *k)
	if err != nil {
		return err
	}
	c.printKey(info)
	return nil
}

func (c *cli) keysRelease(args []string) error {
	fs := flag.NewFlagSet("keys release", flag.ContinueOnError)
	k := keyFlags(fs)
	yes := fs.Bool("yes", false, "do it (without: dry run)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := needKey(fs, k); err != nil {
		return err
	}
	a, err := c.admin()
	if err != nil {
		return err
	}
	if !*yes {
		info, err := a.Key(c.ctx, *k)
		if errors.Is(err, admin.ErrNotFound) {
			c.printf("dry run: no stored key %s; nothing to release\n", k)
			return nil
		}
		if err != nil {
			return err
		}
		what := "a completed key: its stored response is dropped and the next request with it runs the handler again"
		if info.Expired {
			what = "an expired key"
		}
		c.printf("dry run: would release %s, %s; run again with --yes\n", k, what)
		return nil
	}
	err = a.ReleaseKey(c.ctx, *k)
	if errors.Is(err, admin.ErrNotFound) {
		c.printf("no stored key %s; nothing to release\n", k)
		return nil
	}
	if err != nil {
		return err
	}
	c.printf("released %s\n", k)
	return nil
}

// escapeMax is escape of at most limit bytes of b (0: all of it), noting the
// full size when it cut: "…" (first 4096 of 5242880 bytes; --full shows
// all). Valid UTF-8 is cut at a rune boundary and stays Go-quoted; anything
// else is hex of its first limit bytes.
func escapeMax(b []byte, limit int) string {
	if limit <= 0 || len(b) <= limit {
		return escape(b)
	}
	cut := b[:limit]
	if utf8.Valid(b) {
		n := limit
		for n > 0 && !utf8.RuneStart(b[n]) {
			n--
		}
		cut = b[:n]
		return fmt.Sprintf("%s (first %d of %d bytes; --full shows all)", strconv.Quote(string(cut)), len(cut), len(b))
	}
	return fmt.Sprintf("hex:%x (first %d of %d bytes; --full shows all)", cut, len(cut), len(b))
}

// escape renders bytes for a terminal: valid UTF-8 as a Go-quoted string
// (control characters, escape sequences and invisible format characters
// such as bidi overrides become \x.. or \u.... escapes), anything else as
// hex. Nothing read from the database reaches the terminal raw.
func escape(b []byte) string {
	if b == nil {
		return "<null>"
	}
	if utf8.Valid(b) {
		return strconv.Quote(string(b))
	}
	return fmt.Sprintf("hex:%x", b)
}
