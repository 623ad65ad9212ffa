package proxy

// Transparent mode: connections the kernel redirected to stopgate (iptables
// REDIRECT) instead of connections a client chose to send to a proxy. The
// client believes it talks to the upstream; stopgate reads where it meant to
// go (SO_ORIGINAL_DST), tells HTTP from TLS by the first bytes, and hands
// each request to the same proxy path as an absolute-URI proxy request: the
// same identity rules, the same guard call, the same refusals and the same
// ledger. The upstream dialled is always the original destination, pinned in
// the request's context (dial.go), so a Host header or an SNI can name a
// host but never choose the address.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/elazarl/goproxy"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/telemetry"
)

const (
	// sniffTimeout bounds how long a redirected client may take to send
	// its first bytes (a ClientHello or a request line).
	sniffTimeout = 10 * time.Second
	// maxMethodLen bounds the method token of a request line we wait for.
	maxMethodLen = 24
	// nameLookupTimeout bounds the lookup that checks a plain-HTTP Host or
	// a pass-through SNI against the original destination.
	nameLookupTimeout = 2 * time.Second
	// tlsRecordHandshake is the first byte of every TLS ClientHello.
	tlsRecordHandshake = 0x16
)

// TransparentOptions configure a transparent server.
type TransparentOptions struct {
	// Run binds every connection to this run (a binding made for one uid):
	// nothing the client sends can name another. Empty: requests name
	// their run with headers, else the proxy's static run applies.
	Run string
	// Version is the cancel_version the binding observed; 0 checks ACTIVE alone.
	Version int64
	// OriginalDst reads where a redirected connection was going; nil reads
	// SO_ORIGINAL_DST. Set it only where the kernel cannot redirect.
	OriginalDst func(net.Conn) (netip.AddrPort, error)
}

// Transparent serves connections redirected to it by the kernel. Create it
// with Proxy.NewTransparent, call Serve for each listener, Close to stop.
type Transparent struct {
	p       *Proxy
	bound   *identity
	origDst func(net.Conn) (netip.AddrPort, error)
	srv     *http.Server
	queue   *connQueue
	log     *slog.Logger

	mu     sync.Mutex
	closed bool
	lns    []net.Listener
	// raw are the connections still being sniffed or carrying a
	// pass-through tunnel; the HTTP server owns the others.
	raw map[net.Conn]struct{}
}

// NewTransparent returns a transparent server on top of p.
func (p *Proxy) NewTransparent(opts TransparentOptions) (*Transparent, error) {
	t := &Transparent{p: p, origDst: opts.OriginalDst, queue: newConnQueue(), log: p.log.With("mode", "transparent"), raw: map[net.Conn]struct{}{}}
	if t.origDst == nil {
		t.origDst = originalDst
	}
	if opts.Run != "" {
		if err := state.ValidateRunID(opts.Run); err != nil {
			return nil, fmt.Errorf("bind transparent listener to run: %w", err)
		}
		if opts.Version < 0 {
			return nil, fmt.Errorf("bind transparent listener to run: cancel_version %d is negative", opts.Version)
		}
		t.bound = &identity{run: opts.Run, version: opts.Version, via: "transparent binding", bound: true}
		t.log = t.log.With("run", opts.Run)
	}
	// Like the proxy listener's server: no read or write timeout, since
	// streams and long provider calls are the traffic; headers are bounded.
	t.srv = newRequestServer(t.serveRequest, p.cfg.IdleTimeout, t.log, func(ctx context.Context, c net.Conn) context.Context {
		return context.WithValue(ctx, connKey{}, asTransparentConn(c))
	})
	go func() { _ = t.srv.Serve(t.queue) }()
	return t, nil
}

