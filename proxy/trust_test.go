package proxy_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/proxy"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/state"
)

// These tests try the proxy as the agent behind it might, if it were
// prompt-injected: aim it at stopgate itself, at metadata and private
// addresses, send it broken and hostile requests, hold its connections.

func basicAuth(userpass string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(userpass))
}

// names resolves the names in m to their addresses, and nothing else.
func names(m map[string]string) func(context.Context, string) ([]netip.Addr, error) {
	return func(_ context.Context, host string) ([]netip.Addr, error) {
		a, ok := m[host]
		if !ok {
			return nil, fmt.Errorf("no such host %s", host)
		}
		return []netip.Addr{netip.MustParseAddr(a)}, nil
	}
}

// raw is one client connection to the proxy, spoken to byte by byte.
type raw struct {
	t    *testing.T
	conn net.Conn
	r    *bufio.Reader
}

func (e *env) raw(t *testing.T) *raw {
	t.Helper()
	conn, err := net.DialTimeout("tcp", e.server.Listener.Addr().String(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	// No exchange of these tests may take this long; a hang fails, it does not wait.
	_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
	return &raw{t: t, conn: conn, r: bufio.NewReader(conn)}
}

func (c *raw) send(s string) {
	c.t.Helper()
	if _, err := io.WriteString(c.conn, s); err != nil {
		c.t.Fatalf("send: %v", err)
	}
}

// answer reads one response to method and its whole body.
func (c *raw) answer(method string) (*http.Response, []byte) {
	c.t.Helper()
	resp, err := http.ReadResponse(c.r, &http.Request{Method: method})
	if err != nil {
		c.t.Fatalf("read the answer: %v", err)
	}
	defer resp.Body.Close()
	var body []byte
	if method != http.MethodConnect || resp.StatusCode != 200 {
		body, _ = io.ReadAll(resp.Body)
	}
	return resp, body
}

// connect sends a CONNECT with the given extra header lines and reads the answer.
func (c *raw) connect(host, headers string) *http.Response {
	c.t.Helper()
	c.send(fmt.Sprintf("CONNECT %s HTTP/1.1\r\nHost: %s\r\n%s\r\n", host, host, headers))
	resp, _ := c.answer(http.MethodConnect)
	return resp
}

// intercepted starts TLS with the proxy inside an accepted CONNECT,
// trusting the proxy's CA, and speaks inside it from then on.
func (c *raw) intercepted(e *env, serverName string) *tls.Conn {
	c.t.Helper()
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(e.ca.PEM)
	// Bytes the CONNECT answer's reader already took belong to the TLS stream.
	tc := tls.Client(&bufferedConn{Conn: c.conn, r: c.r}, &tls.Config{RootCAs: pool, ServerName: serverName})
	if err := tc.Handshake(); err != nil {
		c.t.Fatalf("TLS inside the tunnel: %v", err)
	}
	c.conn, c.r = tc, bufio.NewReader(tc)
	return tc
}

type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (b *bufferedConn) Read(p []byte) (int, error) { return b.r.Read(p) }

func wantRefusal(t *testing.T, what string, resp *http.Response, body []byte, status int, code refusal.Code) refusalBody {
	t.Helper()
	var r refusalBody
	if err := json.Unmarshal(body, &r); err != nil || resp.StatusCode != status || r.Error != string(code) || resp.Header.Get(refusal.Header) != string(code) {
		t.Fatalf("%s: %d %s, want %d %s", what, resp.StatusCode, body, status, code)
	}
	return r
}

func TestDestinationsAreRefusedInEveryMode(t *testing.T) {
	reg := prometheus.NewRegistry()
	up := newUpstream(t, false, nil)
	tlsUp := newUpstream(t, true, nil)
	_, upPort, _ := net.SplitHostPort(up.Listener.Addr().String())
	e := newEnv(t, envOptions{asShipped: true, registry: reg,
		passThrough: []string{"tunnel.test"}, allowDest: []string{"public.test"},
		resolve: names(map[string]string{"tunnel.test": "127.0.0.1", "meta.test": "169.254.169.254", "public.test": "127.0.0.1"}),
	})
	e.admit("agent")
	auth := "Proxy-Authorization: " + basicAuth("agent:1") + "\r\n"
	recorded := func(t *testing.T, r refusalBody) {
		t.Helper()
		if r.Recorded != "CANCELLED_BEFORE_DISPATCH" || r.RunID != "agent" {
			t.Fatalf("refusal not recorded: %+v", r)
		}
		if in := e.intent("agent", r.Intent); in.State != state.IntentCancelledBeforeDispatch || in.Reason != "destination_denied" || in.Attempts != 0 {
			t.Fatalf("recorded as %+v", in)
		}
	}

	t.Run("plain HTTP to loopback", func(t *testing.T) {
		resp, body := do(t, e.client("agent", 1), "POST", up.URL+"/charge", strings.NewReader("x"), nil)
		r := wantRefusal(t, "plain", resp, body, 403, refusal.DestinationDenied)
		recorded(t, r)
		// Refused before its body is read: named by its URL alone.
		if want := intents.DerivedKey("agent", "POST", up.URL+"/charge", ""); r.Intent != want {
			t.Fatalf("recorded under %s, want %s", r.Intent, want)
		}
	})
	t.Run("CONNECT to an intercepted loopback host", func(t *testing.T) {
		c := e.raw(t)
		c.send(fmt.Sprintf("CONNECT %s HTTP/1.1\r\nHost: x\r\n%s\r\n", tlsUp.Listener.Addr(), auth))
		resp, body := c.answer(http.MethodConnect)
		recorded(t, wantRefusal(t, "CONNECT", resp, body, 403, refusal.DestinationDenied))
	})
	t.Run("pass-through CONNECT resolving to loopback", func(t *testing.T) {
		c := e.raw(t)
		c.send(fmt.Sprintf("CONNECT tunnel.test:%s HTTP/1.1\r\nHost: x\r\n%s\r\n", upPort, auth))
		resp, body := c.answer(http.MethodConnect)
		recorded(t, wantRefusal(t, "pass-through", resp, body, 403, refusal.DestinationDenied))
	})
	t.Run("a name resolving to the metadata address", func(t *testing.T) {
		resp, body := do(t, e.client("agent", 1), "GET", "http://meta.test/latest/meta-data/", nil, nil)
		r := wantRefusal(t, "metadata", resp, body, 403, refusal.DestinationDenied)
		recorded(t, r)
		if !strings.Contains(r.Message, "169.254.169.254") || !strings.Contains(r.Message, "link-local") {
			t.Fatalf("the message does not say why: %s", r.Message)
		}
	})
	t.Run("inside an allowed tunnel, a request naming another host", func(t *testing.T) {
		c := e.raw(t)
		if resp := c.connect("public.test:443", auth); resp.StatusCode != 200 {
			t.Fatalf("CONNECT to an allowed host: %d", resp.StatusCode)
		}
		c.intercepted(e, "public.test")
		c.send(fmt.Sprintf("POST /charge HTTP/1.1\r\nHost: %s\r\nContent-Length: 1\r\n\r\nx", tlsUp.Listener.Addr()))
		resp, body := c.answer("POST")
		recorded(t, wantRefusal(t, "inside the tunnel", resp, body, 403, refusal.DestinationDenied))
	})
	t.Run("the browser's egress", func(t *testing.T) {
		h, err := e.proxy.ForRun("browser")
		if err != nil {
			t.Fatal(err)
		}
		bound := httptest.NewServer(h)
		defer bound.Close()
		bu, _ := url.Parse(bound.URL)
		c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{Proxy: http.ProxyURL(bu)}}
		resp, body := do(t, c, "GET", up.URL+"/", nil, nil)
		r := wantRefusal(t, "browser", resp, body, 403, refusal.DestinationDenied)
		if in := e.intent("browser", r.Intent); in.State != state.IntentCancelledBeforeDispatch || in.Reason != "destination_denied" {
			t.Fatalf("browser's refusal recorded as %+v", in)
		}
	})
	t.Run("without a run identity: refused, counted, recorded nowhere", func(t *testing.T) {
		c := e.raw(t)
		c.send(fmt.Sprintf("CONNECT %s HTTP/1.1\r\nHost: x\r\n\r\n", tlsUp.Listener.Addr()))
		resp, body := c.answer(http.MethodConnect)
		if r := wantRefusal(t, "anonymous CONNECT", resp, body, 403, refusal.DestinationDenied); r.Intent != "" || r.Recorded != "" {
			t.Fatalf("an anonymous refusal says it was recorded: %+v", r)
		}
	})
	if n := up.Hits.Load() + tlsUp.Hits.Load(); n != 0 {
		t.Fatalf("refused destinations were reached %d times", n)
	}
	if got := counter(t, reg, "stopgate_refusals_total", "destination_denied"); got != 7 {
		t.Fatalf("destination_denied counted %v times, want 7", got)
	}
	if row, err := e.store.Get(context.Background(), "agent"); err != nil || row.Status != state.StatusActive {
		t.Fatalf("the refusals changed the run: %+v %v", row, err)
	}
}

// counter sums the counter family name over the series with label value v.
func counter(t *testing.T, reg *prometheus.Registry, name, v string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetValue() == v {
					sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
				}
			}
		}
	}
	return sum
}

