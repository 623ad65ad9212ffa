package proxy_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/proxy"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
)

// These tests drive transparent mode without the kernel: the client dials the
// transparent listener itself, and the original destination a redirect would
// have recorded is set by the test. The namespace tests of cmd/proxy do the
// same through real iptables rules.

// redirected is a transparent listener whose connections "were going" to dest.
type redirected struct {
	addr string
	dest atomic.Pointer[netip.AddrPort]
}

func (e *env) transparent(t *testing.T, opts proxy.TransparentOptions, dest string) *redirected {
	t.Helper()
	r := &redirected{}
	r.to(t, dest)
	opts.OriginalDst = func(net.Conn) (netip.AddrPort, error) { return *r.dest.Load(), nil }
	tr, err := e.proxy.NewTransparent(opts)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r.addr = ln.Addr().String()
	go func() { _ = tr.Serve(ln) }()
	t.Cleanup(func() { _ = tr.Close() })
	return r
}

func (r *redirected) to(t *testing.T, dest string) {
	t.Helper()
	ap, err := netip.ParseAddrPort(dest)
	if err != nil {
		t.Fatal(err)
	}
	r.dest.Store(&ap)
}

// client reaches every address through the redirect, as a redirected
// process does whatever it dials; TLS trusts roots.
func (r *redirected) client(roots *x509.CertPool) *http.Client {
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		Proxy:             nil,
		DisableKeepAlives: true,
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, r.addr)
		},
		TLSClientConfig: &tls.Config{RootCAs: roots},
	}}
}

func (e *env) caPool() *x509.CertPool {
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(e.ca.PEM)
	return pool
}

func hostOf(u string) string { return strings.TrimPrefix(strings.TrimPrefix(u, "http://"), "https://") }

