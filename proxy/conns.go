package proxy

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// What a client may hold, and for how long. An exchange is a request being
// proxied (its body read, guarded, sent, its answer streamed back) or a
// tunnel (intercepted or pass-through) for as long as it is open: what a
// client can make the proxy hold, whatever it sends or does not send.
const (
	// DefaultMaxConns caps the exchanges open at once, in all.
	DefaultMaxConns = 1024
	// DefaultMaxConnsPerRun caps them per run (for a tunnel, the run of its CONNECT).
	DefaultMaxConnsPerRun = 256
	// DefaultHandshakeTimeout bounds a tunnel's start: from the CONNECT's
	// 200 to the end of the intercepted TLS handshake (or to the first
	// request of a tunnel that is not TLS), or to a pass-through client's
	// first byte.
	DefaultHandshakeTimeout = 10 * time.Second
	// DefaultIdleTimeout bounds a silence: between two bytes of a request
	// body, between two requests inside an intercepted tunnel, and in both
	// directions of a pass-through tunnel.
	DefaultIdleTimeout = 2 * time.Minute
)

// limits counts open exchanges, in all and by run.
type limits struct {
	max, perRun int
	mu          sync.Mutex
	total       int
	byRun       map[string]int
	open        prometheus.Gauge
}

// slot is one exchange's place under the limits, and what its client
// connection's reads may wait once a tunnel has taken it over.
type slot struct {
	l   *limits
	run string // "" until the exchange names its run
	// hijacked: the client connection outlives ServeHTTP; its Close frees the slot.
	hijacked bool
	freed    bool
	// mode says how reads of a hijacked client connection are bounded.
	mode        atomic.Int32
	handshakeBy time.Time
	idle        time.Duration
}

// Read modes of a hijacked client connection.
const (
	readHandshake int32 = iota // by the handshake deadline
	readIdle                   // each read within the idle timeout
	readOwn                    // the tunnel bounds its own silences
)

// take gives a slot, nil when the cap in all is reached.
func (l *limits) take(handshake, idle time.Duration) *slot {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.total >= l.max {
		return nil
	}
	l.total++
	l.open.Inc()
	return &slot{l: l, handshakeBy: time.Now().Add(handshake), idle: idle}
}

// name counts the slot against run; false when the run's cap is reached.
func (s *slot) name(run string) bool {
	l := s.l
	l.mu.Lock()
	defer l.mu.Unlock()
	if s.run != "" || s.freed {
		return true
	}
	if l.byRun[run] >= l.perRun {
		return false
	}
	if l.byRun == nil {
		l.byRun = map[string]int{}
	}
	l.byRun[run]++
	s.run = run
	return true
}

func (s *slot) free() {
	l := s.l
	l.mu.Lock()
	defer l.mu.Unlock()
	if s.freed {
		return
	}
	s.freed = true
	l.total--
	l.open.Dec()
	if s.run != "" {
		if l.byRun[s.run]--; l.byRun[s.run] <= 0 {
			delete(l.byRun, s.run)
		}
	}
}

type slotKey struct{}

func slotOf(ctx context.Context) *slot {
	s, _ := ctx.Value(slotKey{}).(*slot)
	return s
}

// hijackWriter hands goproxy a client connection that frees the CONNECT's
// slot when it closes and bounds its reads as the slot's mode says.
type hijackWriter struct {
	http.ResponseWriter
	slot *slot
}

func (w *hijackWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	conn, rw, err := http.NewResponseController(w.ResponseWriter).Hijack()
	if err != nil {
		return conn, rw, err
	}
	w.slot.hijacked = true
	return &clientConn{Conn: conn, slot: w.slot}, rw, nil
}

// clientConn is a tunnel's client side.
type clientConn struct {
	net.Conn
	slot *slot
	once sync.Once
}

func (c *clientConn) Read(b []byte) (int, error) {
	switch c.slot.mode.Load() {
	case readHandshake:
		_ = c.Conn.SetReadDeadline(c.slot.handshakeBy)
	case readIdle:
		_ = c.Conn.SetReadDeadline(time.Now().Add(c.slot.idle))
	}
	return c.Conn.Read(b)
}

func (c *clientConn) Close() error {
	c.once.Do(c.slot.free)
	return c.Conn.Close()
}

func (c *clientConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.Close()
}

// deadlineBody bounds the silences of a plain request's body: each read
// must bring a byte within the idle timeout, so a client that stops
// sending mid-body is answered and let go instead of held.
type deadlineBody struct {
	io.ReadCloser
	// rc is held in place: the body is made for every request that has
	// one, and its controller need not be an allocation of its own.
	rc   http.ResponseController
	idle time.Duration
	done atomic.Bool
}

func (b *deadlineBody) Read(p []byte) (int, error) {
	_ = b.rc.SetReadDeadline(time.Now().Add(b.idle))
	n, err := b.ReadCloser.Read(p)
	if errors.Is(err, io.EOF) {
		// The server takes the connection's deadlines back from here.
		b.done.Store(true)
	}
	return n, err
}

// bound is called when the handler is done: a body left unread (refused
// before it was read, or cut) is drained by the server, and that drain
// must not wait on a silent client longer than any other read.
func (b *deadlineBody) bound() {
	if !b.done.Load() {
		_ = b.rc.SetReadDeadline(time.Now().Add(b.idle))
	}
}

// timedOut reports whether err is a read that hit its deadline.
func timedOut(err error) bool { return errors.Is(err, os.ErrDeadlineExceeded) }