func TestOperatorRulesOpenWhatTheySayAndStopgateStaysClosed(t *testing.T) {
	allowed, denied, own := newUpstream(t, false, nil), newUpstream(t, false, nil), newUpstream(t, false, nil)
	e := newEnv(t, envOptions{asShipped: true,
		allowDest: []string{"127.0.0.0/8"},
		denyDest:  []string{denied.Listener.Addr().String()},
		protected: []proxy.Protected{{Addr: own.Listener.Addr().String(), What: "control API"}},
	})
	e.admit("op")
	c := e.client("op", 1)
	if resp, body := do(t, c, "GET", allowed.URL+"/", nil, nil); resp.StatusCode != 200 {
		t.Fatalf("an allowed loopback upstream: %d %s", resp.StatusCode, body)
	}
	resp, body := do(t, c, "GET", denied.URL+"/", nil, nil)
	if r := wantRefusal(t, "deny inside allow", resp, body, 403, refusal.DestinationDenied); !strings.Contains(r.Message, "destinations.deny") {
		t.Fatalf("deny did not win over allow: %s", r.Message)
	}
	resp, body = do(t, c, "POST", own.URL+"/v1/runs/victim/cancel", strings.NewReader("{}"), nil)
	if r := wantRefusal(t, "stopgate's own listener", resp, body, 403, refusal.DestinationDenied); !strings.Contains(r.Message, "control API") {
		t.Fatalf("the refusal does not name stopgate's listener: %s", r.Message)
	}
	if allowed.Hits.Load() != 1 || denied.Hits.Load()+own.Hits.Load() != 0 {
		t.Fatalf("upstream hits: allowed %d, denied %d, own %d", allowed.Hits.Load(), denied.Hits.Load(), own.Hits.Load())
	}
}

