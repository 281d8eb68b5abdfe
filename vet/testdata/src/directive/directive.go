package directive

import (
	"context"

	"github.com/jackc/pgx/v5"
)

type Req struct{ ID string }
type Resp struct{ ID string }

// Charge is annotated correctly: nothing to report.
//
//idem:http route="POST /charges" status=201
func Charge(ctx context.Context, tx pgx.Tx, req Req) (Resp, error) { return Resp{}, nil }

//idem:http route="POST /refunds" // want `//idem:http is not attached to a declaration: put it on the line directly above the func or type \(no blank line\)`

func Refund(ctx context.Context, tx pgx.Tx, req Req) (Resp, error) { return Resp{}, nil }

//idem:htpp route="POST /captures" // want `unknown directive //idem:htpp; did you mean "http"\?`
func Capture(ctx context.Context, tx pgx.Tx, req Req) (Resp, error) { return Resp{}, nil }

/*// want `unknown option "stauts" for //idem:http; did you mean "status"\?` */ //idem:http route="POST /voids" stauts=201
func Void(ctx context.Context, tx pgx.Tx, req Req) (Resp, error)                { return Resp{}, nil }

// idem:http route="POST /holds" // want `idemgen directives have no space after //: write //idem:http`
func Hold(ctx context.Context, tx pgx.Tx, req Req) (Resp, error) { return Resp{}, nil }

//idem:consume topic=orders
func Wrong(ctx context.Context, ev Req) error { return nil } // want `//idem:consume cannot wrap Wrong: it takes 2 parameters, want 3`

/*// want `//idemvet:ignore retrykey needs a reason` */ //idemvet:ignore retrykey
var _ = 1

//idemvet:ignore retry-key because // want `"retry-key" is not a check, so it silences nothing`
var _ = 2
