package proxy

import (
	"context"
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

// checkedAddr is the address a request must be checked for: the original
// destination when the kernel redirected its connection (the address that
// will be dialled, whatever name the request carries), else hostport.
func checkedAddr(ctx context.Context, hostport string) string {
	if pin, ok := dialPin(ctx); ok {
		return pin.String()
	}
	return hostport
}