// TestTheAddressCheckedIsTheAddressDialled: a name is resolved once, by
// the check; the round trip dials that address, not a second answer of DNS
// (rebinding), and upstream TLS is still verified against the name.
func TestTheAddressCheckedIsTheAddressDialled(t *testing.T) {
	p := newProvider(t, "api.provider.test")
	for _, tc := range []struct {
		scheme string
		// checks is how many times the request's path checks the name: a
		// CONNECT, then the request inside its tunnel.
		checks int64
	}{{"http", 1}, {"https", 2}} {
		t.Run(tc.scheme, func(t *testing.T) {
			var lookups atomic.Int64
			opts := withProvider(p, envOptions{asShipped: true, allowDest: []string{"127.0.0.1/32"}})
			opts.resolve = func(_ context.Context, host string) ([]netip.Addr, error) {
				// The first answers are the allowed address, every later
				// one an address no rule allows: a second lookup at the
				// dial would be refused.
				if lookups.Add(1) <= tc.checks {
					return []netip.Addr{netip.MustParseAddr("127.0.0.1")}, nil
				}
				return []netip.Addr{netip.MustParseAddr("127.0.0.2")}, nil
			}
			e := newEnv(t, opts)
			c := e.client("rb-"+tc.scheme, 1)
			before := p.hits.Load()
			resp, body := do(t, c, "POST", tc.scheme+"://api.provider.test/v1/charges", strings.NewReader("x"), nil)
			if resp.StatusCode != 200 || lookups.Load() != tc.checks || p.hits.Load() != before+1 {
				t.Fatalf("got %d %s after %d lookups (want %d), provider hits %d", resp.StatusCode, body, lookups.Load(), tc.checks, p.hits.Load()-before)
			}
			// The name now resolves elsewhere: the next request (in the
			// same tunnel, for https) is refused before any guard.
			resp, body = do(t, c, "POST", tc.scheme+"://api.provider.test/v1/charges", strings.NewReader("x"), nil)
			if r := wantRefusal(t, "after the name moved", resp, body, 403, refusal.DestinationDenied); !strings.Contains(r.Message, "127.0.0.2") {
				t.Fatalf("the refusal does not name the address: %s", r.Message)
			}
			if p.hits.Load() != before+1 {
				t.Fatal("the provider was reached after its name moved")
			}
		})
	}
	t.Run("TLS verifies the name, not the address", func(t *testing.T) {
		opts := withProvider(p, envOptions{asShipped: true, allowDest: []string{"127.0.0.1"}})
		opts.resolve = names(map[string]string{"impostor.test": "127.0.0.1"})
		e := newEnv(t, opts)
		before := p.hits.Load()
		resp, body := do(t, e.client("tls", 1), "POST", "https://impostor.test/v1/charges", strings.NewReader("x"), nil)
		r := wantRefusal(t, "a certificate for another name", resp, body, 502, refusal.UpstreamFailed)
		if r.Recorded != "NOT_SENT" || p.hits.Load() != before {
			t.Fatalf("a provider whose certificate is for another name: %+v, hits %d", r, p.hits.Load()-before)
		}
	})
}

