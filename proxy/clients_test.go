package proxy_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestMain lets the test binary double as an unmodified Go agent: a child
// process whose only configuration is its environment (HTTPS_PROXY,
// SSL_CERT_FILE), as a worker's would be.
func TestMain(m *testing.M) {
	if target := os.Getenv("STOPGATE_TEST_AGENT_GET"); target != "" {
		resp, err := http.Post(target, "application/json", strings.NewReader(`{"agent":"go"}`))
		if err != nil {
			fmt.Println("error", err)
			os.Exit(1)
		}
		body, _ := io.ReadAll(resp.Body)
		fmt.Printf("%d %s", resp.StatusCode, body)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// provider is a TLS upstream under a provider-like name; the proxy's dialer
// maps the name to loopback, so no request leaves the machine.
type provider struct {
	name  string
	hits  atomic.Int64
	srv   *httptest.Server // https://name/
	plain *httptest.Server // http://name/
	roots *x509.CertPool
}

func newProvider(t *testing.T, name string) *provider {
	t.Helper()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "provider test CA"}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, _ := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	caCert, _ := x509.ParseCertificate(caDER)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	leafTmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: name}, DNSNames: []string{name}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	leafDER, err := x509.CreateCertificate(rand.Reader, leafTmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	p := &provider{name: name, roots: x509.NewCertPool()}
	p.roots.AddCert(caCert)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.hits.Add(1)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"charged":true,"path":%q}`, r.URL.Path)
	})
	p.srv = httptest.NewUnstartedServer(handler)
	p.srv.TLS = &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{leafDER}, PrivateKey: key}}}
	p.srv.StartTLS()
	t.Cleanup(p.srv.Close)
	p.plain = httptest.NewServer(handler)
	t.Cleanup(p.plain.Close)
	return p
}

// withProvider returns env options whose proxy resolves the provider's
// name to loopback, dials its ports to the provider's listeners, and trusts
// its CA.
func withProvider(p *provider, opts envOptions) envOptions {
	opts.resolve = func(ctx context.Context, host string) ([]netip.Addr, error) {
		if host == p.name {
			return []netip.Addr{netip.MustParseAddr("127.0.0.1")}, nil
		}
		return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
	}
	opts.dial = func(ctx context.Context, network, target string) (net.Conn, error) {
		switch target {
		case "127.0.0.1:443":
			target = p.srv.Listener.Addr().String()
		case "127.0.0.1:80":
			target = p.plain.Listener.Addr().String()
		}
		var d net.Dialer
		return d.DialContext(ctx, network, target)
	}
	opts.roots = p.roots
	return opts
}

func (e *env) caFile() string {
	path := filepath.Join(e.dir, "ca.pem")
	if _, err := os.Stat(path); err != nil {
		e.t.Fatal(err)
	}
	return path
}

func (e *env) proxyURL(run string, version int) string {
	return fmt.Sprintf("http://%s:%d@%s", run, version, strings.TrimPrefix(e.server.URL, "http://"))
}

// agent is one real client: it POSTs target through the proxy named in its
// environment and returns the status code and body.
type agent func(t *testing.T, e *env, run, target string) (int, string)

var agents = map[string]agent{
	"curl": func(t *testing.T, e *env, run, target string) (int, string) {
		out, err := exec.Command("curl", "-sS", "-x", e.proxyURL(run, 1), "--cacert", e.caFile(),
			"-X", "POST", "-d", `{"agent":"curl"}`, "-w", "\n%{http_code}", target).Output()
		if err != nil {
			t.Fatalf("curl: %v", err)
		}
		body, code, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
		var n int
		fmt.Sscan(code, &n)
		return n, body
	},
	"go-net-http": func(t *testing.T, e *env, run, target string) (int, string) {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "STOPGATE_TEST_AGENT_GET="+target, "HTTPS_PROXY="+e.proxyURL(run, 1), "HTTP_PROXY="+e.proxyURL(run, 1), "SSL_CERT_FILE="+e.caFile(), "NO_PROXY=")
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("go agent: %v: %s", err, out)
		}
		code, body, _ := strings.Cut(string(out), " ")
		var n int
		fmt.Sscan(code, &n)
		return n, body
	},
	"python-requests": func(t *testing.T, e *env, run, target string) (int, string) {
		script := `import os, requests
r = requests.post(os.environ["TARGET"], json={"agent": "python"}, timeout=10)
print(r.status_code, r.text, end="")`
		cmd := exec.Command("python3", "-c", script)
		cmd.Env = append(os.Environ(), "TARGET="+target, "HTTPS_PROXY="+e.proxyURL(run, 1), "HTTP_PROXY="+e.proxyURL(run, 1), "REQUESTS_CA_BUNDLE="+e.caFile(), "NO_PROXY=")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("python requests (install python3-requests; make test does): %v: %s", err, out)
		}
		code, body, _ := strings.Cut(string(out), " ")
		var n int
		fmt.Sscan(code, &n)
		return n, body
	},
}

func TestRealClientsAreRefusedAfterCancel(t *testing.T) {
	for name, send := range agents {
		for _, scheme := range []string{"http", "https"} {
			t.Run(name+"/"+scheme, func(t *testing.T) {
				realClientWalk(t, name, scheme, send)
			})
		}
	}
}

// realClientWalk: the agent's POST reaches the provider while the run is
// ACTIVE; after the cancel it gets the 409 and the provider sees nothing.
func realClientWalk(t *testing.T, name, scheme string, send agent) {
	p := newProvider(t, "api.provider.test")
	e := newEnv(t, withProvider(p, envOptions{}))
	run := "agent-" + name
	target := scheme + "://api.provider.test/v1/charges"

	code, body := send(t, e, run, target)
	if code != 200 || !strings.Contains(body, `"charged":true`) {
		t.Fatalf("while ACTIVE: %d %s", code, body)
	}
	e.cancel(run, time.Minute)
	code, body = send(t, e, run, target)
	var r refusalBody
	if err := json.Unmarshal([]byte(body), &r); err != nil || code != 409 || r.Error != "run_not_active" || r.Recorded != "CANCELLED_BEFORE_DISPATCH" {
		t.Fatalf("after cancel: %d %s", code, body)
	}
	if got := p.hits.Load(); got != 1 {
		t.Fatalf("provider saw %d requests, want 1 (none after the cancel)", got)
	}
}
