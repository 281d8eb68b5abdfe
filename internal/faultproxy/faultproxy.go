// Package faultproxy is a TCP proxy for tests that injects network faults
// between a client and a real server: cut connections, a server that is down,
// a network partition (blackhole), and added latency.
//
// Put a Proxy in front of PostgreSQL with New(t, PostgresTarget(url)) and
// connect to p.RewriteURL(url) instead of url.
//
// Kafka needs more than a proxy in front of the seed broker: clients learn
// broker addresses from metadata and would connect to the brokers directly
// afterwards, bypassing the proxy. KafkaCluster solves this with kfake's
// ListenFn option: each broker really listens on its own port, but the
// listener kfake gets reports the address of a Proxy in front of it, and kfake
// advertises exactly that address (in ListenAddrs, Metadata, FindCoordinator,
// ...). So every connection a client makes goes through a proxy, and faults on
// the proxies are faults of the brokers.
//
// A kgo producer with default options ignores its context while a broker is
// down or partitioned: being idempotent, it will not fail a record whose
// produce request it attempted (even one that wrote zero bytes into a cut
// connection), since it cannot know whether the broker got it, and waits for
// the broker to come back instead. Tests that expect a produce to fail by its
// deadline need kgo.AllowIdempotentProduceCancellation or
// kgo.DisableIdempotentWrite.
package faultproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Proxy forwards TCP connections from a local listener (127.0.0.1:0) to a
// target address, injecting faults on demand. Its methods are safe for
// concurrent use.
type Proxy struct {
	target string
	ln     net.Listener

	// mode and latency are read for every chunk forwarded, so they are
	// atomics; mode is only written with mu held so that a connection is
	// accepted either before or after a mode change, never during one.
	mode    atomic.Int32
	latency atomic.Int64
	precise atomic.Bool // latency is held with holdFor, not a timer (PreciseLatency)
	// replies is nil while the target's bytes flow to clients; under
	// HoldReplies, a channel ReleaseReplies closes.
	replies atomic.Pointer[chan struct{}]

	mu     sync.Mutex
	conns  map[*conn]struct{}
	closed bool

	closeOnce sync.Once
	closeErr  error
	wg        sync.WaitGroup // the accept loop and every connection's goroutines
}

const (
	modeNormal int32 = iota
	modeDown
	modeBlackhole
)

// dialTimeout bounds connecting to the target, so that a target that does not
// answer cannot hold a connection (and Close) forever.
const dialTimeout = 10 * time.Second

// Start starts a proxy listening on 127.0.0.1 on a free port, forwarding to
// target (host:port). Stop it with Close.
func Start(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("faultproxy: listen: %w", err)
	}
	p := &Proxy{target: target, ln: ln, conns: make(map[*conn]struct{})}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// New is Start for tests: it fails the test on error and closes the proxy