func TestTruncatedBodiesAreNeverForwarded(t *testing.T) {
	up := newUpstream(t, true, nil)
	plainUp := newUpstream(t, false, nil)
	e := newEnv(t, envOptions{})
	e.admit("tr")
	auth := "Proxy-Authorization: " + basicAuth("tr:1") + "\r\n"
	for _, body := range []struct{ name, head, bytes string }{
		{"Content-Length 20, 14 bytes sent", "Content-Length: 20\r\n", "14 bytes sent!"},
		{"chunked without its last chunk", "Transfer-Encoding: chunked\r\n", "5\r\nhello\r\n"},
	} {
		for _, mode := range []string{"plain", "tunnel"} {
			t.Run(mode+"/"+body.name, func(t *testing.T) {
				c := e.raw(t)
				switch mode {
				case "plain":
					c.send(fmt.Sprintf("POST %s/pay HTTP/1.1\r\nHost: %s\r\n%s%s\r\n%s", plainUp.URL, plainUp.Listener.Addr(), auth, body.head, body.bytes))
					// The client gives up: no more bytes, but it still reads.
					_ = c.conn.(*net.TCPConn).CloseWrite()
				case "tunnel":
					if resp := c.connect(up.Listener.Addr().String(), auth); resp.StatusCode != 200 {
						t.Fatalf("CONNECT: %d", resp.StatusCode)
					}
					tc := c.intercepted(e, "127.0.0.1")
					c.send(fmt.Sprintf("POST /pay HTTP/1.1\r\nHost: %s\r\n%s\r\n%s", up.Listener.Addr(), body.head, body.bytes))
					_ = tc.CloseWrite()
				}
				resp, b := c.answer("POST")
				wantRefusal(t, "truncated body", resp, b, 400, refusal.BadRequestBody)
			})
		}
	}
	if n := up.Hits.Load() + plainUp.Hits.Load(); n != 0 {
		t.Fatalf("a truncated body reached the upstream %d times", n)
	}
	if ins := e.intents("tr"); len(ins) != 0 {
		t.Fatalf("a truncated body was admitted: %+v", ins)
	}
}

// TestRefusedBeforeTheBodyIsSent: where the guard can answer before the
// body is read, it does: a client asking with Expect: 100-continue gets
// the refusal instead of 100 Continue, and a run this instance already
// knows cancelled is refused without its body, so a large upload of a
// cancelled run is never uploaded.
func TestRefusedBeforeTheBodyIsSent(t *testing.T) {
	up := newUpstream(t, true, nil)
	plainUp := newUpstream(t, false, nil)
	store := testkit.FileStore(t)
	e := newEnv(t, envOptions{store: store, runs: store})
	const huge = "Content-Length: 209715200\r\n" // 200 MB, never sent
	ask := func(t *testing.T, c *raw, target, host, run, head string) (*http.Response, []byte) {
		t.Helper()
		c.send(fmt.Sprintf("POST %s HTTP/1.1\r\nHost: %s\r\nProxy-Authorization: %s\r\n%s\r\n", target, host, basicAuth(run+":1"), head))
		return c.answer("POST")
	}
	t.Run("Expect: 100-continue, plain", func(t *testing.T) {
		e.admit("ex1")
		e.cancel("ex1", time.Minute)
		resp, body := ask(t, e.raw(t), plainUp.URL+"/upload", plainUp.Listener.Addr().String(), "ex1", huge+"Expect: 100-continue\r\n")
		r := wantRefusal(t, "a cancelled run's upload", resp, body, 409, refusal.RunNotActive)
		if in := e.intent("ex1", r.Intent); in.State != state.IntentCancelledBeforeDispatch || in.BodyDigest != "" {
			t.Fatalf("recorded %+v", in)
		}
		if want := intents.DerivedKey("ex1", "POST", plainUp.URL+"/upload", ""); r.Intent != want {
			t.Fatalf("recorded under %s, want the key without its body %s", r.Intent, want)
		}
	})
	t.Run("Expect: 100-continue, inside a tunnel", func(t *testing.T) {
		e.admit("ex2")
		e.cancel("ex2", time.Minute)
		c := e.raw(t)
		if resp := c.connect(up.Listener.Addr().String(), "Proxy-Authorization: "+basicAuth("ex2:1")+"\r\n"); resp.StatusCode != 200 {
			t.Fatalf("CONNECT: %d", resp.StatusCode)
		}
		c.intercepted(e, "127.0.0.1")
		resp, body := ask(t, c, "/upload", up.Listener.Addr().String(), "ex2", huge+"Expect: 100-continue\r\n")
		wantRefusal(t, "a cancelled run's upload in a tunnel", resp, body, 409, refusal.RunNotActive)
	})
	t.Run("a run known cancelled, without Expect", func(t *testing.T) {
		// ex1 was refused on this instance above: its next upload is
		// answered before a byte of its body arrives.
		resp, body := ask(t, e.raw(t), plainUp.URL+"/upload", plainUp.Listener.Addr().String(), "ex1", huge)
		wantRefusal(t, "a known cancelled run's upload", resp, body, 409, refusal.RunNotActive)
	})
	t.Run("an ACTIVE run's upload gets 100 Continue and goes through", func(t *testing.T) {
		e.admit("ex3")
		c := e.raw(t)
		c.send(fmt.Sprintf("POST %s/upload HTTP/1.1\r\nHost: %s\r\nProxy-Authorization: %s\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n",
			plainUp.URL, plainUp.Listener.Addr(), basicAuth("ex3:1")))
		line, err := c.r.ReadString('\n')
		if err != nil || !strings.HasPrefix(line, "HTTP/1.1 100") {
			t.Fatalf("want 100 Continue first, got %q %v", line, err)
		}
		if _, err := c.r.ReadString('\n'); err != nil { // the blank line ending the 100
			t.Fatal(err)
		}
		c.send("hello")
		resp, body := c.answer("POST")
		if resp.StatusCode != 200 || string(plainUp.LastBody()) != "hello" {
			t.Fatalf("after 100 Continue: %d %s, upstream got %q", resp.StatusCode, body, plainUp.LastBody())
		}
	})
	if n := up.Hits.Load() + plainUp.Hits.Load(); n != 1 {
		t.Fatalf("upstream hits %d, want only the ACTIVE run's upload", n)
	}
}

