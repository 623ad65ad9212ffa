package evidence

import (
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
// test ends or the client goes), /stream/RUN/KEY (a stream of lines until
// the client goes).
type Upstream struct {
	srv     *httptest.Server
	mu      sync.Mutex
	hits    map[string]int
	arrived map[string]chan struct{}
	release chan struct{}
}

// StartUpstream starts the provider; it stops when the test ends.
func StartUpstream(t testing.TB) *Upstream {
	u := &Upstream{hits: map[string]int{}, arrived: map[string]chan struct{}{}, release: make(chan struct{})}
	u.srv = httptest.NewServer(http.HandlerFunc(u.serve))
	t.Cleanup(func() { close(u.release); u.srv.Close() })
	return u
}

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
		case <-u.release:
		case <-r.Context().Done():
		}
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