// Serve accepts redirected connections on ln until ln or t is closed.
func (t *Transparent) Serve(ln net.Listener) error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		_ = ln.Close()
		return net.ErrClosed
	}
	t.lns = append(t.lns, ln)
	t.mu.Unlock()
	var backoff time.Duration
	for {
		c, err := ln.Accept()
		if err != nil {
			if t.isClosed() || errors.Is(err, net.ErrClosed) {
				return nil
			}
			// As net/http does: out of file descriptors is worth a retry.
			if ne, ok := err.(interface{ Temporary() bool }); ok && ne.Temporary() {
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				t.log.Warn("accept failed; retrying", "err", err, "in", backoff)
				time.Sleep(backoff)
				continue
			}
			return fmt.Errorf("transparent listener %s: %w", ln.Addr(), err)
		}
		backoff = 0
		if !t.track(c) {
			_ = c.Close()
			return nil
		}
		go t.handle(c)
	}
}

// Close stops every listener and closes every connection, tunnels included.
func (t *Transparent) Close() error {
	t.mu.Lock()
	t.closed = true
	lns, raw := t.lns, t.raw
	t.lns, t.raw = nil, map[net.Conn]struct{}{}
	t.mu.Unlock()
	for _, ln := range lns {
		_ = ln.Close()
	}
	for c := range raw {
		_ = c.Close()
	}
	return t.srv.Close()
}

func (t *Transparent) isClosed() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.closed
}

func (t *Transparent) track(c net.Conn) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return false
	}
	t.raw[c] = struct{}{}
	return true
}

func (t *Transparent) untrack(c net.Conn) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.raw, c)
}

// transparentConn is a redirected connection with what was learnt of it
// before the HTTP server took it: where it was going, and the bytes read
// to tell its protocol, which it replays.
type transparentConn struct {
	net.Conn
	r   io.Reader
	od  netip.AddrPort
	tls bool
	sni string
	// names caches, for plain HTTP, whether a Host name resolves to od.
	names map[string]bool
}

func (c *transparentConn) Read(b []byte) (int, error) { return c.r.Read(b) }

type connKey struct{}

func asTransparentConn(c net.Conn) *transparentConn {
	if tc, ok := c.(*tls.Conn); ok {
		c = tc.NetConn()
	}
	tc, _ := c.(*transparentConn)
	return tc
}

// handle tells what a redirected connection carries and hands it on: TLS
// to interception or to a pass-through tunnel, HTTP to the HTTP server;
// anything else is refused, recorded, and closed, never spliced unseen.
func (t *Transparent) handle(c net.Conn) {
	handed := false
	defer func() {
		t.untrack(c)
		if !handed {
			_ = c.Close()
		}
	}()
	od, err := t.origDst(c)
	if err != nil {
		t.refuse(netip.AddrPort{}, "no_original_destination", err.Error())
		return
	}
	if local, ok := netip.ParseAddrPort(c.LocalAddr().String()); ok == nil && local.Addr().Unmap() == od.Addr().Unmap() && local.Port() == od.Port() {
		t.refuse(od, refusal.NotRedirected, "the client connected to the transparent listener itself; it serves only connections the kernel redirected")
		return
	}
	_ = c.SetReadDeadline(time.Now().Add(sniffTimeout))
	br := bufio.NewReader(c)
	first, err := br.Peek(1)
	if err != nil {
		t.refuse(od, refusal.NotHTTPOrTLS, fmt.Sprintf("the client sent nothing within %s (%v); only HTTP and TLS are carried, so protocols where the server speaks first are refused", sniffTimeout, err))
		return
	}
	tc := &transparentConn{Conn: c, od: od}
	if first[0] == tlsRecordHandshake {
		sni, rec, err := readClientHello(c, br)
		if err != nil {
			t.refuse(od, refusal.NotHTTPOrTLS, err.Error())
			return
		}
		_ = c.SetReadDeadline(time.Time{})
		tc.r, tc.tls, tc.sni = io.MultiReader(bytes.NewReader(rec), br), true, sni
		name := sni
		if name == "" {
			name = od.Addr().String()
		}
		host := joinHostPort(name, od.Port(), "")
		if t.p.current().PassThrough.Match(host) && t.nameBacks(tc, name) {
			t.passThrough(tc, host)
			return
		}
		if t.p.cfg.CA == nil {
			t.refuse(od, refusal.InterceptionDisabled, "TLS to "+host+": this proxy has no CA to intercept it and it is not a pass-through host")
			return
		}
		handed = t.queue.hand(tls.Server(tc, t.p.mitmConfig(tc.od.Addr().String())))
		return
	}
	if !looksLikeHTTP(br) {
		t.refuse(od, refusal.NotHTTPOrTLS, fmt.Sprintf("the first bytes are neither a TLS ClientHello nor an HTTP request line (%q)", peekSome(br)))
		return
	}
	_ = c.SetReadDeadline(time.Time{})
	tc.r = br
	handed = t.queue.hand(tc)
}

