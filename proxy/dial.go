package proxy

import (
	"context"
	"net"
	"net/netip"
)

// dialPinKey carries the address an upstream connection must go to, whatever
// name the request carries: in transparent mode, the original destination the
// kernel recorded for the redirected connection. Only stopgate's own code
// sets it; nothing a client sends can.
type dialPinKey struct{}

func withDialPin(ctx context.Context, addr netip.AddrPort) context.Context {
	return context.WithValue(ctx, dialPinKey{}, addr)
}

func dialPin(ctx context.Context) (netip.AddrPort, bool) {
	addr, ok := ctx.Value(dialPinKey{}).(netip.AddrPort)
	return addr, ok
}

// dial is the one function every upstream connection goes through: plain
// and intercepted requests, pass-through tunnels, in proxy and transparent
// mode. The address it dials is the address that must be checked, so a
// destination check belongs here and nowhere else.
func (p *Proxy) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	if pin, ok := dialPin(ctx); ok {
		addr = pin.String()
	}
	return p.cfg.DialContext(ctx, network, addr)
}
