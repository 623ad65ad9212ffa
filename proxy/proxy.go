// Package proxy is the egress proxy: a sidecar that unmodified agents reach
// through HTTP_PROXY and HTTPS_PROXY. Every request is bound to a run, passed
// through the one atomic guard of package state (via the intents ledger)
// before a byte goes upstream, and recorded with its outcome; after a cancel
// commits, the run's new requests are refused and its open connections are
// cut as the contract says.
//
// It never forwards a request the guard did not admit: when the store is
// down or slow the answer is 503, not a request sent unguarded. It never
// decides a run's state (the store does, in the guard) nor what a refusal
// means (package refusal does): it renders both.
package proxy

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/elazarl/goproxy"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/runwatch"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/telemetry"
)

// Config wires a Proxy.
type Config struct {
	Ledger *intents.Ledger
	// Watcher carries the rows of runs with open flows to the proxy, which
	// cuts what a cancel says must not go on.
	Watcher *runwatch.Watcher
	// Telemetry receives every decision (log line and counters); nil
	// counts privately and logs nothing.
	Telemetry *telemetry.Telemetry
	CA        *CA
	// StaticRun binds every request without its own identity to one run.
	StaticRun string
	// AutoAdmit admits unseen runs on first sight (never a tombstone).
	AutoAdmit bool
	// Tokens verifies signed run tokens (proxy password or X-Run-Token);
	// with RequireToken a client can name its run no other way.
	Tokens       *runtoken.Signer
	RequireToken bool
	// Rules are the policy's part the proxy applies at start; SetRules
	// replaces them.
	Rules Rules
	// MaxBody caps a request body; past it the answer is 413 and nothing is sent.
	MaxBody int64
	// SpoolDir holds request bodies too large for memory ("" = os.TempDir).
	SpoolDir string
	// UpstreamRoots, if set, replaces the system roots for upstream TLS.
	UpstreamRoots *x509.CertPool
	// DialTimeout bounds connecting to an upstream.
	DialTimeout time.Duration
	// DialContext, if set, connects to upstreams instead of a plain
	// net.Dialer (egress through a chosen interface, say). It is given the
	// address the destination check resolved and allowed (IP:port), never
	// a name.
	DialContext func(ctx context.Context, network, addr string) (net.Conn, error)
	Logger      *slog.Logger

	// Protected are stopgate's own listeners and its store's addresses:
	// never a destination, whatever is allowed.
	Protected []Protected
	// Resolve, if set, replaces DNS for upstream names (tests: a provider's
	// name on loopback). Names are resolved once per request or tunnel.
	Resolve func(ctx context.Context, host string) ([]netip.Addr, error)

	// Runs, if set, reads a run's row when a request announces its body
	// with Expect: 100-continue, so that a run that is no longer ACTIVE is
	// refused before its body is sent (bounded by StoreTimeout).
	Runs         RunReader
	StoreTimeout time.Duration

	// MaxConns and MaxConnsPerRun cap the exchanges open at once (requests
	// being proxied, tunnels); past them the answer is 429
	// too_many_connections. Zero means the defaults.
	MaxConns, MaxConnsPerRun int
	// HandshakeTimeout bounds a tunnel's start, IdleTimeout a client's
	// silence (mid-body, between requests in a tunnel, both ways of a
	// pass-through tunnel). Zero means the defaults.
	HandshakeTimeout, IdleTimeout time.Duration
}

// RunReader reads a run's row (state.Store does).
type RunReader interface {
	Get(ctx context.Context, runID string) (state.Run, error)
}

// Proxy is the egress proxy; it is an http.Handler.
type Proxy struct {
	cfg       Config
	log       *slog.Logger
	tel       *telemetry.Telemetry
	gp        *goproxy.ProxyHttpServer
	transport *http.Transport
	flows     *flowSet
	static    *identity
	tokens    tokenCheck
	// rules are the policy's rules applied now (SetRules replaces them).
	rules    atomic.Pointer[rules]
	outbound outboundSet
	limits   *limits
	seen     *seenRows
	// upstream is roundTrip as goproxy takes it, made once: a method
	// value made per request is an allocation per request.
	upstream goproxy.RoundTripper
	// tunnels hands intercepted tunnels' connections to tunnelSrv, which
	// reads their requests.
	tunnels   *connQueue
	tunnelSrv *http.Server
	// certs are the leaves minted for intercepted hosts.
	certs *CertCache
}