// serveRequest turns a request read from a redirected connection into the
// absolute-URI proxy request it stands for, pinned to the original
// destination, and serves it as the proxy serves every other.
func (t *Transparent) serveRequest(w http.ResponseWriter, r *http.Request) {
	tc, _ := r.Context().Value(connKey{}).(*transparentConn)
	if tc == nil {
		refusal.New(refusal.Internal, "transparent connection lost its destination").WriteHTTP(w)
		return
	}
	if r.Method == http.MethodConnect {
		refuseInnerConnect(w, "on a connection redirected to stopgate")
		return
	}
	host := r.Host
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	scheme, name := "http", ""
	if tc.tls {
		// The upstream's certificate is checked for this name at the
		// original destination: the name is proven, not just claimed.
		scheme, name = "https", cmpOr(host, tc.sni, tc.od.Addr().String())
	} else {
		name = t.backedName(tc, host)
	}
	u := *r.URL
	u.Scheme, u.Host, u.User = scheme, joinHostPort(name, tc.od.Port(), scheme), nil
	r.URL = &u
	if r.Host == "" {
		r.Host = u.Host
	}
	ctx := withDialPin(r.Context(), tc.od)
	if t.bound != nil {
		ctx = context.WithValue(ctx, boundRunKey{}, t.bound)
	}
	t.p.ServeHTTP(w, r.WithContext(ctx))
}

// backedName is the host a plain-HTTP request is recorded and matched under:
// the Host name when it resolves to the original destination, else the
// destination's address. A Host header is only a claim, and policy that
// goes by name (delivery, pass-through) must not follow a claim to an
// address it does not name.
func (t *Transparent) backedName(tc *transparentConn, host string) string {
	if host != "" && t.nameBacks(tc, host) {
		return strings.ToLower(host)
	}
	return tc.od.Addr().String()
}

// nameBacks reports whether name (a host name or an address) is the
// original destination's address or resolves to it.
func (t *Transparent) nameBacks(tc *transparentConn, name string) bool {
	want := tc.od.Addr().Unmap()
	if ip, err := netip.ParseAddr(name); err == nil {
		return ip.Unmap() == want
	}
	if ok, seen := tc.names[name]; seen {
		return ok
	}
	ctx, cancel := context.WithTimeout(context.Background(), nameLookupTimeout)
	defer cancel()
	addrs, err := net.DefaultResolver.LookupNetIP(ctx, "ip", name)
	ok := false
	for _, a := range addrs {
		ok = ok || a.Unmap() == want
	}
	if !ok {
		t.log.Debug("name does not resolve to the original destination; recorded by address", "name", name, "dest", tc.od, "err", err)
	}
	if tc.names == nil {
		tc.names = map[string]bool{}
	}
	tc.names[name] = ok
	return ok
}