// TestConnectNeedsAnIdentity: a 407 inside a tunnel is one no client can
// answer (git and curl --proxy-anyauth send credentials only after a 407),
// so an anonymous CONNECT gets its 407 at the CONNECT, whatever the host.
func TestConnectNeedsAnIdentity(t *testing.T) {
	signer, err := runtoken.New([]byte("0123456789abcdef0123456789abcdef"))
	if err != nil {
		t.Fatal(err)
	}
	up := newUpstream(t, true, nil)
	host := up.Listener.Addr().String()
	for _, tc := range []struct {
		name string
		opts envOptions
		want int
	}{
		{"a required token", envOptions{tokens: signer, requireTok: true}, 407},
		{"a pass-through host", envOptions{passThrough: []string{"127.0.0.1"}}, 407},
		{"an intercepted host", envOptions{}, 407},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, tc.opts)
			c := e.raw(t)
			c.send(fmt.Sprintf("CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", host, host))
			resp, body := c.answer(http.MethodConnect)
			if tc.want == 200 {
				if resp.StatusCode != 200 {
					t.Fatalf("CONNECT: %d %s", resp.StatusCode, body)
				}
				return
			}
			wantRefusal(t, "CONNECT without an identity", resp, body, 407, refusal.NoRunIdentity)
			if resp.Header.Get("Proxy-Authenticate") == "" {
				t.Fatal("407 without Proxy-Authenticate")
			}
		})
	}
}

// TestABoundTunnelKeepsItsRun: requests inside an intercepted tunnel may
// name another run with X-Run-ID, unless the CONNECT bound the tunnel to its
// own (what stopgate exec does for a sandboxed command): then whatever they
// name, they are the CONNECT's run's, and the header never goes upstream.
func TestABoundTunnelKeepsItsRun(t *testing.T) {
	var leaked atomic.Int64
	up := newUpstream(t, true, func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Run-Id") != "" {
			leaked.Add(1)
		}
		w.WriteHeader(http.StatusOK)
	})
	e := newEnv(t, envOptions{})
	e.admit("carrier")
	e.admit("victim")
	for _, tc := range []struct {
		name  string
		bind  bool
		owner string
	}{{"not bound: the header names the run", false, "victim"}, {"bound: the CONNECT's run", true, "carrier"}} {
		t.Run(tc.name, func(t *testing.T) {
			c := e.client("carrier", 1)
			if tc.bind {
				tr := c.Transport.(*http.Transport)
				tr.ProxyConnectHeader = http.Header{proxy.HeaderBindTunnel: {"1"}}
			}
			resp, body := do(t, c, "POST", up.URL+"/"+tc.owner, strings.NewReader("x"), http.Header{"X-Run-Id": {"victim"}})
			if resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, body)
			}
			key := resp.Header.Get(refusal.IntentHeader)
			if in := e.intent(tc.owner, key); in.Target != up.URL+"/"+tc.owner {
				t.Fatalf("recorded under %s as %+v", tc.owner, in)
			}
		})
	}
	if n := leaked.Load(); n != 0 {
		t.Fatalf("X-Run-ID reached the upstream %d times", n)
	}
}

func TestIdentityHeadersMustBeOneEach(t *testing.T) {
	signer, err := runtoken.New([]byte("0123456789abcdef0123456789abcdef"))
	if err != nil {
		t.Fatal(err)
	}
	tok := signer.Sign("dup", 1, time.Now().Add(time.Hour))
	up := newUpstream(t, false, nil)
	e := newEnv(t, envOptions{tokens: signer})
	e.admit("dup")
	e.admit("other")
	for _, tc := range []struct {
		name   string
		header http.Header
		status int
		code   refusal.Code
	}{
		{"two X-Run-ID", http.Header{"X-Run-Id": {"dup", "other"}}, 400, refusal.BadRunIdentity},
		{"two X-Run-Version", http.Header{"X-Run-Id": {"dup"}, "X-Run-Version": {"1", "2"}}, 400, refusal.BadRunIdentity},
		{"two Proxy-Authorization", http.Header{"Proxy-Authorization": {basicAuth("dup:1"), basicAuth("other:1")}}, 400, refusal.BadRunIdentity},
		{"two X-Run-Token", http.Header{"X-Run-Token": {tok, tok}}, 400, refusal.BadRunIdentity},
		{"a token with its own run's X-Run-ID", http.Header{"Proxy-Authorization": {basicAuth("dup:" + tok)}, "X-Run-Id": {"dup"}}, 200, ""},
		{"a token with another run's X-Run-ID", http.Header{"Proxy-Authorization": {basicAuth("dup:" + tok)}, "X-Run-Id": {"other"}}, 407, refusal.NoRunIdentity},
		{"a token with X-Run-Version", http.Header{"Proxy-Authorization": {basicAuth("dup:" + tok)}, "X-Run-Id": {"dup"}, "X-Run-Version": {"1"}}, 400, refusal.BadRunIdentity},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := do(t, e.client("", 0), "POST", up.URL+"/x", strings.NewReader("x"), tc.header)
			if tc.status == 200 {
				if resp.StatusCode != 200 {
					t.Fatalf("got %d %s", resp.StatusCode, body)
				}
				return
			}
			wantRefusal(t, tc.name, resp, body, tc.status, tc.code)
		})
	}
	t.Run("two Proxy-Authorization at a CONNECT", func(t *testing.T) {
		c := e.raw(t)
		c.send(fmt.Sprintf("CONNECT %s HTTP/1.1\r\nHost: x\r\nProxy-Authorization: %s\r\nProxy-Authorization: %s\r\n\r\n", up.Listener.Addr(), basicAuth("dup:1"), basicAuth("other:1")))
		resp, body := c.answer(http.MethodConnect)
		wantRefusal(t, "CONNECT", resp, body, 400, refusal.BadRunIdentity)
	})
	if ins := e.intents("other"); len(ins) != 0 {
		t.Fatalf("run other was spent by a request that also named dup: %+v", ins)
	}
	if up.Hits.Load() != 1 {
		t.Fatalf("upstream hits %d, want 1", up.Hits.Load())
	}
}

