// Package templates holds the SQL that idemgen's runtime relies on. The same
// files are the input of sqlc (see sqlc.yaml at the module root), the output of
// `idemgen schema`, and what idem.Migrate applies, so all three always agree.
package templates

import _ "embed"

// Schema is the DDL for every table idemgen uses. Each statement is idempotent.
//
//go:embed schema.sql
var Schema string