// passThrough carries a TLS connection to a pass-through host unseen, through
// the proxy's own CONNECT path: guarded once for the tunnel, cut when the
// run is cancelled.
func (t *Transparent) passThrough(tc *transparentConn, host string) {
	req := (&http.Request{
		Method: http.MethodConnect, URL: &url.URL{Host: host}, Host: host, Header: http.Header{},
		Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1, RemoteAddr: tc.RemoteAddr().String(),
	}).WithContext(t.connContext(context.Background(), tc))
	pctx := &goproxy.ProxyCtx{Req: req, Proxy: t.p.gp}
	action, _ := t.p.handleConnect(host, pctx)
	if action == nil || action.Action != goproxy.ConnectHijack {
		// Refused (and recorded by the guard where a run was named): a TLS
		// client cannot read an HTTP answer, so the connection is closed.
		code := "refused"
		if pctx.Resp != nil {
			code = pctx.Resp.Header.Get(refusal.Header)
		}
		t.log.Info("pass-through tunnel refused; connection closed", "host", host, "dest", tc.od, "refusal", code)
		return
	}
	action.Hijack(req, &tunnelClient{transparentConn: tc}, pctx)
}

func (t *Transparent) connContext(ctx context.Context, tc *transparentConn) context.Context {
	ctx = withDialPin(ctx, tc.od)
	if t.bound != nil {
		ctx = context.WithValue(ctx, boundRunKey{}, t.bound)
	}
	return ctx
}

// refuse records a connection stopgate will not carry, under the run it
// belongs to when one is known (the binding's, else the static run): the
// guard is asked as for any effect, so a cancelled run's attempt reads
// CANCELLED_BEFORE_DISPATCH and an active run's NOT_SENT with the reason.
func (t *Transparent) refuse(od netip.AddrPort, code refusal.Code, msg string) {
	target := "tcp://unknown"
	if od.IsValid() {
		target = "tcp://" + od.String()
	}
	id := t.bound
	if id == nil {
		id = t.p.static
	}
	d := telemetry.Decision{Boundary: state.BoundaryTunnel, Result: telemetry.Refused, Reason: string(code), Method: "TCP", Host: od.String(), Detail: msg}
	if id == nil {
		t.p.tel.Decided(context.Background(), d)
		return
	}
	d.Run, d.Version, d.Via = id.run, id.version, id.via
	// The guard records the edge's refusal in its one step: the attempt is
	// in the run's audit as CANCELLED_BEFORE_DISPATCH with the reason.
	res, err := t.p.cfg.Ledger.Begin(context.Background(), state.GuardRequest{
		RunID: id.run, ObservedVersion: id.version, Key: intents.DerivedKey(id.run, "TCP", target, ""),
		Boundary: state.BoundaryTunnel, Method: "TCP", Target: target, AutoAdmit: t.p.cfg.AutoAdmit, Refuse: string(code),
	})
	if err != nil {
		d.Detail = msg + "; the refusal was not recorded: " + err.Error()
	} else {
		d.Intent, d.Recorded = res.Intent.Key, res.Intent.State
	}
	t.p.tel.Decided(context.Background(), d)
}

func (p *Proxy) mitmCert(name string) (*tls.Certificate, error) {
	return p.certs.Fetch(name, func() (*tls.Certificate, error) { return p.cfg.CA.Leaf(name) })
}

// readClientHello reads the client's TLS ClientHello without answering it,
// and returns its server name and every byte read, to be replayed to
// whoever answers it (our interception, or the upstream of a tunnel).
func readClientHello(c net.Conn, br *bufio.Reader) (sni string, read []byte, err error) {
	var rec bytes.Buffer
	seen := false
	probe := tls.Server(sniffConn{Conn: c, r: io.TeeReader(br, &rec)}, &tls.Config{
		GetConfigForClient: func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
			sni, seen = strings.ToLower(hello.ServerName), true
			return nil, errHelloRead
		},
	})
	err = probe.Handshake()
	if !seen {
		return "", nil, fmt.Errorf("the first bytes look like TLS but are not a ClientHello: %w", err)
	}
	return sni, rec.Bytes(), nil
}

