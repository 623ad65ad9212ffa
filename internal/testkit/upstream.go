package testkit

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Upstream is a real HTTP(S) server on loopback that counts what reaches
// it: the evidence that an effect left stopgate is the upstream's own
// counter, never stopgate's record of it.
type Upstream struct {
	*httptest.Server
	// Hits counts every request that reached the server.
	Hits    atomic.Int64
	mu      sync.Mutex
	headers []http.Header
	bodies  [][]byte
}

// NewUpstream starts an upstream (TLS when tlsOn), closed when the test
// ends. handler answers after the request is counted and its body read
// (the handler reads it again); nil answers "hello METHOD PATH".
func NewUpstream(t testing.TB, tlsOn bool, handler http.HandlerFunc) *Upstream {
	t.Helper()
	u := &Upstream{}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.Hits.Add(1)
		body, _ := io.ReadAll(r.Body)
		u.mu.Lock()
		u.headers = append(u.headers, r.Header.Clone())
		u.bodies = append(u.bodies, body)
		u.mu.Unlock()
		if handler != nil {
			// The handler reads the body as it came, as well.
			r.Body = io.NopCloser(bytes.NewReader(body))
			handler(w, r)
			return
		}
		fmt.Fprintf(w, "hello %s %s", r.Method, r.URL.Path)
	})
	if tlsOn {
		u.Server = httptest.NewTLSServer(h)
	} else {
		u.Server = httptest.NewServer(h)
	}
	t.Cleanup(u.Close)
	return u
}

// LastHeader is the header of the last request, nil before any.
func (u *Upstream) LastHeader() http.Header {
	u.mu.Lock()
	defer u.mu.Unlock()
	if len(u.headers) == 0 {
		return nil
	}
	return u.headers[len(u.headers)-1]
}

// LastBody is the body of the last request, nil before any.
func (u *Upstream) LastBody() []byte {
	u.mu.Lock()
	defer u.mu.Unlock()
	if len(u.bodies) == 0 {
		return nil
	}
	return u.bodies[len(u.bodies)-1]
}

// Stream is a provider that streams an answer of contentType: a line made
// of format and a counter, flushed, every interval, until the client goes.
func Stream(contentType, format string, every time.Duration) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", contentType)
		rc := http.NewResponseController(w)
		for i := 0; ; i++ {
			if _, err := fmt.Fprintf(w, format, i); err != nil || rc.Flush() != nil {
				return
			}
			select {
			case <-r.Context().Done():
				return
			case <-time.After(every):
			}
		}
	}
}
