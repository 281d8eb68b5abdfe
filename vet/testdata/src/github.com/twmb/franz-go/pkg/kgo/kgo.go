// Package kgo is a minimal stub of github.com/twmb/franz-go/pkg/kgo for the analyzers' tests.
package kgo

import "context"

type Record struct {
	Topic     string
	Partition int32
	Offset    int64
	Value     []byte
}

type Fetches []Record

func (f Fetches) Records() []*Record { return nil }

type Client struct{}

func (c *Client) PollFetches(ctx context.Context) Fetches                { return nil }
func (c *Client) CommitRecords(ctx context.Context, rs ...*Record) error { return nil }
func (c *Client) CommitUncommittedOffsets(ctx context.Context) error     { return nil }
func (c *Client) CommitMarkedOffsets(ctx context.Context) error          { return nil }
func (c *Client) MarkCommitRecords(rs ...*Record)                        {}
func (c *Client) MarkCommitOffsets(m map[string]map[int32]int64)         {}
