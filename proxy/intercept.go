package proxy

// Intercepted tunnels: a CONNECT to a host that is not pass-through is
// answered 200 and its connection is terminated here (TLS with a
// certificate minted by the proxy's CA, or plain HTTP), and every request
// read from it is served as an absolute-URI proxy request. The requests are
// read by a net/http server configured as the proxy's own listener is
// (ClientLimits), so a client gets the same bounds inside a tunnel as
// outside it: 431 for headers past MaxHeaderBytes, headers that must arrive
// within ReadHeaderTimeout, an idle tunnel let go after IdleTimeout.

import (
	"bufio"
	"context"
	"crypto/tls"
	"io"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/stopgate/stopgate/refusal"
)

// ClientLimits bound what a client may send to be read as a request, on
// every listener and connection whose requests the proxy reads: the proxy
// listener (serve's server), intercepted tunnels and transparent
// connections.
const (
	// MaxHeaderBytes bounds a request's line and headers; past it the
	// answer is 431 and the connection is closed.
	MaxHeaderBytes = 64 << 10
	// ReadHeaderTimeout bounds the time from a request's first byte to the
	// end of its headers, so that headers trickled a byte at a time cannot
	// hold a connection.
	ReadHeaderTimeout = 5 * time.Second
	// KeepAliveTimeout bounds the silence between two requests of one
	// connection to the proxy listener; inside a tunnel and on a
	// redirected connection the proxy's idle timeout does (Config.IdleTimeout).
	KeepAliveTimeout = DefaultIdleTimeout
)

// newRequestServer is a net/http server that reads requests from
// connections handed to it (queue), under ClientLimits and the proxy's
// idle timeout between requests, and serves them with h. HTTP/1.1 only, as towards the upstream: "were any bytes
// written?" stays answerable per request. connCtx puts what the handler
// must know of a connection into its requests' context.
func newRequestServer(h http.HandlerFunc, idle time.Duration, log *slog.Logger, connCtx func(context.Context, net.Conn) context.Context) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: ReadHeaderTimeout,
		IdleTimeout:       idle,
		MaxHeaderBytes:    MaxHeaderBytes,
		ConnContext:       connCtx,
		TLSNextProto:      map[string]func(*http.Server, *tls.Conn, http.Handler){},
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelDebug),
	}
}

// interceptedConn is the client side of an intercepted tunnel: what its
// requests are read from, the host its CONNECT named, and the CONNECT's
// exchange (its identity, its slot under the caps).
type interceptedConn struct {
	net.Conn
	r      io.Reader
	host   string
	tls    bool
	tunnel *exchange
}

func (c *interceptedConn) Read(b []byte) (int, error) { return c.r.Read(b) }

type interceptedKey struct{}

func interceptedOf(ctx context.Context) *interceptedConn {
	c, _ := ctx.Value(interceptedKey{}).(*interceptedConn)
	return c
}

// tunnelOf is the CONNECT exchange a request was read inside, nil for a
// request sent to the proxy itself.
func tunnelOf(ctx context.Context) *exchange {
	if c := interceptedOf(ctx); c != nil {
		return c.tunnel
	}
	return nil
}

// intercept takes over the connection of an admitted, intercepted CONNECT:
// the client's first byte must come within the handshake timeout, and a
// TLS client must finish its handshake by then; from there on the request
// server bounds every read. client frees the CONNECT's slot when it closes.
func (p *Proxy) intercept(client net.Conn, host string, ex *exchange) {
	if ex.slot != nil {
		// The request server sets the connection's deadlines itself.
		ex.slot.mode.Store(readOwn)
	}
	handshakeBy := time.Now().Add(p.cfg.HandshakeTimeout)
	if ex.slot != nil {
		handshakeBy = ex.slot.handshakeBy
	}
	if _, err := io.WriteString(client, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		_ = client.Close()
		return
	}
	_ = client.SetReadDeadline(handshakeBy)
	br := bufio.NewReader(client)
	first, err := br.Peek(1)
	if err != nil {
		p.log.Debug("intercepted tunnel closed before its first byte", "host", host, "err", err)
		_ = client.Close()
		return
	}
	ic := &interceptedConn{Conn: client, r: br, host: host, tunnel: ex}
	var c net.Conn = ic
	if first[0] == tlsRecordHandshake {
		ic.tls = true
		name, _, err := net.SplitHostPort(host)
		if err != nil {
			name = host
		}
		tc := tls.Server(ic, p.mitmConfig(name))
		if err := tc.Handshake(); err != nil {
			p.log.Debug("intercepted tunnel: the client's TLS handshake failed", "host", host, "err", err)
			_ = tc.Close()
			return
		}
		c = tc
	}
	_ = client.SetReadDeadline(time.Time{})
	if !p.tunnels.hand(c) {
		_ = c.Close()
	}
}

// refuseInnerConnect answers a CONNECT read on a connection that already
// goes through the guard (where says which): a tunnel opened from inside
// it would carry requests the guard never reads.
func refuseInnerConnect(w http.ResponseWriter, where string) {
	refusal.New(refusal.NotATransparentRequest,
		"CONNECT %s: this connection already goes through stopgate's guard; tunnelling through another proxy is refused", where,
	).WriteHTTP(w)
}

// serveIntercepted serves one request read inside an intercepted tunnel:
// its target is made absolute (the request's own Host, else the CONNECT's
// host) and it is served as any proxy request, in the tunnel's slot.
func (p *Proxy) serveIntercepted(w http.ResponseWriter, r *http.Request) {
	ic := interceptedOf(r.Context())
	if ic == nil {
		refusal.New(refusal.Internal, "intercepted connection lost its tunnel").WriteHTTP(w)
		return
	}
	if r.Method == http.MethodConnect {
		refuseInnerConnect(w, "inside a tunnel through stopgate")
		return
	}
	scheme := "http"
	if ic.tls {
		scheme = "https"
	}
	u := *r.URL
	if !u.IsAbs() {
		u.Host = cmpOr(r.Host, ic.host)
	}
	u.Scheme, u.User = scheme, nil
	r.URL = &u
	if r.Host == "" {
		r.Host = u.Host
	}
	p.serve(w, r, ic.tunnel.slot)
}

// mitmConfig presents, for the name the client asked for (fallback when it
// names none), a certificate minted by the proxy's CA.
func (p *Proxy) mitmConfig(fallback string) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		NextProtos: []string{"http/1.1"},
		GetCertificate: func(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
			return p.mitmCert(cmpOr(hello.ServerName, fallback))
		},
	}
}