// when the test ends.
func New(t testing.TB, target string) *Proxy {
	t.Helper()
	p, err := Start(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// Addr returns the address clients should connect to, "127.0.0.1:port".
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Target returns the address the proxy forwards to.
func (p *Proxy) Target() string { return p.target }

// Cut closes every open connection now, on both sides, with a TCP reset as
// a network failure would. New connections are still accepted and forwarded.
//
// Connections the proxy ends by a fault are reset (RST) rather than closed
// cleanly (FIN): a reset is what a client sees when the peer host fails or
// refuses, and clients treat it so. kgo for one takes a clean close right
// after connecting for a permanent misconfiguration (missing TLS) and fails
// the records instead of retrying.
func (p *Proxy) Cut() {
	p.mu.Lock()
	cs := p.takeConnsLocked()
	p.mu.Unlock()
	closeAll(cs)
}

// Down cuts every open connection and refuses new ones until Restore: they
// are accepted and reset at once, so clients fail fast (as with a stopped
// server) instead of waiting for a timeout.
func (p *Proxy) Down() {
	p.mu.Lock()
	p.mode.Store(modeDown)
	cs := p.takeConnsLocked()
	p.mu.Unlock()
	closeAll(cs)
}

// Blackhole models a network partition until Restore: connections, existing
// and new, stay open but no byte reaches the other side in either direction.
// New connections are accepted and held silent. Bytes read meanwhile are
// dropped, not delivered later, so Restore cuts every connection that was
// open during the partition (their streams are corrupt); connections made
// after Restore work normally.
func (p *Proxy) Blackhole() {
	p.mu.Lock()
	p.mode.Store(modeBlackhole)
	p.mu.Unlock()
}

// Latency delays every chunk forwarded, in each direction, by d, so a
// request-response round trip takes at least 2*d longer. Zero removes it.
func (p *Proxy) Latency(d time.Duration) { p.precise.Store(false); p.latency.Store(int64(d)) }

// PreciseLatency is Latency for delays under a millisecond, for
// benchmarks: a Go timer (Latency's) fires no sooner than about 1 ms after
// it is set, whatever it asks for (250 µs sleeps 1.1 ms here), so each
// chunk's delay is held by the forwarding goroutine's thread in the kernel
// (nanosleep, on Linux; about d + 0.1 ms, measured), which a Close or Cut
// does not interrupt. Elsewhere it is Latency.
func (p *Proxy) PreciseLatency(d time.Duration) { p.precise.Store(true); p.latency.Store(int64(d)) }

// HoldReplies holds every byte the target sends, on every connection, until
// ReleaseReplies delivers them: a reply that left the server and has not
// reached the client yet, for as long as the test needs. Bytes from clients
// still reach the target (a client's cancel request, on a new connection,
// included). A connection closed meanwhile drops what was held for it.
func (p *Proxy) HoldReplies() {
	ch := make(chan struct{})
	p.replies.CompareAndSwap(nil, &ch)
}

// ReleaseReplies delivers what HoldReplies held and lets replies flow again.
func (p *Proxy) ReleaseReplies() {
	if ch := p.replies.Swap(nil); ch != nil {
		close(*ch)
	}
}

// Restore returns to normal forwarding without latency. Leaving a blackhole
// cuts the connections that were open during it (see Blackhole).
func (p *Proxy) Restore() {
	p.mu.Lock()
	var cs []*conn
	if p.mode.Load() == modeBlackhole {
		cs = p.takeConnsLocked()
	}
	p.mode.Store(modeNormal)
	p.latency.Store(0)
	p.mu.Unlock()
	closeAll(cs)
}

// Conns returns the number of connections currently open through the proxy.
func (p *Proxy) Conns() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns)
}

// Close stops listening, closes every connection and waits for all of the
// proxy's goroutines to end. Calling it again does nothing.
func (p *Proxy) Close() error {
	p.closeOnce.Do(func() {
		p.mu.Lock()
		p.closed = true
		cs := p.takeConnsLocked()
		p.mu.Unlock()
		p.closeErr = p.ln.Close()
		closeAll(cs)
		p.wg.Wait()
	})
	return p.closeErr
}

// RewriteURL returns the postgres:// URL u with its host and port replaced by
// the proxy's address; user, password, database and query parameters (such
// as search_path) are kept. It panics if u is not a postgres URL, since
// silently connecting around the proxy would make fault tests vacuous.
func (p *Proxy) RewriteURL(u string) string {
	pu := parsePostgresURL(u)
	pu.Host = p.Addr()
	// host and port query parameters override the URL's host in pgx and
	// libpq; drop them so the connection really goes through the proxy.
	if q := pu.Query(); q.Has("host") || q.Has("port") || q.Has("hostaddr") {
		q.Del("host")
		q.Del("port")
		q.Del("hostaddr")
		pu.RawQuery = q.Encode()
	}
	return pu.String()
}

// PostgresTarget returns the host:port a postgres:// URL connects to, the
// target for a Proxy in front of that server. The port defaults to 5432 and
// the host to localhost; of several hosts, the first is used. It panics if u
// is not a postgres URL.
func PostgresTarget(u string) string {
	pu := parsePostgresURL(u)
	hostport, _, _ := strings.Cut(pu.Host, ",")
	host, port, err := net.SplitHostPort(hostport)
	if err != nil { // no port
		host, port = strings.Trim(hostport, "[]"), ""
	}
	if host == "" {
		host = "localhost"
	}
	if port == "" {
		port = "5432"
	}
	return net.JoinHostPort(host, port)
}

