package agentexec

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/dns/dnsmessage"

	"github.com/stopgate/stopgate/proxy"
)

// The carrier is exec's side of the sandbox: it takes every TCP connection
// CMD opens (accepted on the sandbox's listener, from outside) and carries
// it to stopgate's egress proxy as a CONNECT under the run, bound to it, so
// that each request inside is guarded exactly as through the proxy: TLS is
// intercepted by the name the client asked for (its SNI), plain HTTP is
// read request by request, and the address dialled is the proxy's own
// resolution of that name (or the original address, when there is no
// name). Nothing else is carried: a connection that starts with neither a
// ClientHello nor a request line is closed and noted in the run's audit.

const (
	// sniffTimeout bounds how long a client may take to send its first
	// bytes (the proxy's transparent listener waits as long).
	sniffTimeout = 10 * time.Second
	// proxyDialTimeout bounds reaching the proxy and reading its answer to
	// the CONNECT.
	proxyDialTimeout = 10 * time.Second
	// dnsTimeout bounds one resolver's answer to one query.
	dnsTimeout = 3 * time.Second
	// maxDNSInFlight bounds the queries carried at once; past it a query
	// is dropped, as a busy resolver would.
	maxDNSInFlight = 64
	// maxRefusalNotes bounds the refused connections noted in the audit;
	// past it they are counted on stderr only (a port scan must not fill
	// the record).
	maxRefusalNotes = 32
)

type carrier struct {
	proxyAddr string
	// auth is the CONNECT's Proxy-Authorization: the run and its password
	// (a run token, or the cancel version observed).
	auth     string
	resolver []netip.AddrPort
	// note records a refused connection in the run's audit.
	note    func(kind, reason string)
	warn    func(format string, args ...any)
	refused atomic.Int64
	conns   sync.WaitGroup
}

func basicAuth(user, pass string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+pass))
}

// serveTCP carries every connection accepted on ln until ln is closed.
func (c *carrier) serveTCP(ln net.Listener) {
	for {
		conn, err := ln.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				c.warn("the sandbox's listener failed: %v (CMD's connections are refused from now on)", err)
			}
			return
		}
		c.conns.Go(func() { c.carry(conn) })
	}
}

func (c *carrier) refuse(od netip.AddrPort, why string) {
	n := c.refused.Add(1)
	reason := fmt.Sprintf("tcp://%s refused: %s", od, why)
	if n <= maxRefusalNotes {
		c.note("exec.refused_connection", reason)
		return
	}
	if n == maxRefusalNotes+1 {
		c.warn("more than %d connections refused; the rest are not noted in the audit (last: %s)", maxRefusalNotes, reason)
	}
}

// carry hands one connection of CMD to the proxy.
func (c *carrier) carry(conn net.Conn) {
	defer conn.Close()
	od, err := proxy.OriginalDst(conn)
	if err != nil {
		c.refuse(netip.AddrPort{}, err.Error())
		return
	}
	if local, err := netip.ParseAddrPort(conn.LocalAddr().String()); err == nil && local == od {
		c.refuse(od, "a connection to the sandbox's own listener")
		return
	}
	_ = conn.SetReadDeadline(time.Now().Add(sniffTimeout))
	br := bufio.NewReader(conn)
	first, err := br.Peek(1)
	if err != nil {
		c.refuse(od, fmt.Sprintf("the client sent nothing within %s (%v): only HTTP and TLS are carried, so protocols where the server speaks first are refused", sniffTimeout, err))
		return
	}
	target := od.String()
	var replay io.Reader = br
	isTLS := proxy.IsTLSRecord(first[0])
	if isTLS {
		sni, read, err := proxy.ReadClientHello(conn, br)
		if err != nil {
			c.refuse(od, err.Error())
			return
		}
		if sni != "" {
			// The proxy mints its certificate for, and checks the upstream's
			// against, the name the CONNECT names.
			target = net.JoinHostPort(sni, strconv.Itoa(int(od.Port())))
		}
		replay = io.MultiReader(bytes.NewReader(read), br)
	} else if !proxy.LooksLikeHTTP(br) {
		b, _ := br.Peek(min(br.Buffered(), 16))
		c.refuse(od, fmt.Sprintf("the first bytes are neither a TLS ClientHello nor an HTTP request line (%q)", b))
		return
	}
	_ = conn.SetReadDeadline(time.Time{})

	up, upr, resp, err := c.connect(target)
	if err != nil {
		c.warn("carrying a connection to %s: %v", target, err)
		if !isTLS {
			writeUnavailable(conn, err)
		}
		return
	}
	defer up.Close()
	if resp.StatusCode != http.StatusOK {
		// Refused at the CONNECT (a destination stopgate does not allow, say):
		// an HTTP client reads the proxy's answer as the upstream's; a TLS
		// client cannot read one, and is closed.
		if !isTLS {
			_ = resp.Write(conn)
		}
		_ = resp.Body.Close()
		return
	}
	done := make(chan struct{})
	go func() {
		_, _ = io.Copy(up, replay)
		closeWrite(up)
		close(done)
	}()
	_, _ = io.Copy(conn, upr)
	closeWrite(conn)
	<-done
}

