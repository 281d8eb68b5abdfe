// Service-shaped offset handling found by review (vetfix): each EXPECT is a
// finding, each NOEXPECT a pattern that must stay silent.
package offsetcommitservice

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"offsetstore"
)

func apply(ctx context.Context, tx pgx.Tx, r *kgo.Record) error { return nil }

// O1 EXPECT: deferred mark runs also when the commit fails.
func o1(ctx context.Context, cl *kgo.Client, pool *pgxpool.Pool, r *kgo.Record) error { // want o1:"commitsTx"
	defer cl.MarkCommitRecords(r) // want `deferred Kafka offset mark \(MarkCommitRecords\) runs on every return, also when the transaction's commit fails`
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	if err := apply(ctx, tx, r); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// O2 EXPECT: offset in goroutine before commit.
func o2(ctx context.Context, cl *kgo.Client, pool *pgxpool.Pool, r *kgo.Record) error { // want o2:"commitsTx"
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	go func() { cl.CommitRecords(ctx, r) }() // want `Kafka offset commit \(CommitRecords\) runs before the transaction's commit at line 42`
	if err := apply(ctx, tx, r); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// O3 NOEXPECT: after BeginFunc.
func o3(ctx context.Context, cl *kgo.Client, pool *pgxpool.Pool, r *kgo.Record) error { // want o3:"commitsTx"
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return apply(ctx, tx, r) }); err != nil {
		return err
	}
	return cl.CommitRecords(ctx, r)
}

func store(ctx context.Context, pool *pgxpool.Pool, r *kgo.Record) error { // want store:"commitsTx"
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	if err := apply(ctx, tx, r); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// O4 EXPECT: tx commit in a helper, offset first.
func o4(ctx context.Context, cl *kgo.Client, pool *pgxpool.Pool, r *kgo.Record) error { // want o4:"commitsTx"
	if err := cl.CommitRecords(ctx, r); err != nil { // want `Kafka offset commit \(CommitRecords\) runs before the transaction's commit \(in store\) at line 70`
		return err
	}
	return store(ctx, pool, r)
}

// O5 NOEXPECT: helper first.
func o5(ctx context.Context, cl *kgo.Client, pool *pgxpool.Pool, r *kgo.Record) error { // want o5:"commitsTx"
	if err := store(ctx, pool, r); err != nil {
		return err
	}
	return cl.CommitRecords(ctx, r)
}

// O6 NOEXPECT: deferred closure that marks only on success.
func o6(ctx context.Context, cl *kgo.Client, pool *pgxpool.Pool, r *kgo.Record) (err error) { // want o6:"commitsTx"
	defer func() {
		if err == nil {
			cl.MarkCommitRecords(r)
		}
	}()
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	if err = apply(ctx, tx, r); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// O7 EXPECT: BeginFunc error dropped, then offset.
func o7(ctx context.Context, cl *kgo.Client, pool *pgxpool.Pool, r *kgo.Record) error { // want o7:"commitsTx"
	pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return apply(ctx, tx, r) }) // want `error of BeginFunc, which commits a transaction, is dropped before the Kafka offset commit \(CommitRecords\) at line 102: if the commit fails the offset still acknowledges the event`
	return cl.CommitRecords(ctx, r)
}

// O8 EXPECT: the helper that commits is in another package.
func o8(ctx context.Context, cl *kgo.Client, st *offsetstore.Store, r *kgo.Record) error { // want o8:"commitsTx"
	cl.MarkCommitRecords(r) // want `Kafka offset mark \(MarkCommitRecords\) runs before the transaction's commit \(in Save\)`
	return st.Save(ctx, string(r.Value))
}

// O9 NOEXPECT: the other package's helper first.
func o9(ctx context.Context, cl *kgo.Client, st *offsetstore.Store, r *kgo.Record) error { // want o9:"commitsTx"
	if err := st.Save(ctx, string(r.Value)); err != nil {
		return err
	}
	cl.MarkCommitRecords(r)
	return nil
}

// O10 NOEXPECT: a deferred offset commit in a function that commits nothing.
func o10(ctx context.Context, cl *kgo.Client, r *kgo.Record) error {
	defer cl.MarkCommitRecords(r)
	return nil
}

// O11 EXPECT: the helper's error dropped, then the offset.
func o11(ctx context.Context, cl *kgo.Client, pool *pgxpool.Pool, r *kgo.Record) { // want o11:"commitsTx"
	_ = store(ctx, pool, r) // want `error of store, which commits a transaction, is dropped before the Kafka offset mark`
	cl.MarkCommitRecords(r)
}

// O12 NOEXPECT: a dropped tx.Commit error is swallowcancel's finding, not
// reported twice.
func o12(ctx context.Context, cl *kgo.Client, tx pgx.Tx, r *kgo.Record) { // want o12:"commitsTx"
	tx.Commit(ctx)
	cl.MarkCommitRecords(r)
}
