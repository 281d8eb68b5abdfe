package dbx

import (
	"strings"
	"testing"

	"github.com/idemgen/idemgen/runtime/internal/db"
)

// The session guard (put back the settings saved in idem.session, refuse a
// temporary table hiding a runtime table) is written out in each statement
// sent before a runtime COMMIT, and the snapshot it compares with in each
// statement that saves it: the statements must not call a function of the
// runtime's schema, which a function's search_path could hide. The behaviour
// is tested on a few of these paths (runtime/idem session tests); this keeps
// every copy the same as the one RestoreSession runs, so a copy edited alone
// cannot drift.
func TestSessionGuardCopiesAgree(t *testing.T) {
	norm := func(s string) string { return strings.Join(strings.Fields(s), " ") }
	between := func(name, s, from, to string) string {
		s = norm(s)
		i := strings.Index(s, from)
		if i < 0 {
			t.Fatalf("%s: no %q", name, from)
		}
		j := strings.Index(s[i:], to)
		if j < 0 {
			t.Fatalf("%s: no %q after %q", name, to, from)
		}
		return s[i : i+j+len(to)]
	}
	const guardFrom = "WHEN CASE WHEN coalesce(current_setting('idem.session', true), '')"
	const guardTo = "'idem: a temporary table hides a table of the runtime' AS boolean)"
	guard := between("RestoreSession", db.RestoreSession, guardFrom, guardTo)
	for name, q := range map[string]string{"StoreKey": db.StoreKey, "StoreNewKey": db.StoreNewKey, "CheckOwnTransaction": db.CheckOwnTransaction} {
		if got := between(name, q, guardFrom, guardTo); got != guard {
			t.Errorf("%s's session guard differs from RestoreSession's:\n%s\nwant\n%s", name, got, guard)
		}
	}
	const snapFrom = "concat_ws(chr(31), current_setting('search_path')"
	const snapTo = "current_setting('role'))"
	snap := between("RestoreSession", db.RestoreSession, snapFrom, snapTo)
	for i, want := range []string{"search_path", "default_transaction_read_only", "default_transaction_isolation",
		"statement_timeout", "synchronous_commit", "session_replication_role", "role"} {
		// The i+1-th field of the snapshot is the one put back from split_part(…, i+1).
		put := "WHEN current_setting('" + want + "') <> split_part(current_setting('idem.session'), chr(31), " +
			string(rune('1'+i)) + ") THEN set_config('" + want + "', split_part(current_setting('idem.session'), chr(31), " + string(rune('1'+i)) + "), false)"
		if !strings.Contains(guard, put) {
			t.Errorf("the guard does not put back %s from field %d: no %q", want, i+1, put)
		}
		if !strings.Contains(snap, "current_setting('"+want+"')") {
			t.Errorf("the snapshot has no %s", want)
		}
	}
	for name, q := range map[string]string{"SetTxSettings": db.SetTxSettings, "InsertProcessedEvent": db.InsertProcessedEvent, "InsertProcessedEvents": db.InsertProcessedEvents} {
		if got := between(name, q, "set_config('idem.session', "+snapFrom, snapTo); got != "set_config('idem.session', "+snap {
			t.Errorf("%s saves another snapshot:\n%s\nwant\n%s", name, got, snap)
		}
	}
}
