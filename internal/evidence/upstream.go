package evidence

import (
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Upstream is a provider on loopback that counts, by key, what reached it:
// the evidence of an effect is its count here, never stopgate's word.
// Paths are /e/RUN/KEY (answered at once), /slow/RUN/KEY (held until the
// test ends, the test releases the key, or the client goes),
// /stream/RUN/KEY (a stream of lines until the client goes), /page/RUN/KEY
// (an HTML page for a browser, which asks for no favicon).
type Upstream struct {
	srv     *httptest.Server
	conns   atomic.Int64
	mu      sync.Mutex
	hits    map[string]int
	arrived map[string]chan struct{}
	held    map[string]chan struct{}
	release chan struct{}
}

// StartUpstream starts the provider; it stops when the test ends.
func StartUpstream(t testing.TB) *Upstream {
	u := newUpstream()
	u.srv = httptest.NewUnstartedServer(http.HandlerFunc(u.serve))
	u.srv.Config.ConnState = u.connState
	u.srv.Start()
	t.Cleanup(u.stop)
	return u
}

// StartUpstreamTLS starts the provider on HTTPS with cert, for hosts that
// are passed through unseen: stopgate cannot count what such a connection
// carries, the provider can. It stops when the test ends.
func StartUpstreamTLS(t testing.TB, cert tls.Certificate) *Upstream {
	u := newUpstream()
	u.srv = httptest.NewUnstartedServer(http.HandlerFunc(u.serve))
	u.srv.Config.ConnState = u.connState
	u.srv.TLS = &tls.Config{Certificates: []tls.Certificate{cert}}
	u.srv.StartTLS()
	t.Cleanup(u.stop)
	return u
}

func newUpstream() *Upstream {
	return &Upstream{hits: map[string]int{}, arrived: map[string]chan struct{}{}, held: map[string]chan struct{}{}, release: make(chan struct{})}
}

func (u *Upstream) stop() {
	close(u.release)
	u.srv.Close()
}

func (u *Upstream) connState(_ net.Conn, st http.ConnState) {
	if st == http.StateNew {
		u.conns.Add(1)
	}
}

// Conns counts the TCP connections that reached the provider.
func (u *Upstream) Conns() int64 { return u.conns.Load() }

// Addr is the provider's host:port.
func (u *Upstream) Addr() string { return u.srv.Listener.Addr().String() }

// URL is the provider's base URL (http://127.0.0.1:PORT).
func (u *Upstream) URL() string { return u.srv.URL }

func (u *Upstream) serve(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	key := path.Base(r.URL.Path)
	u.mu.Lock()
	u.hits[key]++
	if ch, ok := u.arrived[key]; ok {
		close(ch)
		delete(u.arrived, key)
	}
	u.mu.Unlock()
	switch {
	case strings.HasPrefix(r.URL.Path, "/slow/"):
		select {
		case <-u.heldFor(key):
		case <-u.release:
		case <-r.Context().Done():
		}
	case strings.HasPrefix(r.URL.Path, "/page/"):
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		fmt.Fprintln(w, `<!doctype html><html><head><title>provider</title><link rel="icon" href="data:,"></head><body><p>provider page</p></body></html>`)
		return
	case strings.HasPrefix(r.URL.Path, "/stream/"):
		w.Header().Set("Content-Type", "text/event-stream")
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			if _, err := fmt.Fprintf(w, "data: tick\n\n"); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			select {
			case <-tick.C:
			case <-r.Context().Done():
				return
			case <-u.release:
				return
			}
		}
	}
	fmt.Fprintln(w, "done")
}

// heldFor is the channel whose closing answers the /slow/ requests of key.
func (u *Upstream) heldFor(key string) chan struct{} {
	u.mu.Lock()
	defer u.mu.Unlock()
	ch, ok := u.held[key]
	if !ok {
		ch = make(chan struct{})
		u.held[key] = ch
	}
	return ch
}

// Release answers the /slow/ requests of key that are held, and those that
// come later, at once.
func (u *Upstream) Release(key string) {
	ch := u.heldFor(key)
	u.mu.Lock()
	defer u.mu.Unlock()
	select {
	case <-ch:
	default:
		close(ch)
	}
}

// Hits is how many requests under key reached the provider.
func (u *Upstream) Hits(key string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.hits[key]
}

// AllHits is a copy of every key's count.
func (u *Upstream) AllHits() map[string]int {
	u.mu.Lock()
	defer u.mu.Unlock()
	out := make(map[string]int, len(u.hits))
	for k, v := range u.hits {
		out[k] = v
	}
	return out
}

// Arrived closes when a request under key reaches the provider (at once if
// one already has).
func (u *Upstream) Arrived(key string) <-chan struct{} {
	u.mu.Lock()
	defer u.mu.Unlock()
	ch := make(chan struct{})
	if u.hits[key] > 0 {
		close(ch)
		return ch
	}
	if old, ok := u.arrived[key]; ok {
		return old
	}
	u.arrived[key] = ch
	return ch
}

// TunnelEnd is a TCP server standing for a pass-through destination: it
// echoes what it gets and counts connections and bytes.
type TunnelEnd struct {
	ln    net.Listener
	conns atomic.Int64
	bytes atomic.Int64
}

// StartTunnelEnd starts it; it stops when the test ends.
func StartTunnelEnd(t testing.TB) *TunnelEnd {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e := &TunnelEnd{ln: ln}
	var wg sync.WaitGroup
	t.Cleanup(func() { _ = ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			e.conns.Add(1)
			wg.Go(func() {
				defer c.Close()
				buf := make([]byte, 4096)
				for {
					n, err := c.Read(buf)
					if n > 0 {
						e.bytes.Add(int64(n))
						if _, werr := c.Write(buf[:n]); werr != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			})
		}
	})
	return e
}

// Addr is host:port of the destination.
func (e *TunnelEnd) Addr() string { return e.ln.Addr().String() }

// Conns counts the connections that reached it.
func (e *TunnelEnd) Conns() int64 { return e.conns.Load() }
