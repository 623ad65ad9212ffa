package proxy_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/policy"
	"github.com/stopgate/stopgate/proxy"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/runwatch"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/telemetry"
)

func newUpstream(t testing.TB, tlsOn bool, handler http.HandlerFunc) *testkit.Upstream {
	return testkit.NewUpstream(t, tlsOn, handler)
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
	noEffects   []string
	readEffects []string
	staticRun   string
	maxBody     int64
	noAutoAdmit bool
	leaseTTL    time.Duration
	dial        func(ctx context.Context, network, addr string) (net.Conn, error)
	roots       *x509.CertPool
	tokens      *runtoken.Signer
	requireTok  bool
	// registry, if set, receives the proxy's metrics.
	registry prometheus.Registerer
	// storeTimeout bounds each store step (5s when zero).
	storeTimeout time.Duration
	// asShipped leaves out the allow every other test has for its
	// loopback upstreams: the destination rules as an operator gets them.
	asShipped bool
	allowDest []string
	denyDest  []string
	// reportDest and defaultDest: the policy's destinations.report and
	// destinations.default.
	reportDest  []string
	defaultDest policy.DestinationDefault
	protected   []proxy.Protected
	resolve     func(ctx context.Context, host string) ([]netip.Addr, error)
	runs        proxy.RunReader
	// maxConns, maxPerRun, handshake and idle: the caps and timeouts (0: defaults).
	maxConns, maxPerRun int
	handshake, idle     time.Duration
	// policy, if set, gives the rules its budgets, LLM APIs and
	// tripwires (RulesOf), with the allows above.
	policy *policy.Policy
	// policyYAML, if set, is a policy document whose rules the proxy
	// applies as serve does (policy.Parse, then proxy.RulesOf), in place of
	// the lists above.
	policyYAML string
}

// testUpstreams is the one allow the tests need: their upstreams listen on
// loopback, which the proxy refuses by default.
const testUpstreams = "127.0.0.1"

func newEnv(t testing.TB, opts envOptions) *env {
	t.Helper()
	if opts.store == nil {
		opts.store = testkit.FileStore(t)
	}
	dir := t.TempDir()
	ca, err := proxy.LoadOrCreateCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	pass, err := policy.NewHostSet(opts.passThrough)
	if err != nil {
		t.Fatal(err)
	}
	deliv, err := policy.NewHostSet(opts.delivery)
	if err != nil {
		t.Fatal(err)
	}
	none, err := policy.NewHostSet(opts.noEffects)
	if err != nil {
		t.Fatal(err)
	}
	reads, err := policy.NewHostSet(opts.readEffects)
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
	log := testkit.Logger()
	// A store that answers later than the timeout fails closed (503), and
	// a guard is fenced at half of it: on a loaded machine a second is not
	// enough for a bbolt writer queue, and this harness tests other things.
	storeTimeout := opts.storeTimeout
	if storeTimeout == 0 {
		storeTimeout = 5 * time.Second
	}
	ledger := intents.NewLedger(opts.store, intents.LedgerOptions{Owner: "proxy:test", LeaseTTL: ttl, StoreTimeout: storeTimeout, Logger: log})
	watcher := runwatch.New(opts.store, runwatch.Options{Interval: 200 * time.Millisecond, StoreTimeout: time.Second, Logger: log})
	tel := telemetry.New(telemetry.Options{Logger: log, Registry: opts.registry})
	allow := opts.allowDest
	if !opts.asShipped {
		allow = append([]string{testUpstreams}, allow...)
	}
	rules := proxy.Rules{
		PassThrough: pass, Delivery: deliv, NoEffects: none, ReadEffects: reads,
		AllowDest: allow, DenyDest: opts.denyDest, ReportDest: opts.reportDest, DefaultDest: opts.defaultDest,
	}
	if opts.policyYAML != "" {
		pol, err := policy.Parse([]byte(opts.policyYAML))
		if err != nil {
			t.Fatal(err)
		}
		opts.policy = &pol
	}
	if opts.policy != nil {
		if rules, err = proxy.RulesOf(*opts.policy, allow); err != nil {
			t.Fatal(err)
		}
		rules.CancelDrain = 5 * time.Second
	}
	p, err := proxy.New(proxy.Config{
		Ledger: ledger, Watcher: watcher, Telemetry: tel, CA: ca, StaticRun: opts.staticRun, AutoAdmit: !opts.noAutoAdmit,
		Rules:   rules,
		MaxBody: opts.maxBody, UpstreamRoots: opts.roots, DialContext: opts.dial, Tokens: opts.tokens, RequireToken: opts.requireTok,
		Logger: log, Protected: opts.protected, Resolve: opts.resolve, Runs: opts.runs,
		MaxConns: opts.maxConns, MaxConnsPerRun: opts.maxPerRun, HandshakeTimeout: opts.handshake, IdleTimeout: opts.idle,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go watcher.Run(ctx)
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
	return r.Run
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

// awaitCut waits (2s at most) until the audit log of run has a cut
// that match accepts.
func (e *env) awaitCut(run string, match func(state.Event) bool) {
	e.t.Helper()
	testkit.Eventually(e.t, 2*time.Second, "the cut in the audit log", func() bool {
		evs, err := e.store.Events(context.Background(), run)
		if err != nil {
			e.t.Fatal(err)
		}
		return slices.ContainsFunc(evs, func(ev state.Event) bool { return ev.Kind == state.EventIntentCut && match(ev) })
	})
}

func (e *env) intent(run, key string) state.Intent {
	e.t.Helper()
	in, err := e.store.Intent(context.Background(), run, key)
	if err != nil {
		e.t.Fatal(err)
	}
	return in
}

// streamed(t, n)(c.Get(…)) is a streamed answer and its reader, once its
// first n lines came; the answer is closed when the test ends.
func streamed(t testing.TB, n int) func(*http.Response, error) (*http.Response, *bufio.Reader) {
	return func(resp *http.Response, err error) (*http.Response, *bufio.Reader) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { resp.Body.Close() })
		lines := bufio.NewReader(resp.Body)
		for range n {
			if _, err := lines.ReadString('\n'); err != nil {
				t.Fatalf("stream before the cancel: %v", err)
			}
		}
		return resp, lines
	}
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
