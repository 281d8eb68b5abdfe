package faultproxy

import (
	"net"
	"sync"
	"testing"

	"github.com/twmb/franz-go/pkg/kfake"
)

// KafkaCluster starts an in-process Kafka cluster (kfake) of nBrokers brokers
// with a Proxy in front of each, and closes both when the test ends. The
// proxies are returned in broker order (proxies[i] is node i); clients should
// use cluster.ListenAddrs() as seeds, which are the proxies' addresses.
//
// kfake advertises whatever address its listener reports, so the listener
// given to kfake (through kfake.ListenFn) reports the proxy's address while
// accepting on the broker's real port: metadata then routes every client
// connection through the proxies. To take the whole cluster down or
// partition it, apply the fault to every proxy (see Each).
//
// opts are passed to kfake after NumBrokers; kfake.Ports sets the brokers'
// real ports, not the advertised ones, and a kfake.ListenFn in opts is
// overridden. Brokers added later with AddNode get proxies too (closed with
// the cluster) but are not in the returned slice.
func KafkaCluster(t testing.TB, nBrokers int, opts ...kfake.Opt) (*kfake.Cluster, []*Proxy) {
	t.Helper()
	var (
		mu      sync.Mutex
		proxies []*Proxy
	)
	closeProxies := func() {
		mu.Lock()
		defer mu.Unlock()
		for _, p := range proxies {
			_ = p.Close()
		}
	}
	listen := func(network, address string) (net.Listener, error) {
		ln, err := net.Listen(network, address)
		if err != nil {
			return nil, err
		}
		p, err := Start(ln.Addr().String())
		if err != nil {
			ln.Close()
			return nil, err
		}
		mu.Lock()
		proxies = append(proxies, p)
		mu.Unlock()
		return advertisedListener{Listener: ln, addr: p.ln.Addr()}, nil
	}
	opts = append([]kfake.Opt{kfake.NumBrokers(nBrokers)}, opts...)
	opts = append(opts, kfake.ListenFn(listen))
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		closeProxies()
		t.Fatalf("faultproxy: start kfake: %v", err)
	}
	// Close the cluster before the proxies so that kfake sees its
	// connections end while it can still handle that.
	t.Cleanup(func() {
		c.Close()
		closeProxies()
	})
	mu.Lock()
	defer mu.Unlock()
	return c, append([]*Proxy(nil), proxies...)
}

// Each calls fault on every proxy, e.g. Each(ps, (*Proxy).Down) takes a whole
// KafkaCluster down and Each(ps, (*Proxy).Restore) brings it back.
func Each(ps []*Proxy, fault func(*Proxy)) {
	for _, p := range ps {
		fault(p)
	}
}

// advertisedListener accepts on the broker's real port but reports the
// proxy's address, which is what kfake advertises to clients.
type advertisedListener struct {
	net.Listener
	addr net.Addr
}

func (l advertisedListener) Addr() net.Addr { return l.addr }
