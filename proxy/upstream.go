package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
)

// targetKey carries the destination a request was checked for to the dial
// its round trip makes, so that the address dialled is the address checked:
// no second lookup between the check and the dial for DNS to answer
// differently. Only the proxy sets it; nothing a client sends can.
type targetKey struct{}

// withTarget carries t by its address (an exchange's, which lives as long
// as the request), so that a request boxes no copy of it: t must not
// change once it is in a context, as the dial reads it on the transport's
// goroutine.
func withTarget(ctx context.Context, t *target) context.Context {
	return context.WithValue(ctx, targetKey{}, t)
}

func targetOf(ctx context.Context) (target, bool) {
	t, ok := ctx.Value(targetKey{}).(*target)
	if !ok {
		return target{}, false
	}
	return *t, true
}

// dial is the one function every upstream connection goes through: plain
// and intercepted requests, pass-through tunnels, the browser's egress, in
// proxy and transparent mode. It dials the addresses its request's check
// resolved; a dial that carries no
// check (or one for another host) is checked here, so no path reaches an
// address the rules refuse, even one that skipped the check before its guard.
func (p *Proxy) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	// A redirected connection goes to its original destination, whatever
	// name it carries: that address is the one checked, and dialled.
	addr = checkedAddr(ctx, addr)
	t, ok := targetOf(ctx)
	if !ok || t.addrs == nil || !strings.EqualFold(t.hostport, addr) {
		// The rules the request was checked under, if it was.
		dests := p.current().dests
		if ok && t.by != nil {
			dests = t.by
		}
		checked := new(target)
		if err := dests.check(ctx, addr, checked); err != nil {
			return nil, err
		}
		t = *checked
	}
	var errs []error
	for _, ap := range t.addrs {
		conn, err := p.cfg.DialContext(ctx, network, ap.String())
		if err == nil {
			return p.outbound.track(conn), nil
		}
		errs = append(errs, err)
		if ctx.Err() != nil {
			break
		}
	}
	return nil, fmt.Errorf("dial %s: %w", addr, errors.Join(errs...))
}

// outboundSet knows the two ends of the proxy's open upstream connections.
// A request that arrives on one of them went out through the proxy and
// came back to a listener of this process: an agent aiming the proxy at a
// listener that is not in the protected list (a browser's run-bound egress
// listener, say), to speak as another run. Both ends are compared: the
// kernel reuses a source port for connections to other destinations, so a
// client's connection to the proxy may well share its port with an
// upstream connection of the proxy.
type outboundSet struct {
	mu    sync.Mutex
	conns map[connEnds]struct{}
}

// connEnds is a TCP connection's two addresses, as its dialler sees them.
type connEnds struct{ local, remote netip.AddrPort }

// endsOf normalizes two addresses (an IPv4 address seen through an IPv6
// socket is the IPv4 one); ok is false for anything but IP:port.
func endsOf(local, remote net.Addr) (connEnds, bool) {
	l, ok1 := addrPortOf(local)
	r, ok2 := addrPortOf(remote)
	if !ok1 || !ok2 {
		return connEnds{}, false
	}
	return connEnds{local: unmapped(l), remote: unmapped(r)}, true
}

// addrPortOf is a TCP address as a netip.AddrPort, read from the address
// itself rather than from its String: the proxy asks this of every request.
func addrPortOf(a net.Addr) (netip.AddrPort, bool) {
	if t, ok := a.(*net.TCPAddr); ok {
		ap := t.AddrPort()
		return ap, ap.Addr().IsValid()
	}
	ap, err := netip.ParseAddrPort(a.String())
	return ap, err == nil
}

func unmapped(a netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(a.Addr().Unmap(), a.Port())
}

func (s *outboundSet) track(c net.Conn) net.Conn {
	ends, ok := endsOf(c.LocalAddr(), c.RemoteAddr())
	if !ok {
		return c
	}
	s.mu.Lock()
	if s.conns == nil {
		s.conns = map[connEnds]struct{}{}
	}
	s.conns[ends] = struct{}{}
	s.mu.Unlock()
	return &trackedConn{Conn: c, done: func() {
		s.mu.Lock()
		delete(s.conns, ends)
		s.mu.Unlock()
	}}
}

// has reports whether a connection accepted from remote on local (a
// request's RemoteAddr, and the listener address it reached) is one of the
// proxy's own upstream connections, seen from its other end.
func (s *outboundSet) has(remote string, local net.Addr) bool {
	r, err := netip.ParseAddrPort(remote)
	l, ok := addrPortOf(local)
	if err != nil || !ok {
		return false
	}
	// Seen from this end, the client's address is the upstream
	// connection's local end.
	ends := connEnds{local: unmapped(r), remote: unmapped(l)}
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok = s.conns[ends]
	return ok
}

// trackedConn leaves the outbound set when it is closed.
type trackedConn struct {
	net.Conn
	once sync.Once
	done func()
}

func (c *trackedConn) Close() error {
	c.once.Do(c.done)
	return c.Conn.Close()
}

// CloseWrite half-closes, as a pass-through tunnel does when one side ends.
func (c *trackedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.Close()
}
