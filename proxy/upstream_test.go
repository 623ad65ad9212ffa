package proxy

import (
	"net"
	"net/netip"
	"testing"
)

// TestOutboundSetKnowsAConnectionByBothEnds: a request is ours come back
// only if it arrives on the far end of one of our upstream connections.
// The kernel gives the same source port to connections to different
// destinations, so a client sharing an upstream connection's port (but
// reaching another address) is a client, not a loop.
func TestOutboundSetKnowsAConnectionByBothEnds(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		if c, err := ln.Accept(); err == nil {
			defer c.Close()
			_, _ = c.Read(make([]byte, 1))
		}
	}()
	raw, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	var set outboundSet
	c := set.track(raw)
	local, remote := raw.LocalAddr().String(), raw.RemoteAddr()
	mapped := tcpAddr(t, "[::ffff:"+remote.(*net.TCPAddr).IP.String()+"]:"+portOf(t, remote.String()))
	for _, tc := range []struct {
		name    string
		from    string
		arrived net.Addr
		want    bool
	}{
		{"the far end of our own connection", local, remote, true},
		{"the same, seen through an IPv6 socket", local, mapped, true},
		{"the same, named by a string", local, stringAddr(remote.String()), true},
		{"the same source port, another listener", local, tcpAddr(t, "127.0.0.1:1"), false},
		{"another source port, the same listener", "127.0.0.1:1", remote, false},
		{"not an address", "pipe", remote, false},
		{"not a TCP listener", local, &net.UnixAddr{Name: "/tmp/s", Net: "unix"}, false},
	} {
		if got := set.has(tc.from, tc.arrived); got != tc.want {
			t.Errorf("%s: has(%s, %s) = %v, want %v", tc.name, tc.from, tc.arrived, got, tc.want)
		}
	}
	c.Close()
	if set.has(local, remote) {
		t.Errorf("a closed connection is still known")
	}
}

func tcpAddr(t *testing.T, s string) net.Addr {
	t.Helper()
	ap, err := netip.ParseAddrPort(s)
	if err != nil {
		t.Fatal(err)
	}
	return net.TCPAddrFromAddrPort(ap)
}

// stringAddr is an address known only by its String, as a listener that
// is not net's TCP listener may report it.
type stringAddr string

func (a stringAddr) Network() string { return "tcp" }
func (a stringAddr) String() string  { return string(a) }

func portOf(t *testing.T, hostport string) string {
	t.Helper()
	_, port, err := net.SplitHostPort(hostport)
	if err != nil {
		t.Fatal(err)
	}
	return port
}
