package directive

import (
	"context"

	"github.com/jackc/pgx/v5"
)

/*// want `//idem:http in a test file: idemgen never reads _test.go files, so nothing is generated for it` */ //idem:http route="POST /test"
func HelperInTest(ctx context.Context, tx pgx.Tx, req Req) (Resp, error) { return Resp{}, nil }
