package proxy

import (
	"bufio"
	"net"
	"net/netip"
)

// ReadClientHello reads a TLS ClientHello from c (through br) without
// answering it: its server name, and every byte read, to be replayed to
// whoever answers it. stopgate exec uses it to CONNECT by the name a
// sandboxed client asked for, as the transparent listener does.
func ReadClientHello(c net.Conn, br *bufio.Reader) (sni string, read []byte, err error) {
	return readClientHello(c, br)
}

// LooksLikeHTTP reports whether br starts with an HTTP request line's
// method and space, waiting for those bytes.
func LooksLikeHTTP(br *bufio.Reader) bool { return looksLikeHTTP(br) }

// IsTLSRecord reports whether b starts a TLS handshake record.
func IsTLSRecord(b byte) bool { return b == tlsRecordHandshake }

// OriginalDst is where a connection redirected by iptables REDIRECT was
// going (SO_ORIGINAL_DST), read in the network namespace of its socket.
func OriginalDst(c net.Conn) (netip.AddrPort, error) { return originalDst(c) }
