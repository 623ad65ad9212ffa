package refusal_test

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/stopgate/stopgate/browserguard"
	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/policy"
	"github.com/stopgate/stopgate/proxy"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/runwatch"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
)

// The refusal table across the edges: the same reason gets the same status,
// the same header and the same body on the egress proxy (plain requests),
// its pass-through tunnels (CONNECT), the control API, and — as a CDP error
// naming the code — the browser guard. Each row is produced for real at
// each edge that can produce it; "-" marks an edge where the reason cannot
// arise (a browser cannot be launched for a run nobody admitted, say).

const passThroughSuffix = ".tunnel.test"

// edges is one stopgate, as serve wires it, over one embedded store.
type edges struct {
	store   *filestore.Store
	proxy   *httptest.Server
	control *httptest.Server
	guard   *httptest.Server
	up      *testkit.Upstream
	// launch starts the run's browser and returns its guarded ws URL.
	launch func(t *testing.T, run string) string
}

func newEdges(t *testing.T, autoAdmit bool) *edges {
	t.Helper()
	log := testkit.Logger()
	store := testkit.FileStore(t)
	ledger := intents.NewLedger(store, intents.LedgerOptions{Owner: "edges:test", LeaseTTL: 15 * time.Second, StoreTimeout: time.Second, Logger: log})
	watcher := runwatch.New(store, runwatch.Options{Interval: 200 * time.Millisecond, StoreTimeout: time.Second, Logger: log})
	ca, err := proxy.LoadOrCreateCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	pass, err := policy.NewHostSet([]string{"*" + passThroughSuffix})
	if err != nil {
		t.Fatal(err)
	}
	// The upstream listens on loopback, which the egress refuses by default.
	egress, err := proxy.New(proxy.Config{Ledger: ledger, Watcher: watcher, CA: ca, AutoAdmit: autoAdmit, Rules: proxy.Rules{PassThrough: pass, AllowDest: []string{"127.0.0.1"}}, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	api, err := control.New(control.Options{Store: store, Open: true, DrainTimeout: time.Minute, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	e := &edges{store: store, proxy: httptest.NewServer(egress), control: httptest.NewServer(api), up: testkit.NewUpstream(t, false, nil)}
	t.Cleanup(e.proxy.Close)
	t.Cleanup(e.control.Close)

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	launcher, err := browserguard.NewLauncher(browserguard.LauncherConfig{
		Chromium: testkit.Chromium(t), Ledger: ledger, Watcher: watcher, Egress: egress.ForRun, GuardAddr: ln.Addr().String(),
		AutoAdmit: autoAdmit, TempDir: t.TempDir(), Logger: log, Sandbox: browserguard.Sandbox{Helper: os.Args[0]},
	})
	if err != nil {
		t.Fatal(err)
	}
	guard, err := browserguard.New(browserguard.Config{Store: store, Ledger: ledger, Watcher: watcher, Browsers: launcher.DevTools, AutoAdmit: autoAdmit, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	e.guard = httptest.NewUnstartedServer(guard)
	e.guard.Listener.Close()
	e.guard.Listener = ln
	e.guard.Start()
	ctx, cancel := context.WithCancel(context.Background())
	go watcher.Run(ctx)
	go ledger.Run(ctx)
	t.Cleanup(func() {
		sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer scancel()
		_ = guard.Close(sctx)
		_ = launcher.Close(sctx)
		e.guard.Close()
		cancel()
	})
	e.launch = func(t *testing.T, run string) string {
		t.Helper()
		got, err := launcher.Launch(context.Background(), browserguard.LaunchRequest{Run: run, Actor: "test"})
		if err != nil || !got.Guard.Admitted {
			t.Fatalf("launch a browser for %s: %+v %v", run, got, err)
		}
		return got.WSURL
	}
	return e
}

// The test binary is the browsers' sandbox helper, as stopgate is serve's.
func init() { browserguard.SandboxMain() }

// answer is what an HTTP edge said.
type answer struct {
	status int
	header http.Header
	body   refusal.Refusal
	raw    string
}

func read(t *testing.T, resp *http.Response) answer {
	t.Helper()
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	a := answer{status: resp.StatusCode, header: resp.Header, raw: string(raw)}
	if resp.StatusCode < 400 {
		return a
	}
	if err := json.Unmarshal(raw, &a.body); err != nil {
		t.Fatalf("answer %d is not a refusal body (%v): %s", resp.StatusCode, err, raw)
	}
	return a
}

func basic(run, version string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(run+":"+version))
}

// viaProxy sends a plain request through the egress proxy.
func (e *edges) viaProxy(t *testing.T, method, auth string, header http.Header, body string) answer {
	t.Helper()
	req, err := http.NewRequest(method, e.up.URL+"/effect", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header[k] = v
	}
	if auth != "" {
		req.Header.Set("Proxy-Authorization", auth)
	}
	pu, _ := url.Parse(e.proxy.URL)
	c := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(pu)}, Timeout: 10 * time.Second}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return read(t, resp)
}

// viaTunnel sends a CONNECT for a pass-through host, on a raw connection,
// as any client does before its TLS handshake.
func (e *edges) viaTunnel(t *testing.T, host, auth string) answer {
	t.Helper()
	conn, err := net.DialTimeout("tcp", e.proxy.Listener.Addr().String(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n", host, host)
	if auth != "" {
		fmt.Fprintf(conn, "Proxy-Authorization: %s\r\n", auth)
	}
	fmt.Fprintf(conn, "\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(conn), &http.Request{Method: http.MethodConnect})
	if err != nil {
		t.Fatal(err)
	}
	return read(t, resp)
}

// viaControl calls the control API.
func (e *edges) viaControl(t *testing.T, method, path, body string) answer {
	t.Helper()
	req, err := http.NewRequest(method, e.control.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return read(t, resp)
}

// cdp connects a CDP client to the browser at ws and opens a page with a
// first navigation, whose error it returns: the connection's first
// commands (a new target) are actions, guarded like any other. The browser
// lives as long as the returned context, which is the one chromedp's first
// command was given.
func cdp(t *testing.T, ws string) (context.Context, error) {
	t.Helper()
	ctx, cancel := testkit.Attach(context.Background(), ws)
	t.Cleanup(cancel)
	return ctx, chromedp.Do(ctx, chromedp.Navigate("about:blank"))
}

// navigate asks the browser to go to target and returns the CDP error.
func navigate(ctx context.Context, target string) error {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	return chromedp.Do(ctx, chromedp.Navigate(target))
}

// wantHTTP checks an HTTP edge's refusal against the one table.
func wantHTTP(t *testing.T, edge string, code refusal.Code, a answer) {
	t.Helper()
	if a.status != code.Status() || a.body.Code != code || a.header.Get(refusal.Header) != string(code) || a.body.Message == "" {
		t.Errorf("%s: %d %q (header %q), want %d %q with a message: %s", edge, a.status, a.body.Code, a.header.Get(refusal.Header), code.Status(), code, a.raw)
	}
}

// wantCDP checks the browser guard's rendering of a refusal: a CDP error
// led by the refused command and the code.
func wantCDP(t *testing.T, code refusal.Code, err error) {
	t.Helper()
	if err == nil || !strings.Contains(err.Error(), "stopgate refused ") || !strings.Contains(err.Error(), ": "+string(code)+": ") {
		t.Errorf("browser: %v, want a CDP error saying stopgate refused a command: %s", err, code)
	}
}

func TestRefusalTableAcrossEdges(t *testing.T) {
	e := newEdges(t, true)
	ctx := context.Background()
	admit := func(run string) {
		if _, err := e.store.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "test"}); err != nil {
			t.Fatal(err)
		}
	}
	cancel := func(run string) {
		if _, err := e.store.Cancel(ctx, state.CancelRequest{RunID: run, Actor: "test", DrainTimeout: time.Minute}); err != nil {
			t.Fatal(err)
		}
	}
	tunnelHost := "api" + passThroughSuffix + ":443"

	// The browser of run b, held CANCELLING by a claim in flight so that
	// its connection stays open after the cancel.
	admit("b")
	ws := e.launch(t, "b")
	browser, err := cdp(t, ws)
	if err != nil {
		t.Fatalf("the browser of an ACTIVE run: %v", err)
	}
	if _, err := e.store.Guard(ctx, state.GuardRequest{RunID: "b", Key: "claim:hold", ExplicitKey: true, Boundary: state.BoundaryClaim, LeaseTTL: time.Hour, LeaseOwner: "test"}); err != nil {
		t.Fatal(err)
	}

	t.Run("stale_version", func(t *testing.T) {
		admit("s")
		wantHTTP(t, "proxy", refusal.StaleVersion, e.viaProxy(t, "POST", basic("s", "7"), nil, "x"))
		wantHTTP(t, "tunnel", refusal.StaleVersion, e.viaTunnel(t, tunnelHost, basic("s", "7")))
		wantHTTP(t, "control", refusal.StaleVersion, e.viaControl(t, "POST", "/v1/runs/s/claims", `{"step_id":"s","cancel_version":7}`))
		// The same browser, reached by an agent that says it saw version 9.
		_, err := cdp(t, strings.Replace(ws, "/run/b/1/", "/run/b/9/", 1))
		wantCDP(t, refusal.StaleVersion, err)
	})
	t.Run("run_not_active", func(t *testing.T) {
		admit("c")
		cancel("c")
		a := e.viaProxy(t, "POST", basic("c", ""), nil, "x")
		wantHTTP(t, "proxy", refusal.RunNotActive, a)
		if a.body.Recorded != state.IntentCancelledBeforeDispatch || a.body.Run == nil || a.body.Run.Status != state.StatusCancelling || a.body.RunID != "c" {
			t.Errorf("proxy body lacks the contract's fields: %s", a.raw)
		}
		wantHTTP(t, "tunnel", refusal.RunNotActive, e.viaTunnel(t, tunnelHost, basic("c", "")))
		wantHTTP(t, "control", refusal.RunNotActive, e.viaControl(t, "POST", "/v1/runs/c/claims", `{"step_id":"s"}`))
		cancel("b")
		wantCDP(t, refusal.RunNotActive, navigate(browser, e.up.URL+"/after-cancel"))
	})
	t.Run("intent_in_progress", func(t *testing.T) {
		admit("p")
		if _, err := e.store.Guard(ctx, state.GuardRequest{RunID: "p", Key: "pay-1", ExplicitKey: true, Boundary: state.BoundaryHTTP, LeaseTTL: time.Hour, LeaseOwner: "test"}); err != nil {
			t.Fatal(err)
		}
		wantHTTP(t, "proxy", refusal.IntentInProgress, e.viaProxy(t, "POST", basic("p", ""), http.Header{"Idempotency-Key": {"pay-1"}}, "x"))
		wantHTTP(t, "control", refusal.IntentInProgress, e.viaControl(t, "POST", "/v1/runs/p/intents", `{"key":"pay-1"}`))
	})
	t.Run("idempotency_key_reused", func(t *testing.T) {
		admit("k")
		if a := e.viaProxy(t, "POST", basic("k", ""), http.Header{"Idempotency-Key": {"charge-1"}}, "first"); a.status != http.StatusOK {
			t.Fatalf("the first request under the key answered %d: %s", a.status, a.raw)
		}
		wantHTTP(t, "proxy", refusal.KeyReused, e.viaProxy(t, "POST", basic("k", ""), http.Header{"Idempotency-Key": {"charge-1"}}, "second"))
		e.viaControl(t, "POST", "/v1/runs/k/intents", `{"key":"mail-1","body_digest":"sha256:aa"}`)
		e.viaControl(t, "PATCH", "/v1/runs/k/intents/mail-1", `{"outcome":"responded"}`)
		wantHTTP(t, "control", refusal.KeyReused, e.viaControl(t, "POST", "/v1/runs/k/intents", `{"key":"mail-1","body_digest":"sha256:bb"}`))
	})
	t.Run("invalid_request", func(t *testing.T) {
		wantHTTP(t, "proxy", refusal.InvalidRequest, e.viaProxy(t, "POST", basic("i", ""), http.Header{"Idempotency-Key": {strings.Repeat("k", state.MaxKeyLen+1)}}, "x"))
		// An over-long pass-through target is a bad request, not a store outage.
		long := strings.Repeat("a", state.MaxTargetLen) + passThroughSuffix + ":443"
		wantHTTP(t, "tunnel", refusal.InvalidRequest, e.viaTunnel(t, long, basic("i", "")))
		wantHTTP(t, "control", refusal.InvalidRequest, e.viaControl(t, "POST", "/v1/runs/i/claims", `{"step_id":"a b"}`))
	})
	t.Run("no_run_identity", func(t *testing.T) {
		a := e.viaProxy(t, "GET", "", nil, "")
		wantHTTP(t, "proxy", refusal.NoRunIdentity, a)
		if a.header.Get("Proxy-Authenticate") == "" {
			t.Errorf("proxy: 407 without Proxy-Authenticate")
		}
		wantHTTP(t, "tunnel", refusal.NoRunIdentity, e.viaTunnel(t, tunnelHost, ""))
	})
	t.Run("store_unavailable", func(t *testing.T) {
		admit("d")
		if err := e.store.Close(); err != nil {
			t.Fatal(err)
		}
		wantHTTP(t, "proxy", refusal.StoreUnavailable, e.viaProxy(t, "POST", basic("d", ""), nil, "x"))
		wantHTTP(t, "tunnel", refusal.StoreUnavailable, e.viaTunnel(t, tunnelHost, basic("d", "")))
		wantHTTP(t, "control", refusal.StoreUnavailable, e.viaControl(t, "POST", "/v1/runs/d/claims", `{"step_id":"s"}`))
		// With the store down the guard cannot read b's row, whatever it is.
		wantCDP(t, refusal.StoreUnavailable, navigate(browser, e.up.URL+"/store-down"))
	})
	if n := e.up.Hits.Load(); n != 1 {
		t.Errorf("the upstream saw %d requests, want only the one admitted first request of idempotency_key_reused", n)
	}
}

// TestRunNotAdmittedIsTheSameEverywhere: with auto-admit off, a run nobody
// admitted is one refusal, 409 run_not_admitted, on every edge that can
// meet it (the control API never admits on sight).
func TestRunNotAdmittedIsTheSameEverywhere(t *testing.T) {
	e := newEdges(t, false)
	wantHTTP(t, "proxy", refusal.RunNotAdmitted, e.viaProxy(t, "POST", basic("ghost", ""), nil, "x"))
	wantHTTP(t, "tunnel", refusal.RunNotAdmitted, e.viaTunnel(t, "api"+passThroughSuffix+":443", basic("ghost", "")))
	wantHTTP(t, "control", refusal.RunNotAdmitted, e.viaControl(t, "POST", "/v1/runs/ghost/claims", `{"step_id":"s"}`))
	if n := e.up.Hits.Load(); n != 0 {
		t.Errorf("the upstream saw %d requests", n)
	}
}

// TestReservedKeysAreRefusedTheSameByProxyAndControl: the keys of queue
// claims and retries are stopgate's, in any case, on both edges that take a
// key from their caller (the proxy's Idempotency-Key, the control API's
// generic intents), with the one sentence package state words; nothing is
// recorded and nothing reaches the upstream.
func TestReservedKeysAreRefusedTheSameByProxyAndControl(t *testing.T) {
	e := newEdges(t, true)
	if _, err := e.store.Admit(context.Background(), state.AdmitRequest{RunID: "r", Actor: "test"}); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"claim:x", "CLAIM:x", "Retry:s:2", "rEtRy:"} {
		rule := state.CheckUnreserved(key)
		if rule == nil {
			t.Fatalf("state.CheckUnreserved(%q) = nil: the rule this test holds the edges to is gone", key)
		}
		why := state.Why(rule)
		for edge, a := range map[string]answer{
			"proxy":   e.viaProxy(t, "POST", basic("r", ""), http.Header{"Idempotency-Key": {key}}, "x"),
			"control": e.viaControl(t, "POST", "/v1/runs/r/intents", `{"key":"`+key+`"}`),
		} {
			wantHTTP(t, edge, refusal.InvalidRequest, a)
			if !strings.Contains(a.body.Message, why) {
				t.Errorf("%s: key %q refused with %q, want the rule's words %q", edge, key, a.body.Message, why)
			}
		}
	}
	for _, key := range []string{"claimx", "my-claim:x", "retry"} {
		if err := state.CheckUnreserved(key); err != nil {
			t.Errorf("state.CheckUnreserved(%q) = %v: only the prefixes themselves are reserved", key, err)
		}
	}
	if n := e.up.Hits.Load(); n != 0 {
		t.Errorf("the upstream saw %d requests under reserved keys, want none", n)
	}
	ins, err := e.store.Intents(context.Background(), "r")
	if err != nil || len(ins) != 0 {
		t.Errorf("intents recorded under reserved keys: %+v %v", ins, err)
	}
}

// TestJSONAnswersHaveOneShapeOfHeaders: a JSON answer of the control API,
// one of the browser guard's discovery endpoints and a refusal carry the
// same headers (one writer, refusal.WriteJSON, behind all of them).
func TestJSONAnswersHaveOneShapeOfHeaders(t *testing.T) {
	e := newEdges(t, true)
	if _, err := e.store.Admit(context.Background(), state.AdmitRequest{RunID: "j", Actor: "test"}); err != nil {
		t.Fatal(err)
	}
	ws := e.launch(t, "j")
	version := strings.Replace(ws[:strings.Index(ws, "/devtools/")], "ws://", "http://", 1) + "/json/version"
	get := func(url string) *http.Response {
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	answers := map[string]*http.Response{
		"control /healthz":              get(e.control.URL + "/healthz"),
		"browser guard /json/version":   get(version),
		"control refusal (no such run)": get(e.control.URL + "/v1/runs/nobody"),
	}
	for name, resp := range answers {
		if name != "control refusal (no such run)" && resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d", name, resp.StatusCode)
		}
		for _, h := range []string{"Content-Type", "Cache-Control", "X-Content-Type-Options"} {
			if got, want := resp.Header.Get(h), answers["control /healthz"].Header.Get(h); got != want || got == "" {
				t.Errorf("%s: %s %q, the control API's %q", name, h, got, want)
			}
		}
	}
}

// TestProxyAndBrowserRecordTheSameTarget: a request through the egress
// proxy and a navigation of the guarded browser to the same URL are
// recorded under the same target (intents.RecordedTarget): where they
// went, without the query's secret.
func TestProxyAndBrowserRecordTheSameTarget(t *testing.T) {
	e := newEdges(t, true)
	ctx := context.Background()
	if _, err := e.store.Admit(ctx, state.AdmitRequest{RunID: "t", Actor: "test"}); err != nil {
		t.Fatal(err)
	}
	target := e.up.URL + "/page?token=s3cret"
	req, err := http.NewRequest("GET", target, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Proxy-Authorization", basic("t", ""))
	pu, _ := url.Parse(e.proxy.URL)
	resp, err := (&http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(pu)}, Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	browser, err := cdp(t, e.launch(t, "t"))
	if err != nil {
		t.Fatal(err)
	}
	if err := navigate(browser, target); err != nil {
		t.Fatal(err)
	}
	ins, err := e.store.Intents(ctx, "t")
	if err != nil {
		t.Fatal(err)
	}
	byBoundary := map[state.Boundary]string{}
	for _, in := range ins {
		if in.Boundary == state.BoundaryHTTP || in.Boundary == state.BoundaryBrowser && strings.HasPrefix(in.Target, "http") {
			byBoundary[in.Boundary] = in.Target
		}
	}
	want := e.up.URL + "/page"
	if byBoundary[state.BoundaryHTTP] != want || byBoundary[state.BoundaryBrowser] != want {
		t.Fatalf("recorded targets %v, want %s for both the proxy's request and the browser's navigation", byBoundary, want)
	}
}
