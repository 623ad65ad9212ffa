// Package faultnet is a TCP relay for tests that puts network failures
// between a client and a server on loopback: a reply lost after the server
// acted on the request, a connection gone silent without closing, every
// connection cut at once.
//
// It owns only the bytes it relays. It never parses a protocol: a request
// is recognised by substrings of the bytes the client wrote, which is
// enough for Redis commands (RESP carries names and arguments as plain
// text). It never listens beyond loopback.
package faultnet

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Relay forwards every connection accepted on its loopback address to a
// target address, and breaks the connections it is told to.
type Relay struct {
	ln net.Listener

	mu     sync.Mutex
	target string
	conns  map[*pair]struct{}
	// drops are one-shot rules: the reply to the next request matching is lost.
	drops []*dropRule
	// silence lists the substrings that, once a client has written them on
	// a connection, make that connection silent (see Silence).
	silence [][]byte
	// partitioned relays nothing in either direction, on every connection.
	partitioned bool
	closed      bool

	lostReplies atomic.Int64
	silenced    atomic.Int64
	wg          sync.WaitGroup
}

type dropRule struct {
	match [][]byte
	fired chan struct{}
}

// pair is one relayed connection.
type pair struct {
	client, server net.Conn
	// dropReply is set when a request on this connection matched a drop
	// rule: the server's next bytes are thrown away and both sides closed.
	dropReply atomic.Pointer[dropRule]
	// silent: server bytes are discarded from now on; the connection stays open.
	silent atomic.Bool
	once   sync.Once
	// head is the start of what the client wrote (lower case, up to
	// headLimit bytes), so a Silence rule made later can still find a
	// connection by its first commands (a Redis SUBSCRIBE).
	head []byte // guarded by Relay.mu
}

const headLimit = 64 << 10

func (p *pair) close() {
	p.once.Do(func() { _ = p.client.Close(); _ = p.server.Close() })
}

// Listen starts a relay on a free loopback port forwarding to target.
func Listen(target string) (*Relay, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("faultnet: listen: %w", err)
	}
	r := &Relay{ln: ln, target: target, conns: map[*pair]struct{}{}}
	r.wg.Add(1)
	go r.serve()
	return r, nil
}

// Addr is the relay's host:port; clients dial it instead of the target.
func (r *Relay) Addr() string { return r.ln.Addr().String() }

// Port is the relay's port.
func (r *Relay) Port() int { return r.ln.Addr().(*net.TCPAddr).Port }

// SetTarget changes where new connections go; open ones keep theirs.
func (r *Relay) SetTarget(addr string) {
	r.mu.Lock()
	r.target = addr
	r.mu.Unlock()
}

// DropNextReply arms a one-shot rule: the next request whose bytes contain
// every one of match (case-insensitive) reaches the server, and the
// server's reply to it is thrown away and the connection closed on both
// sides. The server acted; the client never hears of it. The returned
// channel closes when the rule fired.
func (r *Relay) DropNextReply(match ...string) <-chan struct{} {
	rule := &dropRule{fired: make(chan struct{})}
	for _, m := range match {
		rule.match = append(rule.match, bytes.ToLower([]byte(m)))
	}
	r.mu.Lock()
	r.drops = append(r.drops, rule)
	r.mu.Unlock()
	return rule.fired
}

// Silence makes every connection on which the client has written match
// (case-insensitive; at any time, before or after this call) silent: what
// the server sends on it is discarded from then on, while the connection
// stays open and what the client sends still reaches the server. It is a
// connection that died without a FIN, as behind a broken NAT or a cable pulled.
func (r *Relay) Silence(match string) {
	m := bytes.ToLower([]byte(match))
	r.mu.Lock()
	r.silence = append(r.silence, m)
	for p := range r.conns {
		if bytes.Contains(p.head, m) {
			p.silent.Store(true)
		}
	}
	r.mu.Unlock()
}

