package proxy_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/proxy"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
)

// upstream is a real HTTP(S) server on loopback that counts what reaches it.
type upstream struct {
	*httptest.Server
	hits    atomic.Int64
	mu      sync.Mutex
	headers []http.Header
	bodies  [][]byte
	handler http.HandlerFunc
}

func newUpstream(t testing.TB, tlsOn bool, handler http.HandlerFunc) *upstream {
	t.Helper()
	u := &upstream{handler: handler}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.hits.Add(1)
		body, _ := io.ReadAll(r.Body)
		u.mu.Lock()
		u.headers = append(u.headers, r.Header.Clone())
		u.bodies = append(u.bodies, body)
		u.mu.Unlock()
		if u.handler != nil {
			u.handler(w, r)
			return
		}
		fmt.Fprintf(w, "hello %s %s", r.Method, r.URL.Path)
	})
	if tlsOn {
		u.Server = httptest.NewTLSServer(h)
	} else {
		u.Server = httptest.NewServer(h)
	}
	t.Cleanup(u.Close)
	return u
}

func (u *upstream) lastHeader() http.Header {
	u.mu.Lock()
	defer u.mu.Unlock()
	if len(u.headers) == 0 {
		return nil
	}
	return u.headers[len(u.headers)-1]
}

// env is one stopgate proxy on a real loopback listener, over a real store.
type env struct {
	t      testing.TB
	store  state.Store
	proxy  *proxy.Proxy
	server *httptest.Server
	ca     *proxy.CA
	dir    string
}

type envOptions struct {
	store       state.Store
	passThrough []string
	delivery    []string
	staticRun   string
	maxBody     int64
	noAutoAdmit bool
	leaseTTL    time.Duration
	dial        func(ctx context.Context, network, addr string) (net.Conn, error)
	roots       *x509.CertPool
	tokens      *runtoken.Signer
	requireTok  bool
}

func newFileStore(t testing.TB) state.Store {
	t.Helper()
	s, err := filestore.Open(filepath.Join(t.TempDir(), "stopgate.db"), filestore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func newEnv(t testing.TB, opts envOptions) *env {
	t.Helper()
	if opts.store == nil {
		opts.store = newFileStore(t)
	}
	dir := t.TempDir()
	ca, err := proxy.LoadOrCreateCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	pass, err := proxy.NewHostSet(opts.passThrough)
	if err != nil {
		t.Fatal(err)
	}
	deliv, err := proxy.NewHostSet(opts.delivery)
	if err != nil {
		t.Fatal(err)
	}
	if opts.roots == nil {
		opts.roots = upstreamRoots(t)
	}
	ttl := opts.leaseTTL
	if ttl == 0 {
		ttl = 15 * time.Second
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ledger := intents.NewLedger(opts.store, intents.LedgerOptions{Owner: "proxy:test", LeaseTTL: ttl, StoreTimeout: time.Second, Logger: log})
	p, err := proxy.New(proxy.Config{
		Store: opts.store, Ledger: ledger, CA: ca, StaticRun: opts.staticRun, AutoAdmit: !opts.noAutoAdmit,
		PassThrough: pass, Delivery: deliv, MaxBody: opts.maxBody, UpstreamRoots: opts.roots, DialContext: opts.dial, Tokens: opts.tokens, RequireToken: opts.requireTok,
		RecheckInterval: 200 * time.Millisecond, StoreTimeout: time.Second, Logger: log,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go p.Run(ctx)
	go ledger.Run(ctx)
	srv := httptest.NewServer(p)
	t.Cleanup(func() { cancel(); srv.Close() })
	return &env{t: t, store: opts.store, proxy: p, server: srv, ca: ca, dir: dir}
}

var (
	rootsOnce sync.Once
	roots     *x509.CertPool
)

// upstreamRoots trusts httptest's TLS certificate, as a real deployment
// trusts system roots.
func upstreamRoots(t testing.TB) *x509.CertPool {
	rootsOnce.Do(func() {
		s := httptest.NewTLSServer(http.NotFoundHandler())
		defer s.Close()
		roots = x509.NewCertPool()
		roots.AddCert(s.Certificate())
	})
	return roots
}

// client is a Go net/http client that reaches everything through the proxy
// as run:version credentials, trusting the proxy's CA.
func (e *env) client(run string, version int64) *http.Client {
	u, _ := url.Parse(e.server.URL)
	if run != "" {
		if version > 0 {
			u.User = url.UserPassword(run, fmt.Sprint(version))
		} else {
			u.User = url.User(run)
		}
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(e.ca.PEM)
	return &http.Client{
		Timeout:   10 * time.Second,
		Transport: &http.Transport{Proxy: http.ProxyURL(u), TLSClientConfig: &tls.Config{RootCAs: pool}},
	}
}

func (e *env) admit(run string) state.Run {
	e.t.Helper()
	r, err := e.store.Admit(context.Background(), state.AdmitRequest{RunID: run, Actor: "test"})
	if err != nil {
		e.t.Fatal(err)
	}
	return r
}

func (e *env) cancel(run string, drain time.Duration) state.Run {
	e.t.Helper()
	res, err := e.store.Cancel(context.Background(), state.CancelRequest{RunID: run, Actor: "operator:test", Reason: "test", DrainTimeout: drain})
	if err != nil {
		e.t.Fatal(err)
	}
	return res.Run
}

func (e *env) intents(run string) []state.Intent {
	e.t.Helper()
	ins, err := e.store.Intents(context.Background(), run)
	if err != nil {
		e.t.Fatal(err)
	}
	return ins
}

func (e *env) intent(run, key string) state.Intent {
	e.t.Helper()
	in, err := e.store.Intent(context.Background(), run, key)
	if err != nil {
		e.t.Fatal(err)
	}
	return in
}

// do sends a request and reads the whole answer.
func do(t testing.TB, c *http.Client, method, target string, body io.Reader, header http.Header) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, target, body)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, target, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: read body: %v", method, target, err)
	}
	return resp, b
}

type refusalBody struct {
	Error           string `json:"error"`
	RunID           string `json:"run_id"`
	Status          string `json:"status"`
	CancelVersion   int64  `json:"cancel_version"`
	ObservedVersion int64  `json:"observed_version"`
	Intent          string `json:"intent"`
	Recorded        string `json:"recorded"`
	Message         string `json:"message"`
}

func decodeRefusal(t *testing.T, b []byte) refusalBody {
	t.Helper()
	var r refusalBody
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("refusal is not JSON: %v: %s", err, b)
	}
	return r
}

// eventually polls cond every 20ms for at most d.
func eventually(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if cond() {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("%s: not within %v", what, d)
}