// connect opens a CONNECT to target through the proxy, bound to the run.
func (c *carrier) connect(target string) (net.Conn, *bufio.Reader, *http.Response, error) {
	ctx, cancel := context.WithTimeout(context.Background(), proxyDialTimeout)
	defer cancel()
	var d net.Dialer
	up, err := d.DialContext(ctx, "tcp", c.proxyAddr)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("reaching stopgate's proxy at %s: %w", c.proxyAddr, err)
	}
	_ = up.SetDeadline(time.Now().Add(proxyDialTimeout))
	req := "CONNECT " + target + " HTTP/1.1\r\nHost: " + target + "\r\nProxy-Authorization: " + c.auth + "\r\n" + proxy.HeaderBindTunnel + ": 1\r\n\r\n"
	if _, err := io.WriteString(up, req); err != nil {
		_ = up.Close()
		return nil, nil, nil, fmt.Errorf("sending the CONNECT to %s: %w", c.proxyAddr, err)
	}
	upr := bufio.NewReader(up)
	resp, err := http.ReadResponse(upr, &http.Request{Method: http.MethodConnect})
	if err != nil {
		_ = up.Close()
		return nil, nil, nil, fmt.Errorf("reading the proxy's answer to CONNECT %s: %w", target, err)
	}
	_ = up.SetDeadline(time.Time{})
	return up, upr, resp, nil
}

// writeUnavailable answers a plain-HTTP client whose connection could not
// be carried: 503, never an unguarded request.
func writeUnavailable(w io.Writer, err error) {
	body := fmt.Sprintf(`{"error":"store_unavailable","message":%q}`, "stopgate exec could not carry this connection to stopgate's proxy: "+err.Error()+"; nothing was sent")
	_, _ = fmt.Fprintf(w, "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(body), body)
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		return
	}
	_ = c.Close()
}

// serveDNS carries the DNS queries CMD sends to its nameservers (the
// sandbox's rules send them to pc) to the resolvers exec names, one
// well-formed query at a time: anything that does not parse as a query
// with one question is dropped, so the socket is DNS, not a way out.
func (c *carrier) serveDNS(pc net.PacketConn) {
	sem := make(chan struct{}, maxDNSInFlight)
	buf := make([]byte, 65535)
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			return
		}
		if !isQuery(buf[:n]) {
			continue
		}
		select {
		case sem <- struct{}{}:
		default:
			continue
		}
		q := append([]byte(nil), buf[:n]...)
		go func() {
			defer func() { <-sem }()
			if ans := c.resolve(q); ans != nil {
				_, _ = pc.WriteTo(ans, from)
			}
		}()
	}
}

// resolve asks each resolver in turn, and returns the first answer that
// answers q (same id).
func (c *carrier) resolve(q []byte) []byte {
	for _, r := range c.resolver {
		conn, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(r))
		if err != nil {
			continue
		}
		_ = conn.SetDeadline(time.Now().Add(dnsTimeout))
		if _, err := conn.Write(q); err != nil {
			_ = conn.Close()
			continue
		}
		ans := make([]byte, 65535)
		for {
			n, err := conn.Read(ans)
			if err != nil {
				break
			}
			if n >= 2 && ans[0] == q[0] && ans[1] == q[1] {
				_ = conn.Close()
				return ans[:n]
			}
		}
		_ = conn.Close()
	}
	return nil
}

// isQuery reports whether b is a DNS query with exactly one question.
func isQuery(b []byte) bool {
	var p dnsmessage.Parser
	h, err := p.Start(b)
	if err != nil || h.Response || h.OpCode != 0 {
		return false
	}
	qs, err := p.AllQuestions()
	return err == nil && len(qs) == 1
}
