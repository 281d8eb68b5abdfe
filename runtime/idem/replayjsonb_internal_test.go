package idem

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/internal/db"
)

// The stored headers come back from idem_keys.headers, a jsonb column, in
// PostgreSQL's jsonb text form ({"Content-Type": ["application/json"]}, a
// space after the colon), not as run wrote them: replay's shortcut for the
// usual headers must recognise that form, or it is never taken (every
// replay decodes the headers with json.Unmarshal, by reflection).
func TestReplayJSONOnlyHeadersFromJSONB(t *testing.T) {
	pool, err := pgxpool.New(context.Background(), pgtest.BaseURL())
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var stored []byte
	if err := pool.QueryRow(context.Background(), `SELECT CAST($1::text AS jsonb)`, jsonOnlyHeaders).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	row := db.GetKeyRow{Fingerprint: []byte{1}, StatusCode: 201, Headers: stored, Body: []byte("{}")}
	in := &request{fingerprint: []byte{1}}
	out, err := replay(t.Context(), row, in)
	if err != nil || len(out.header) != 1 || len(out.header["Content-Type"]) != 1 || out.header["Content-Type"][0] != "application/json" {
		t.Fatalf("replay of %q: %+v, %v", stored, out, err)
	}
	// The shortcut, as for the form run writes (jsonOnlyHeaders): no more
	// allocations than that; json.Unmarshal into an http.Header takes more
	// than twice as many.
	compact := row
	compact.Headers = []byte(jsonOnlyHeaders)
	want := testing.AllocsPerRun(100, func() { _, _ = replay(context.Background(), compact, in) })
	if n := testing.AllocsPerRun(100, func() { _, _ = replay(context.Background(), row, in) }); n > want {
		t.Errorf("replay of the jsonb form %q: %v allocations, %v for %s (the shortcut not taken)", stored, n, want, jsonOnlyHeaders)
	}
}
