package agentexec

import (
	"encoding/binary"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// loopbackUp sets IFF_UP on lo, as `ip link set lo up` does.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("bring up lo: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("bring up lo: SIOCGIFFLAGS: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("bring up lo: SIOCSIFFLAGS: %w", err)
	}
	return nil
}

// loopbackIndex is lo's interface index in every network namespace
// (LOOPBACK_IFINDEX).
const loopbackIndex = 1

// routeAllToLoopback adds `default dev lo` to the main IPv4 table (what
// `ip route add default dev lo` does), so that a connection to any address
// reaches netfilter's OUTPUT chain, and so the redirect, instead of failing
// at connect() with no route; what nothing redirects stays on the
// namespace's own loopback.
func routeAllToLoopback() error {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("route to lo: netlink: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fmt.Errorf("route to lo: netlink bind: %w", err)
	}
	rt := unix.RtMsg{
		Family: unix.AF_INET, Table: unix.RT_TABLE_MAIN, Protocol: unix.RTPROT_BOOT,
		Scope: unix.RT_SCOPE_LINK, Type: unix.RTN_UNICAST,
	}
	// Out of lo, with 127.0.0.1 as the source: without one, a datagram to
	// an address no interface has leaves from 0.0.0.0, and its answer has
	// nowhere to go.
	attr := make([]byte, 16)
	binary.NativeEndian.PutUint16(attr[0:2], 8)
	binary.NativeEndian.PutUint16(attr[2:4], unix.RTA_OIF)
	binary.NativeEndian.PutUint32(attr[4:8], loopbackIndex)
	binary.NativeEndian.PutUint16(attr[8:10], 8)
	binary.NativeEndian.PutUint16(attr[10:12], unix.RTA_PREFSRC)
	copy(attr[12:16], []byte{127, 0, 0, 1})
	body := append(unsafe.Slice((*byte)(unsafe.Pointer(&rt)), unix.SizeofRtMsg), attr...)
	hdr := unix.NlMsghdr{
		Len: uint32(unix.SizeofNlMsghdr + len(body)), Type: unix.RTM_NEWROUTE,
		Flags: unix.NLM_F_REQUEST | unix.NLM_F_ACK | unix.NLM_F_CREATE | unix.NLM_F_EXCL, Seq: 1,
	}
	msg := append(unsafe.Slice((*byte)(unsafe.Pointer(&hdr)), unix.SizeofNlMsghdr), body...)
	if err := unix.Sendto(fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fmt.Errorf("route to lo: %w", err)
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(fd, buf, 0)
	if err != nil {
		return fmt.Errorf("route to lo: reading the answer: %w", err)
	}
	if n < unix.SizeofNlMsghdr+4 {
		return fmt.Errorf("route to lo: short answer (%d bytes)", n)
	}
	if typ := binary.NativeEndian.Uint16(buf[4:6]); typ != unix.NLMSG_ERROR {
		return fmt.Errorf("route to lo: answer of type %d, want an acknowledgement", typ)
	}
	if code := int32(binary.NativeEndian.Uint32(buf[unix.SizeofNlMsghdr:])); code != 0 {
		return fmt.Errorf("route to lo: %w", unix.Errno(-code))
	}
	return nil
}