// UpstreamTransport is the transport the proxy sends requests upstream
// with, dialling with dial and trusting roots (nil: the system's); the
// benchmarks' baseline goproxy uses it too, so that the two compare on the
// same settings. Its own, not net/http's default: that one reads
// HTTP(S)_PROXY from the environment, and a sidecar that inherits its
// worker's environment would proxy to itself.
func UpstreamTransport(dial func(ctx context.Context, network, addr string) (net.Conn, error), roots *x509.CertPool, handshake time.Duration) *http.Transport {
	return &http.Transport{
		Proxy:                 nil,
		DialContext:           dial,
		TLSClientConfig:       &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
		TLSHandshakeTimeout:   handshake,
		MaxIdleConns:          512,
		MaxIdleConnsPerHost:   64,
		IdleConnTimeout:       90 * time.Second,
		ExpectContinueTimeout: time.Second,
		// Bytes pass as the worker sent them, compressed or not.
		DisableCompression: true,
		// HTTP/1.1 upstream keeps "were any bytes written?" answerable per request.
		TLSNextProto: map[string]func(string, *tls.Conn) http.RoundTripper{},
	}
}

// DefaultMaxBody is the largest request body the proxy takes when none is
// set: a body is spooled whole before its guard, so the bound is disk.
const DefaultMaxBody = 256 << 20

// New builds a proxy from cfg and registers its open flows with the watcher.
func New(cfg Config) (*Proxy, error) {
	if cfg.Ledger == nil || cfg.Watcher == nil {
		return nil, errors.New("proxy: a ledger and a run watcher are required")
	}
	if cfg.MaxBody <= 0 {
		cfg.MaxBody = DefaultMaxBody
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = 10 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Telemetry == nil {
		cfg.Telemetry = telemetry.New(telemetry.Options{})
	}
	if cfg.DialContext == nil {
		cfg.DialContext = (&net.Dialer{Timeout: cfg.DialTimeout, KeepAlive: 30 * time.Second}).DialContext
	}
	if cfg.RequireToken && cfg.Tokens == nil {
		return nil, errors.New("proxy: run tokens are required but no token secret is configured")
	}
	if cfg.StoreTimeout <= 0 {
		cfg.StoreTimeout = state.DefaultTimeout
	}
	if cfg.MaxConns <= 0 {
		cfg.MaxConns = DefaultMaxConns
	}
	if cfg.MaxConnsPerRun <= 0 {
		cfg.MaxConnsPerRun = DefaultMaxConnsPerRun
	}
	if cfg.HandshakeTimeout <= 0 {
		cfg.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if cfg.IdleTimeout <= 0 {
		cfg.IdleTimeout = DefaultIdleTimeout
	}
	p := &Proxy{
		cfg: cfg, log: cfg.Logger, tel: cfg.Telemetry,
		flows:  newFlowSet(cfg.Telemetry.Metrics()),
		tokens: tokenCheck{signer: cfg.Tokens, require: cfg.RequireToken},
		limits: &limits{max: cfg.MaxConns, perRun: cfg.MaxConnsPerRun, open: cfg.Telemetry.Metrics().Open.WithLabelValues("exchanges")},
		seen:   newSeenRows(4096),
	}
	p.flows.seen = p.seen
	ctx, cancel := context.WithTimeout(context.Background(), cfg.DialTimeout)
	defer cancel()
	if err := p.SetRules(ctx, cfg.Rules); err != nil {
		return nil, err
	}
	p.upstream = goproxy.RoundTripperFunc(p.roundTrip)
	if cfg.StaticRun != "" {
		if err := state.ValidateRunID(cfg.StaticRun); err != nil {
			return nil, fmt.Errorf("static run: %w", err)
		}
		p.static = &identity{run: cfg.StaticRun, via: "static"}
	}
	p.transport = UpstreamTransport(p.dial, cfg.UpstreamRoots, cfg.DialTimeout)
	gp := goproxy.NewProxyHttpServer()
	gp.Tr = p.transport
	gp.ConnectDial = nil
	gp.ConnectDialWithReq = nil
	gp.KeepAcceptEncoding = true
	gp.Logger = slogPrintf{p.log}
	gp.NonproxyHandler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		refusal.New(refusal.NotAProxyRequest,
			"this is stopgate's egress proxy: send absolute-URI requests or CONNECT (set HTTP_PROXY/HTTPS_PROXY); the control API listens elsewhere",
		).WriteHTTP(w)
	})
	if cfg.CA != nil {
		p.certs = &CertCache{}
	}
	p.tunnels = newConnQueue()
	p.tunnelSrv = newRequestServer(p.serveIntercepted, cfg.IdleTimeout, p.log.With("mode", "tunnel"), func(ctx context.Context, c net.Conn) context.Context {
		if tc, ok := c.(*tls.Conn); ok {
			c = tc.NetConn()
		}
		return context.WithValue(ctx, interceptedKey{}, c)
	})
	go func() { _ = p.tunnelSrv.Serve(p.tunnels) }()
	gp.OnRequest().HandleConnectFunc(p.handleConnect)
	gp.OnRequest().DoFunc(p.handleRequest)
	p.gp = gp
	cfg.Watcher.Add(p.flows)
	return p, nil
}