func TestReservedIdempotencyKeysAreRefused(t *testing.T) {
	up := newUpstream(t, false, nil)
	e := newEnv(t, envOptions{})
	e.admit("keys")
	for _, keys := range [][]string{{"claim:step-1"}, {"retry:step-1:2"}, {"Claim:step-1"}, {"pay-1", "pay-2"}} {
		resp, body := do(t, e.client("keys", 1), "POST", up.URL+"/x", strings.NewReader("x"), http.Header{"Idempotency-Key": keys})
		r := wantRefusal(t, fmt.Sprint(keys), resp, body, 400, refusal.InvalidRequest)
		if r.Message == "" {
			t.Fatal("no message")
		}
	}
	if up.Hits.Load() != 0 || len(e.intents("keys")) != 0 {
		t.Fatalf("a refused key went on: hits %d, intents %+v", up.Hits.Load(), e.intents("keys"))
	}
}

func TestOpenExchangesAreCapped(t *testing.T) {
	reg := prometheus.NewRegistry()
	release := make(chan struct{})
	up := newUpstream(t, false, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/hold" {
			<-release
		}
	})
	e := newEnv(t, envOptions{registry: reg, maxConns: 2, maxPerRun: 1})
	var held sync.WaitGroup
	hold := func(run string) {
		held.Go(func() {
			resp, body := do(t, e.client(run, 0), "POST", up.URL+"/hold", strings.NewReader("x"), nil)
			if resp.StatusCode != 200 {
				t.Errorf("held request of %s: %d %s", run, resp.StatusCode, body)
			}
		})
	}
	hold("a")
	testkit.Eventually(t, 5*time.Second, "a's request at the upstream", func() bool { return up.Hits.Load() == 1 })
	resp, body := do(t, e.client("a", 0), "POST", up.URL+"/x", strings.NewReader("x"), nil)
	if r := wantRefusal(t, "a second request of a", resp, body, 429, refusal.TooManyConnections); !strings.Contains(r.Message, "run a") {
		t.Fatalf("the message does not name the run: %s", r.Message)
	}
	c := e.raw(t)
	c.send(fmt.Sprintf("CONNECT %s HTTP/1.1\r\nHost: x\r\nProxy-Authorization: %s\r\n\r\n", up.Listener.Addr(), basicAuth("a:")))
	resp, body = c.answer(http.MethodConnect)
	wantRefusal(t, "a tunnel of a", resp, body, 429, refusal.TooManyConnections)

	testkit.Eventually(t, 5*time.Second, "the refused tunnel let go", func() bool { return counter(t, reg, "stopgate_open", "exchanges") == 1 })
	hold("b")
	testkit.Eventually(t, 5*time.Second, "b's request at the upstream", func() bool { return up.Hits.Load() == 2 })
	resp, body = do(t, e.client("c", 0), "POST", up.URL+"/x", strings.NewReader("x"), nil)
	wantRefusal(t, "a request of c past the cap in all", resp, body, 429, refusal.TooManyConnections)

	close(release)
	held.Wait()
	testkit.Eventually(t, 5*time.Second, "every exchange let go", func() bool { return counter(t, reg, "stopgate_open", "exchanges") == 0 })
	if resp, body := do(t, e.client("a", 0), "POST", up.URL+"/x", strings.NewReader("x"), nil); resp.StatusCode != 200 {
		t.Fatalf("after the held requests ended: %d %s", resp.StatusCode, body)
	}
	if got := counter(t, reg, "stopgate_refusals_total", "too_many_connections"); got != 3 {
		t.Fatalf("too_many_connections counted %v times, want 3", got)
	}
}