// Partition stops relaying bytes in both directions on every connection,
// open or new, without closing any: the bytes are discarded.
func (r *Relay) Partition() {
	r.mu.Lock()
	r.partitioned = true
	r.mu.Unlock()
}

// Heal ends Partition and Silence rules for bytes relayed from now on;
// bytes already discarded stay lost, and silent connections stay silent.
func (r *Relay) Heal() {
	r.mu.Lock()
	r.partitioned = false
	r.silence = nil
	r.mu.Unlock()
}

// CutAll closes every open connection on both sides.
func (r *Relay) CutAll() {
	r.mu.Lock()
	conns := make([]*pair, 0, len(r.conns))
	for p := range r.conns {
		conns = append(conns, p)
	}
	r.mu.Unlock()
	for _, p := range conns {
		p.close()
	}
}

// LostReplies counts replies thrown away by DropNextReply rules.
func (r *Relay) LostReplies() int64 { return r.lostReplies.Load() }

// SilencedBytes counts server bytes discarded on silent connections or
// during a partition.
func (r *Relay) SilencedBytes() int64 { return r.silenced.Load() }

// Close stops accepting, closes every connection and waits for the relay's
// goroutines.
func (r *Relay) Close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	r.mu.Unlock()
	err := r.ln.Close()
	r.CutAll()
	r.wg.Wait()
	return err
}

func (r *Relay) serve() {
	defer r.wg.Done()
	for {
		c, err := r.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		r.mu.Lock()
		target := r.target
		r.mu.Unlock()
		s, err := net.DialTimeout("tcp", target, 2*time.Second)
		if err != nil {
			_ = c.Close()
			continue
		}
		p := &pair{client: c, server: s}
		r.mu.Lock()
		if r.closed {
			r.mu.Unlock()
			p.close()
			return
		}
		r.conns[p] = struct{}{}
		r.mu.Unlock()
		r.wg.Add(2)
		go r.up(p)
		go r.down(p)
	}
}

func (r *Relay) forget(p *pair) {
	p.close()
	r.mu.Lock()
	delete(r.conns, p)
	r.mu.Unlock()
}

// up relays client → server, marking the connection when a request matches
// a drop or silence rule before its bytes reach the server, so the reply
// that follows is surely the one affected.
func (r *Relay) up(p *pair) {
	defer r.wg.Done()
	defer r.forget(p)
	buf := make([]byte, 64<<10)
	for {
		n, err := p.client.Read(buf)
		if n > 0 {
			chunk := bytes.ToLower(buf[:n])
			r.mu.Lock()
			if room := headLimit - len(p.head); room > 0 {
				p.head = append(p.head, chunk[:min(room, len(chunk))]...)
			}
			for i, rule := range r.drops {
				if containsAll(chunk, rule.match) {
					r.drops = append(r.drops[:i], r.drops[i+1:]...)
					p.dropReply.Store(rule)
					break
				}
			}
			for _, m := range r.silence {
				if bytes.Contains(chunk, m) {
					p.silent.Store(true)
				}
			}
			partitioned := r.partitioned
			r.mu.Unlock()
			if !partitioned {
				if _, werr := p.server.Write(buf[:n]); werr != nil {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// down relays server → client, throwing away what the rules say.
func (r *Relay) down(p *pair) {
	defer r.wg.Done()
	defer r.forget(p)
	buf := make([]byte, 64<<10)
	for {
		n, err := p.server.Read(buf)
		if n > 0 {
			if rule := p.dropReply.Load(); rule != nil {
				r.lostReplies.Add(1)
				close(rule.fired)
				return
			}
			r.mu.Lock()
			partitioned := r.partitioned
			r.mu.Unlock()
			if partitioned || p.silent.Load() {
				r.silenced.Add(int64(n))
			} else if _, werr := p.client.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func containsAll(b []byte, subs [][]byte) bool {
	for _, s := range subs {
		if !bytes.Contains(b, s) {
			return false
		}
	}
	return true
}
