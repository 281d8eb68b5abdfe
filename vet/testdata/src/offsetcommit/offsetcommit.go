package offsetcommit

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"
)

func apply(ctx context.Context, tx pgx.Tx, r *kgo.Record) error { return nil }

func seen(ctx context.Context, tx pgx.Tx, r *kgo.Record) (bool, error) { return false, nil }

// Offset before commit: the seed's mistake.
func offsetFirst(ctx context.Context, cl *kgo.Client, pool *pgxpool.Pool, r *kgo.Record) error { // want offsetFirst:"commitsTx"
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	if err := apply(ctx, tx, r); err != nil {
		return err
	}
	if err := cl.CommitRecords(ctx, r); err != nil { // want `Kafka offset commit \(CommitRecords\) runs before the transaction's commit at line 28: if the process dies or the commit fails in between, the event counts as consumed but its writes are lost \(lost event\)`
		return err
	}
	return tx.Commit(ctx)
}

// In a poll loop, marking then committing the transaction.
func loopMarkFirst(ctx context.Context, cl *kgo.Client, pool *pgxpool.Pool) error { // want loopMarkFirst:"commitsTx"
	for {
		fetches := cl.PollFetches(ctx)
		for _, r := range fetches.Records() {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return err
			}
			cl.MarkCommitRecords(r) // want `Kafka offset mark \(MarkCommitRecords\) runs before the transaction's commit`
			if err := apply(ctx, tx, r); err != nil {
				tx.Rollback(ctx)
				return err
			}
			if err := tx.Commit(ctx); err != nil {
				return err
			}
		}
	}
}

// pgx.BeginFunc commits when it returns.
func beginFunc(ctx context.Context, cl *kgo.Client, pool *pgxpool.Pool, r *kgo.Record) error { // want beginFunc:"commitsTx"
	if err := cl.CommitUncommittedOffsets(ctx); err != nil { // want `Kafka offset commit \(CommitUncommittedOffsets\) runs before`
		return err
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return apply(ctx, tx, r) })
}

// True negatives.

// Commit, then offset: the seed's correct order, round a poll loop.
func commitThenOffset(ctx context.Context, cl *kgo.Client, pool *pgxpool.Pool) error { // want commitThenOffset:"commitsTx"
	for {
		fetches := cl.PollFetches(ctx)
		for _, r := range fetches.Records() {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return err
			}
			// Already processed: acknowledge and skip. This path returns
			// to the next record without committing anything.
			if dup, err := seen(ctx, tx, r); err != nil {
				tx.Rollback(ctx)
				return err
			} else if dup {
				tx.Rollback(ctx)
				cl.MarkCommitRecords(r)
				continue
			}
			if err := apply(ctx, tx, r); err != nil {
				tx.Rollback(ctx)
				return err
			}
			if err := tx.Commit(ctx); err != nil {
				return err
			}
			cl.MarkCommitRecords(r)
		}
		if err := cl.CommitMarkedOffsets(ctx); err != nil {
			return err
		}
	}
}

// The early-exit branch returns before the commit.
func earlyExit(ctx context.Context, cl *kgo.Client, tx pgx.Tx, r *kgo.Record) error { // want earlyExit:"commitsTx"
	dup, err := seen(ctx, tx, r)
	if err != nil {
		return err
	}
	if dup {
		return cl.CommitRecords(ctx, r)
	}
	if err := apply(ctx, tx, r); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	return cl.CommitRecords(ctx, r)
}

// Silenced deliberately.
func ignored(ctx context.Context, cl *kgo.Client, tx pgx.Tx, r *kgo.Record) error { // want ignored:"commitsTx"
	cl.MarkCommitRecords(r) //idemvet:ignore offsetcommit the table is an at-most-once cache
	return tx.Commit(ctx)
}