// TestSilentClientsAreLetGo: a client that stops talking is let go after
// the handshake timeout (a tunnel that never starts) or the idle timeout
// (mid-body, between requests in a tunnel, a pass-through tunnel gone
// quiet), and what it held is freed.
func TestSilentClientsAreLetGo(t *testing.T) {
	reg := prometheus.NewRegistry()
	addr, roots := echoTLSServer(t)
	host, _, _ := net.SplitHostPort(addr)
	up := newUpstream(t, true, nil)
	plainUp := newUpstream(t, false, nil)
	// A pass-through name for the echo server, so that its own address stays intercepted.
	e := newEnv(t, envOptions{registry: reg, handshake: 300 * time.Millisecond, idle: 500 * time.Millisecond,
		passThrough: []string{"echo.test"}, resolve: names(map[string]string{"echo.test": host})})
	_, echoPort, _ := net.SplitHostPort(addr)
	echo := "echo.test:" + echoPort
	e.admit("quiet")
	auth := "Proxy-Authorization: " + basicAuth("quiet:1") + "\r\n"
	// closedByProxy waits for the proxy to close c; the raw connection's own
	// deadline (20s) fails the test if it does not.
	closedByProxy := func(t *testing.T, c *raw) {
		t.Helper()
		_, err := c.r.ReadByte()
		var ne net.Error
		if err == nil || errors.As(err, &ne) && ne.Timeout() {
			t.Fatalf("the proxy did not let the silent client go: %v", err)
		}
	}
	t.Run("a CONNECT that never starts its handshake", func(t *testing.T) {
		c := e.raw(t)
		if resp := c.connect(up.Listener.Addr().String(), auth); resp.StatusCode != 200 {
			t.Fatalf("CONNECT: %d", resp.StatusCode)
		}
		closedByProxy(t, c)
	})
	t.Run("an intercepted tunnel idle after a request", func(t *testing.T) {
		c := e.raw(t)
		if resp := c.connect(up.Listener.Addr().String(), auth); resp.StatusCode != 200 {
			t.Fatalf("CONNECT: %d", resp.StatusCode)
		}
		c.intercepted(e, "127.0.0.1")
		c.send(fmt.Sprintf("GET / HTTP/1.1\r\nHost: %s\r\n\r\n", up.Listener.Addr()))
		if resp, body := c.answer("GET"); resp.StatusCode != 200 {
			t.Fatalf("inside the tunnel: %d %s", resp.StatusCode, body)
		}
		closedByProxy(t, c)
	})
	t.Run("a plain request body that stops coming", func(t *testing.T) {
		c := e.raw(t)
		c.send(fmt.Sprintf("POST %s/pay HTTP/1.1\r\nHost: %s\r\n%sContent-Length: 100\r\n\r\n10 bytes..", plainUp.URL, plainUp.Listener.Addr(), auth))
		resp, body := c.answer("POST")
		if r := wantRefusal(t, "a stalled body", resp, body, 400, refusal.BadRequestBody); !strings.Contains(r.Message, "no byte of its request body") {
			t.Fatalf("the message does not say what happened: %s", r.Message)
		}
	})
	t.Run("a pass-through tunnel that never carries a byte", func(t *testing.T) {
		c := e.raw(t)
		resp := c.connect(echo, auth)
		if resp.StatusCode != 200 {
			t.Fatalf("CONNECT: %d", resp.StatusCode)
		}
		closedByProxy(t, c)
		key := resp.Header.Get(refusal.IntentHeader)
		testkit.Eventually(t, 5*time.Second, "the tunnel recorded", func() bool { return e.intent("quiet", key).State == state.IntentNotSent })
		if in := e.intent("quiet", key); in.Reason != "handshake_timeout" {
			t.Fatalf("recorded %+v", in)
		}
	})
	t.Run("a pass-through tunnel gone quiet", func(t *testing.T) {
		c := e.raw(t)
		resp := c.connect(echo, auth)
		if resp.StatusCode != 200 {
			t.Fatalf("CONNECT: %d", resp.StatusCode)
		}
		tc := tls.Client(&bufferedConn{Conn: c.conn, r: c.r}, &tls.Config{RootCAs: roots, ServerName: host})
		c.conn, c.r = tc, bufio.NewReader(tc)
		c.send(fmt.Sprintf("GET / HTTP/1.1\r\nHost: %s\r\n\r\n", addr))
		if resp, body := c.answer("GET"); resp.StatusCode != 200 || string(body) != "secret inside" {
			t.Fatalf("through the tunnel: %d %s", resp.StatusCode, body)
		}
		closedByProxy(t, c)
		key := resp.Header.Get(refusal.IntentHeader)
		testkit.Eventually(t, 5*time.Second, "the tunnel recorded", func() bool { return e.intent("quiet", key).State == state.IntentResponded })
		if in := e.intent("quiet", key); in.Reason != "idle_timeout" {
			t.Fatalf("recorded %+v", in)
		}
	})
	testkit.Eventually(t, 5*time.Second, "every exchange let go", func() bool { return counter(t, reg, "stopgate_open", "exchanges") == 0 })
	if plainUp.Hits.Load() != 0 {
		t.Fatal("a stalled body reached the upstream")
	}
}