// ServeHTTP serves proxy traffic.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if local, _ := r.Context().Value(http.LocalAddrContextKey).(net.Addr); local != nil && p.outbound.has(r.RemoteAddr, local) {
		p.refuseEarly(w, r, refusal.New(refusal.DestinationDenied,
			"this request came back to stopgate through its own egress: none of stopgate's listeners is a destination; nothing was sent"))
		return
	}
	s := p.limits.take(p.cfg.HandshakeTimeout, p.cfg.IdleTimeout)
	if s == nil {
		p.refuseEarly(w, r, refusal.New(refusal.TooManyConnections,
			"the proxy holds %d open exchanges, its cap (--max-conns): try again when some have ended; nothing was sent", p.cfg.MaxConns))
		return
	}
	if r.Method == http.MethodConnect {
		// The tunnel outlives ServeHTTP: its client connection frees the slot.
		r = r.WithContext(context.WithValue(r.Context(), slotKey{}, s))
		p.gp.ServeHTTP(&hijackWriter{ResponseWriter: w, slot: s}, r)
		if !s.hijacked {
			s.free()
		}
		return
	}
	defer s.free()
	p.serve(w, r, s)
}

// serve serves a request that is not a CONNECT, counted under the caps in
// s: its own slot, or the tunnel's it was read inside.
func (p *Proxy) serve(w http.ResponseWriter, r *http.Request, s *slot) {
	r = r.WithContext(context.WithValue(r.Context(), slotKey{}, s))
	if r.Body != nil && r.Body != http.NoBody {
		body := &deadlineBody{ReadCloser: r.Body, rc: *http.NewResponseController(w), idle: p.cfg.IdleTimeout}
		r.Body = body
		defer body.bound()
	}
	if r.Header.Get("Upgrade") == "" {
		p.gp.ServeHTTP(w, r)
		return
	}
	// goproxy hijacks the client's connection for an upgrade and never
	// closes it: when the upgraded connection ends (or a cancel cuts its
	// upstream side), we close the client's side.
	uw := &upgradeWriter{ResponseWriter: w}
	p.gp.ServeHTTP(uw, r)
	if uw.conn != nil {
		_ = uw.conn.Close()
	}
}

// ForRun returns the proxy as a handler that binds every request to run,
// whatever run its headers or credentials name (they are stripped): for a
// client that cannot send credentials and must not be able to choose, such
// as a browser launched for the run, whose pages run untrusted scripts.
func (p *Proxy) ForRun(run string) (http.Handler, error) {
	if err := state.ValidateRunID(run); err != nil {
		return nil, fmt.Errorf("bind proxy to run: %w", err)
	}
	bound := &identity{run: run, via: "bound listener", bound: true}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), boundRunKey{}, bound)))
	}), nil
}

type boundRunKey struct{}

// boundRun is the identity a request gets when it names none: the run its
// listener is bound to, else the sidecar's static run.
func (p *Proxy) boundRun(r *http.Request) *identity {
	if id, ok := r.Context().Value(boundRunKey{}).(*identity); ok {
		return id
	}
	return p.static
}

// upgradeWriter remembers the connection goproxy hijacks.
type upgradeWriter struct {
	http.ResponseWriter
	conn net.Conn
}

func (w *upgradeWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	conn, rw, err := http.NewResponseController(w.ResponseWriter).Hijack()
	w.conn = conn
	return conn, rw, err
}

// CutAll cuts every open flow, recording why: for a shutdown, so that what
// was in flight is recorded now rather than when its lease expires.
func (p *Proxy) CutAll(reason string) { p.flows.cutAll(reason) }

// Close closes every intercepted tunnel's connection; open flows are cut
// first by CutAll.
func (p *Proxy) Close() error {
	_ = p.tunnels.Close()
	return p.tunnelSrv.Close()
}

// slogPrintf lets goproxy's warnings reach the structured log.
type slogPrintf struct{ log *slog.Logger }

func (l slogPrintf) Printf(format string, v ...any) {
	l.log.Debug(fmt.Sprintf(format, v...), "component", "goproxy")
}
