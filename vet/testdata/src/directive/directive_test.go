package directive

import (
	"context"

	"github.com/jackc/pgx/v5"
)

/*// want `//idem:http in a _test.go file is ignored: idemgen generates only from the package's non-test files` */ //idem:http route="POST /test"
func HelperInTest(ctx context.Context, tx pgx.Tx, req Req) (Resp, error)                                           { return Resp{}, nil }