// TestRequestsThatComeBackThroughTheProxyAreRefused: a listener of this
// process that is not in the protected list (a browser's run-bound egress
// on an ephemeral port) reached through the proxy itself would let a run
// speak as another; the proxy knows its own upstream connections and
// refuses what arrives on them.
func TestRequestsThatComeBackThroughTheProxyAreRefused(t *testing.T) {
	up := newUpstream(t, false, nil)
	e := newEnv(t, envOptions{passThrough: []string{"127.0.0.1"}})
	h, err := e.proxy.ForRun("victim")
	if err != nil {
		t.Fatal(err)
	}
	bound := httptest.NewServer(h)
	defer bound.Close()
	e.admit("attacker")
	e.admit("victim")
	c := e.raw(t)
	if resp := c.connect(bound.Listener.Addr().String(), "Proxy-Authorization: "+basicAuth("attacker:1")+"\r\n"); resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %d", resp.StatusCode)
	}
	// Inside the tunnel, the agent speaks proxy to the victim's bound listener.
	c.send(fmt.Sprintf("POST %s/charge HTTP/1.1\r\nHost: %s\r\nContent-Length: 1\r\n\r\nx", up.URL, up.Listener.Addr()))
	resp, body := c.answer("POST")
	wantRefusal(t, "a request back through the proxy", resp, body, 403, refusal.DestinationDenied)
	if up.Hits.Load() != 0 || len(e.intents("victim")) != 0 {
		t.Fatalf("the agent spent the victim's effects: hits %d, intents %+v", up.Hits.Load(), e.intents("victim"))
	}
}

// TestHeadersInsideATunnelAreBoundedAsOutside: a request read inside an
// intercepted tunnel, TLS or plain, is held to the proxy listener's bounds:
// headers past MaxHeaderBytes are a 431 and the connection is closed, and
// headers trickled a byte at a time are cut at ReadHeaderTimeout. Before,
// goproxy's own loop read a header line of any size (150 MB lines took
// three tunnels to 1.5 GB) for as long as it came.
func TestHeadersInsideATunnelAreBoundedAsOutside(t *testing.T) {
	e := newEnv(t, envOptions{})
	up := newUpstream(t, true, nil)
	e.admit("hdr")
	auth := "Proxy-Authorization: " + basicAuth("hdr:1") + "\r\n"
	open := func(t *testing.T, tlsInside bool) *raw {
		c := e.raw(t)
		if resp := c.connect(up.Listener.Addr().String(), auth); resp.StatusCode != 200 {
			t.Fatalf("CONNECT: %d", resp.StatusCode)
		}
		if tlsInside {
			c.intercepted(e, "127.0.0.1")
		}
		return c
	}
	for _, tlsInside := range []bool{true, false} {
		name := map[bool]string{true: "TLS", false: "plain HTTP"}[tlsInside]
		t.Run(name+": headers past the limit are a 431", func(t *testing.T) {
			c := open(t, tlsInside)
			// Past the proxy's limit, and well within the upstream's (net/http's
			// 1 MB): the 431 can only be the proxy's.
			big := strings.Repeat("a", proxy.MaxHeaderBytes+64<<10)
			// The proxy answers and closes once the limit is passed: the
			// rest of the line need not all be taken.
			go func() {
				_, _ = io.WriteString(c.conn, "GET / HTTP/1.1\r\nHost: "+up.Listener.Addr().String()+"\r\nX-Big: "+big+"\r\n\r\n")
			}()
			resp, err := http.ReadResponse(c.r, &http.Request{Method: http.MethodGet})
			if err != nil {
				t.Fatalf("no answer to an oversized header: %v", err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
				t.Fatalf("oversized header inside the tunnel: %d, want 431", resp.StatusCode)
			}
			if up.Hits.Load() != 0 {
				t.Fatalf("the upstream was reached: %d", up.Hits.Load())
			}
		})
		t.Run(name+": headers trickled past the header timeout are cut", func(t *testing.T) {
			if testing.Short() {
				t.Skip("waits for the header timeout")
			}
			t.Parallel()
			c := open(t, tlsInside)
			start := time.Now()
			c.send("GET / HTTP/1.1\r\nHost: " + up.Listener.Addr().String() + "\r\n")
			closed := make(chan error, 1)
			go func() {
				_, err := c.r.ReadByte()
				for err == nil {
					_, err = c.r.ReadByte()
				}
				closed <- err
			}()
			tick := time.NewTicker(200 * time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case err := <-closed:
					if d := time.Since(start); d < proxy.ReadHeaderTimeout-time.Second || d > proxy.ReadHeaderTimeout+3*time.Second {
						t.Fatalf("a trickled header was let go after %s (%v), want about %s", d, err, proxy.ReadHeaderTimeout)
					}
					return
				case <-tick.C:
					// One more byte of a header that never ends.
					_, _ = io.WriteString(c.conn, "X")
				}
			}
		})
	}
}
