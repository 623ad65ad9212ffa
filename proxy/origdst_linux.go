package proxy

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"syscall"
	"unsafe"
)

// soOriginalDst is SO_ORIGINAL_DST (netfilter_ipv4.h) and, at SOL_IPV6,
// IP6T_SO_ORIGINAL_DST (ip6_tables.h): both are 80.
const soOriginalDst = 80

// originalDst is where the client meant to connect before the kernel's
// REDIRECT sent the connection to us: the conntrack entry's original
// destination, read with getsockopt(SO_ORIGINAL_DST).
func originalDst(c net.Conn) (netip.AddrPort, error) {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return netip.AddrPort{}, fmt.Errorf("original destination: %T is not a TCP connection", c)
	}
	local, ok := tc.LocalAddr().(*net.TCPAddr)
	if !ok {
		return netip.AddrPort{}, errors.New("original destination: no local TCP address")
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("original destination: %w", err)
	}
	v4 := local.IP.To4() != nil
	var buf [28]byte // sizeof(struct sockaddr_in6); a sockaddr_in is 16
	size := uint32(16)
	level := syscall.SOL_IP
	if !v4 {
		size, level = 28, syscall.SOL_IPV6
	}
	var errno syscall.Errno
	if err := raw.Control(func(fd uintptr) {
		_, _, errno = syscall.Syscall6(syscall.SYS_GETSOCKOPT, fd, uintptr(level), soOriginalDst,
			uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&size)), 0)
	}); err != nil {
		return netip.AddrPort{}, fmt.Errorf("original destination: %w", err)
	}
	if errno != 0 {
		return netip.AddrPort{}, fmt.Errorf("original destination (getsockopt SO_ORIGINAL_DST): %w: was the connection redirected by iptables, with conntrack loaded?", errno)
	}
	// Both layouts: family (2 bytes, host order), port (2 bytes, network order), then the address.
	port := binary.BigEndian.Uint16(buf[2:4])
	if v4 {
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte(buf[4:8])), port), nil
	}
	// sockaddr_in6: flowinfo at 4–7, the address at 8–23.
	return netip.AddrPortFrom(netip.AddrFrom16([16]byte(buf[8:24])).Unmap(), port), nil
}