func parsePostgresURL(u string) *url.URL {
	pu, err := url.Parse(u)
	if err != nil || (pu.Scheme != "postgres" && pu.Scheme != "postgresql") {
		panic(fmt.Sprintf("faultproxy: %q is not a postgres:// URL", u))
	}
	return pu
}

// takeConnsLocked removes every connection from the set and returns them for
// closing. Removing them at once (rather than when their goroutines notice)
// makes Conns exact right after Cut, Down and Restore.
func (p *Proxy) takeConnsLocked() []*conn {
	cs := make([]*conn, 0, len(p.conns))
	for c := range p.conns {
		cs = append(cs, c)
		delete(p.conns, c)
	}
	return cs
}

// closeAll ends connections by a fault, so it resets them (see Cut).
func closeAll(cs []*conn) {
	for _, c := range cs {
		c.close(true)
	}
}

// resetClose closes nc with a TCP reset: with SO_LINGER 0 the kernel sends
// RST instead of FIN.
func resetClose(nc net.Conn) {
	if tc, ok := nc.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	nc.Close()
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		nc, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of file descriptors and the like: back off and retry
			// rather than stop accepting for the rest of the test.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		p.mu.Lock()
		mode := p.mode.Load()
		if p.closed || mode == modeDown {
			p.mu.Unlock()
			resetClose(nc)
			continue
		}
		ctx, cancel := context.WithCancel(context.Background())
		c := &conn{client: nc, ctx: ctx, cancel: cancel}
		p.conns[c] = struct{}{}
		p.wg.Add(1)
		p.mu.Unlock()
		go p.serve(c, mode == modeBlackhole)
	}
}

// serve forwards one connection until either side closes or it is cut.
func (p *Proxy) serve(c *conn, held bool) {
	defer p.wg.Done()
	defer p.remove(c)
	if held {
		// Accepted during a blackhole: the target must not even see the
		// connection, and the client's bytes go nowhere. Restore cuts it.
		_, _ = io.Copy(io.Discard, c.client)
		return
	}
	d := net.Dialer{Timeout: dialTimeout}
	s, err := d.DialContext(c.ctx, "tcp", p.target)
	if err != nil {
		return
	}
	if !c.setServer(s) {
		s.Close()
		return
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.pipe(c, c.client, s, true)
	}()
	p.pipe(c, s, c.client, false)
	<-done
}

// pipe copies src to dst chunk by chunk, applying latency and blackhole to
// each chunk (and HoldReplies to the target's, reply set), and closes the
// whole connection when either side fails: the protocols proxied here do
// not use half-closed connections.
func (p *Proxy) pipe(c *conn, dst, src net.Conn, reply bool) {
	defer c.close(false) // one side ended: pass that on cleanly
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if d := time.Duration(p.latency.Load()); d > 0 && p.precise.Load() {
				holdFor(d)
			} else if d > 0 {
				t := time.NewTimer(d)
				select {
				case <-t.C:
				case <-c.ctx.Done():
					t.Stop()
					return
				}
			}
			if held := p.replies.Load(); reply && held != nil {
				select {
				case <-*held:
				case <-c.ctx.Done():
					return
				}
			}
			// Checked after the latency sleep, so nothing crosses
			// a partition that started while the chunk waited.
			if p.mode.Load() != modeBlackhole {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *Proxy) remove(c *conn) {
	c.close(false)
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}

// conn is one proxied connection: the accepted client side and, once dialed,
// the target side.
type conn struct {
	client net.Conn
	ctx    context.Context // done once the connection is closed; cancels the dial
	cancel context.CancelFunc

	mu     sync.Mutex
	server net.Conn
	closed bool
}

// setServer records the dialed target side, reporting false if the
// connection was cut during the dial.
func (c *conn) setServer(s net.Conn) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return false
	}
	c.server = s
	return true
}

// close closes both sides, with a reset if reset is set; it is idempotent
// and unblocks the pipes.
func (c *conn) close(reset bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return
	}
	c.closed = true
	c.cancel()
	end := net.Conn.Close
	if reset {
		end = func(nc net.Conn) error { resetClose(nc); return nil }
	}
	_ = end(c.client)
	if c.server != nil {
		_ = end(c.server)
	}
}