func TestTransparentPlainHTTPGoesToTheOriginalDestinationWhateverTheHost(t *testing.T) {
	e := newEnv(t, envOptions{})
	up := newUpstream(t, false, nil)
	decoy := newUpstream(t, false, nil)
	upHost := hostOf(up.URL)
	_, upPort, _ := net.SplitHostPort(upHost)
	r := e.transparent(t, proxy.TransparentOptions{Run: "t-plain"}, upHost)
	c := r.client(nil)

	for _, tc := range []struct {
		host, target string
	}{
		// The agent names another address: the kernel's destination is dialled and recorded.
		{hostOf(decoy.URL), "http://" + upHost + "/x"},
		// A name that resolves to the destination is kept.
		{"localhost:" + upPort, "http://localhost:" + upPort + "/x"},
		// A name that does not is only a claim: recorded by address.
		{"bank.invalid", "http://" + upHost + "/x"},
	} {
		req, _ := http.NewRequest(http.MethodGet, "http://"+tc.host+"/x", nil)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatalf("Host %s: %v", tc.host, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || resp.Header.Get(refusal.IntentHeader) == "" {
			t.Fatalf("Host %s: %d %s", tc.host, resp.StatusCode, body)
		}
		in := e.intent("t-plain", resp.Header.Get(refusal.IntentHeader))
		if in.Target != tc.target || in.State != state.IntentResponded {
			t.Errorf("Host %s: recorded %s %s, want %s RESPONDED", tc.host, in.Target, in.State, tc.target)
		}
		if got := up.LastHeader(); got == nil {
			t.Fatalf("Host %s: the original destination saw nothing", tc.host)
		}
	}
	if up.Hits.Load() != 3 || decoy.Hits.Load() != 0 {
		t.Fatalf("destination saw %d, the address in Host %d; want 3 and 0", up.Hits.Load(), decoy.Hits.Load())
	}

	e.cancel("t-plain", time.Minute)
	resp, body := do(t, c, http.MethodPost, "http://"+upHost+"/charge", strings.NewReader("{}"), nil)
	if rb := decodeRefusal(t, body); resp.StatusCode != http.StatusConflict || rb.Recorded != string(state.IntentCancelledBeforeDispatch) {
		t.Fatalf("after cancel: %d %s", resp.StatusCode, body)
	}
	if up.Hits.Load() != 3 {
		t.Fatalf("a request reached the destination after the cancel")
	}
}

func TestTransparentIdentity(t *testing.T) {
	up := newUpstream(t, false, nil)
	upHost := hostOf(up.URL)
	t.Run("a bound listener's run is the only one", func(t *testing.T) {
		e := newEnv(t, envOptions{})
		c := e.transparent(t, proxy.TransparentOptions{Run: "t-bound", Version: 1}, upHost).client(nil)
		e.admit("t-bound")
		resp, body := do(t, c, http.MethodGet, "http://"+upHost+"/y", nil, http.Header{proxy.HeaderRunID: {"someone-else"}})
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		if other, _ := e.store.Intents(context.Background(), "someone-else"); len(e.intents("t-bound")) != 1 || len(other) != 0 {
			t.Fatalf("recorded under the header's run, not the binding's")
		}
		if h := up.LastHeader(); h.Get(proxy.HeaderRunID) != "" {
			t.Fatalf("the run header reached the upstream: %v", h)
		}
	})
	t.Run("an unbound listener takes headers, else refuses", func(t *testing.T) {
		e := newEnv(t, envOptions{})
		c := e.transparent(t, proxy.TransparentOptions{}, upHost).client(nil)
		resp, body := do(t, c, http.MethodGet, "http://"+upHost+"/y", nil, http.Header{proxy.HeaderRunID: {"t-header"}})
		if resp.StatusCode != 200 || len(e.intents("t-header")) != 1 {
			t.Fatalf("with X-Run-ID: %d %s", resp.StatusCode, body)
		}
		resp, body = do(t, c, http.MethodGet, "http://"+upHost+"/y", nil, nil)
		if resp.StatusCode != http.StatusProxyAuthRequired || resp.Header.Get(refusal.Header) != "no_run_identity" {
			t.Fatalf("without identity: %d %s", resp.StatusCode, body)
		}
	})
	t.Run("the static run applies", func(t *testing.T) {
		e := newEnv(t, envOptions{staticRun: "t-static"})
		c := e.transparent(t, proxy.TransparentOptions{}, upHost).client(nil)
		if resp, body := do(t, c, http.MethodGet, "http://"+upHost+"/y", nil, nil); resp.StatusCode != 200 || len(e.intents("t-static")) != 1 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
	})
}

// A delivery destination may be reached by a CANCELLING run; a Host header
// naming it must not open that door towards another address.
func TestTransparentClaimedNameDoesNotEarnDeliveryPolicy(t *testing.T) {
	up := newUpstream(t, false, nil)
	upHost := hostOf(up.URL)
	_, upPort, _ := net.SplitHostPort(upHost)
	e := newEnv(t, envOptions{delivery: []string{"hooks.invalid", "localhost"}})
	c := e.transparent(t, proxy.TransparentOptions{Run: "t-deliv"}, upHost).client(nil)
	e.admit("t-deliv")
	e.cancel("t-deliv", time.Minute)

	resp, body := do(t, c, http.MethodPost, "http://hooks.invalid/status", strings.NewReader("{}"), nil)
	if resp.StatusCode != http.StatusConflict {
		t.Fatalf("a claimed delivery name towards another address: %d %s, want 409", resp.StatusCode, body)
	}
	resp, body = do(t, c, http.MethodPost, "http://localhost:"+upPort+"/status", strings.NewReader("{}"), nil)
	if resp.StatusCode != 200 {
		t.Fatalf("a delivery name that resolves to the destination: %d %s, want 200", resp.StatusCode, body)
	}
	if up.Hits.Load() != 1 {
		t.Fatalf("destination saw %d requests, want 1", up.Hits.Load())
	}
}

func TestTransparentTLSIsInterceptedBySNI(t *testing.T) {
	up := newUpstream(t, true, nil) // certificate for example.com
	upHost := hostOf(up.URL)
	_, upPort, _ := net.SplitHostPort(upHost)
	e := newEnv(t, envOptions{})
	c := e.transparent(t, proxy.TransparentOptions{Run: "t-tls"}, upHost).client(e.caPool())

	resp, body := do(t, c, http.MethodPost, "https://example.com:"+upPort+"/v1/charges", strings.NewReader(`{"n":1}`), nil)
	if resp.StatusCode != 200 || !strings.HasPrefix(string(body), "hello POST /v1/charges") {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	in := e.intent("t-tls", resp.Header.Get(refusal.IntentHeader))
	if in.Target != "https://example.com:"+upPort+"/v1/charges" || in.Method != http.MethodPost {
		t.Fatalf("recorded %s %s", in.Method, in.Target)
	}
	e.cancel("t-tls", time.Minute)
	resp, body = do(t, c, http.MethodPost, "https://example.com:"+upPort+"/v1/charges", strings.NewReader(`{"n":2}`), nil)
	if resp.StatusCode != http.StatusConflict || decodeRefusal(t, body).Error != state.RefusalRunNotActive {
		t.Fatalf("after cancel: %d %s", resp.StatusCode, body)
	}
	if up.Hits.Load() != 1 {
		t.Fatalf("upstream saw %d requests, want 1", up.Hits.Load())
	}
}

func TestTransparentPassThroughIsOneGuardedTunnel(t *testing.T) {
	p := newProvider(t, "localhost")
	dest := hostOf(p.srv.URL)
	_, port, _ := net.SplitHostPort(dest)
	e := newEnv(t, envOptions{passThrough: []string{"localhost"}})
	c := e.transparent(t, proxy.TransparentOptions{Run: "t-pass"}, dest).client(p.roots)

	// The provider's own certificate reaches the client: nothing was intercepted.
	resp, body := do(t, c, http.MethodPost, "https://localhost:"+port+"/v1/charges", strings.NewReader("{}"), nil)
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"charged":true`) {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	testkit.Eventually(t, 5*time.Second, "the tunnel recorded", func() bool {
		ins := e.intents("t-pass")
		return len(ins) == 1 && ins[0].Boundary == state.BoundaryTunnel && ins[0].Target == "localhost:"+port && ins[0].State == state.IntentResponded
	})

	e.cancel("t-pass", time.Minute)
	if _, err := c.Get("https://localhost:" + port + "/v1/charges"); err == nil {
		t.Fatal("a tunnel opened after the cancel")
	}
	if p.hits.Load() != 1 {
		t.Fatalf("provider saw %d requests, want 1", p.hits.Load())
	}
	var refused int
	for _, in := range e.intents("t-pass") {
		if in.State == state.IntentCancelledBeforeDispatch {
			refused++
		}
	}
	if refused != 1 {
		t.Fatalf("the refused tunnel is not recorded: %+v", e.intents("t-pass"))
	}
}

func TestTransparentRefusesWhatIsNeitherHTTPNorTLS(t *testing.T) {
	up := newUpstream(t, false, nil)
	upHost := hostOf(up.URL)
	e := newEnv(t, envOptions{})
	r := e.transparent(t, proxy.TransparentOptions{Run: "t-raw"}, upHost)
	for _, tc := range []struct {
		name, send, dest, refusal string
	}{
		{"ssh banner", "SSH-2.0-OpenSSH_9.2\r\n", upHost, "not_http_or_tls"},
		{"binary", "\x00\x01\x02\x03 junk", upHost, "not_http_or_tls"},
		{"TLS record that is not a ClientHello", "\x16\x03\x01\x00\x05hello", upHost, "not_http_or_tls"},
		{"not redirected", "GET / HTTP/1.1\r\nHost: x\r\n\r\n", r.addr, "not_redirected"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r.to(t, tc.dest)
			conn, err := net.Dial("tcp", r.addr)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
			if _, err := io.WriteString(conn, tc.send); err != nil {
				t.Fatal(err)
			}
			if n, err := bufio.NewReader(conn).ReadByte(); err == nil {
				t.Fatalf("the connection answered %q instead of closing", n)
			}
			target := "tcp://" + tc.dest
			testkit.Eventually(t, 5*time.Second, "refusal recorded", func() bool {
				for _, in := range e.intents("t-raw") {
					if in.Target == target && in.State == state.IntentCancelledBeforeDispatch && in.Reason == tc.refusal {
						return true
					}
				}
				return false
			})
		})
	}
	if up.Hits.Load() != 0 {
		t.Fatalf("upstream saw %d connections' requests", up.Hits.Load())
	}
}

func TestBindingsOneRunPerUID(t *testing.T) {
	e := newEnv(t, envOptions{})
	b := e.proxy.NewBindings()
	t.Cleanup(b.Close)
	one, err := b.Bind(61001, "t-bind-1", 0, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Bind(61001, "t-bind-2", 0, time.Minute); err == nil || !strings.Contains(err.Error(), "uid 61001 is bound to run t-bind-1") {
		t.Fatalf("second binding of a uid: %v", err)
	}
	two, err := b.Bind(61002, "t-bind-2", 0, time.Minute)
	if err != nil || two.Port == one.Port {
		t.Fatalf("another uid: %+v %v", two, err)
	}
	if !listening(t, one.Port) {
		t.Fatal("a bound listener is not open")
	}
	if err := b.Unbind(one.ID); err != nil {
		t.Fatal(err)
	}
	// Not a dial: once closed, the port may be taken by a listener of
	// another test process at once.
	if listening(t, one.Port) {
		t.Fatal("an unbound listener is still open")
	}
	if _, err := b.Renew(one.ID); err == nil {
		t.Fatal("renewed an unbound binding")
	}
	// A binding nobody renews closes by itself.
	short, err := b.Bind(61001, "t-bind-3", 0, proxy.MinBindingTTL)
	if err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 5*time.Second, "the binding expires", func() bool {
		for _, bd := range b.List() {
			if bd.ID == short.ID {
				return false
			}
		}
		return true
	})
	if _, err := b.Renew(short.ID); err == nil {
		t.Fatal("renewed an expired binding")
	}
	for _, bad := range []struct {
		run string
		ttl time.Duration
	}{{"", time.Minute}, {"ok", time.Millisecond}, {"ok", 2 * proxy.MaxBindingTTL}} {
		if _, err := b.Bind(61003, bad.run, 0, bad.ttl); err == nil {
			t.Errorf("Bind(%q, %s) accepted", bad.run, bad.ttl)
		}
	}
}

// listening reports whether this process holds a listening TCP socket on
// port: its socket descriptors (/proc/self/fd) against the listening
// sockets of the network namespace (/proc/net/tcp, tcp6).
func listening(t *testing.T, port int) bool {
	t.Helper()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd to tell which sockets are open: %v", err)
	}
	mine := map[string]bool{}
	for _, fd := range fds {
		target, err := os.Readlink(filepath.Join("/proc/self/fd", fd.Name()))
		if inode, ok := strings.CutPrefix(target, "socket:["); err == nil && ok {
			mine[strings.TrimSuffix(inode, "]")] = true
		}
	}
	for _, table := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(table)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			f := strings.Fields(line)
			// local_address is HEXIP:HEXPORT; st 0A is LISTEN; field 9 the inode.
			if len(f) < 10 || f[3] != "0A" {
				continue
			}
			if i := strings.LastIndex(f[1], ":"); i >= 0 && f[1][i+1:] == fmt.Sprintf("%04X", port) && mine[f[9]] {
				return true
			}
		}
	}
	return false
}