var errHelloRead = errors.New("ClientHello read")

// sniffConn lets crypto/tls read a ClientHello and say nothing back.
type sniffConn struct {
	net.Conn
	r io.Reader
}

func (c sniffConn) Read(b []byte) (int, error) { return c.r.Read(b) }
func (c sniffConn) Write([]byte) (int, error) {
	return 0, errors.New("reading a ClientHello: nothing is answered")
}

// looksLikeHTTP waits for the start of a request line: a method token and
// a space.
func looksLikeHTTP(br *bufio.Reader) bool {
	for n := 1; n <= maxMethodLen+1; n++ {
		b, err := br.Peek(n)
		if err != nil {
			return false
		}
		switch c := b[n-1]; {
		case c == ' ':
			return n > 1
		case c >= 'A' && c <= 'Z', c >= 'a' && c <= 'z', c >= '0' && c <= '9', strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return false
}

func peekSome(br *bufio.Reader) []byte {
	b, _ := br.Peek(min(br.Buffered(), 16))
	return b
}

// joinHostPort writes host:port, leaving out the scheme's default port so
// that a request reads (and is keyed) as it would through the proxy.
func joinHostPort(host string, port uint16, scheme string) string {
	if (scheme == "http" && port == 80) || (scheme == "https" && port == 443) {
		if strings.Contains(host, ":") {
			return "[" + host + "]"
		}
		return host
	}
	return net.JoinHostPort(host, strconv.Itoa(int(port)))
}

func cmpOr(vals ...string) string {
	for _, v := range vals {
		if v != "" {
			return v
		}
	}
	return ""
}

// tunnelClient is a redirected TLS connection given to the proxy's tunnel:
// the tunnel opens with an HTTP answer for a CONNECT client, which this
// client never sent, so the answer's head is swallowed, and a refusal
// (anything but 200) closes the connection instead.
type tunnelClient struct {
	*transparentConn
	head    []byte
	started bool
}

func (c *tunnelClient) Write(b []byte) (int, error) {
	if c.started {
		return c.transparentConn.Write(b)
	}
	c.head = append(c.head, b...)
	end := bytes.Index(c.head, []byte("\r\n\r\n"))
	if end < 0 {
		if len(c.head) > 64<<10 {
			return 0, errors.New("tunnel answer head too long")
		}
		return len(b), nil
	}
	c.started = true
	if !bytes.HasPrefix(c.head, []byte("HTTP/1.1 200 ")) && !bytes.HasPrefix(c.head, []byte("HTTP/1.0 200 ")) {
		_ = c.Close()
		return 0, errors.New("tunnel refused: connection closed")
	}
	if rest := c.head[end+4:]; len(rest) > 0 {
		if _, err := c.transparentConn.Write(rest); err != nil {
			return 0, err
		}
	}
	return len(b), nil
}

func (c *tunnelClient) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.Close()
}

// connQueue is the listener the HTTP server of a transparent server
// accepts from: connections already sniffed and, for TLS, wrapped.
type connQueue struct {
	ch   chan net.Conn
	done chan struct{}
	once sync.Once
}

func newConnQueue() *connQueue {
	return &connQueue{ch: make(chan net.Conn), done: make(chan struct{})}
}

func (q *connQueue) hand(c net.Conn) bool {
	select {
	case q.ch <- c:
		return true
	case <-q.done:
		return false
	}
}

func (q *connQueue) Accept() (net.Conn, error) {
	select {
	case c := <-q.ch:
		return c, nil
	case <-q.done:
		return nil, net.ErrClosed
	}
}

func (q *connQueue) Close() error {
	q.once.Do(func() { close(q.done) })
	return nil
}

func (q *connQueue) Addr() net.Addr { return queueAddr{} }

type queueAddr struct{}

func (queueAddr) Network() string { return "transparent" }
func (queueAddr) String() string  { return "transparent" }
