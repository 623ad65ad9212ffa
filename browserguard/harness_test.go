package browserguard_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/stopgate/stopgate/browserguard"
	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/proxy"
	"github.com/stopgate/stopgate/runwatch"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/telemetry"
)

// The test binary is the browsers' sandbox helper, as stopgate is serve's.
func init() { browserguard.SandboxMain() }

func testBinary(t testing.TB) string {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return exe
}

// upstream is a site on loopback; hits counts the page loads reaching it
// (a favicon is not a page load).
type upstream struct {
	*testkit.Upstream
	hits atomic.Int64
}

const pageHTML = `<!doctype html><html><head><title>guarded page</title><link rel="icon" href="data:,"></head>
<body><p id="text">hello from upstream</p>
<button id="go" style="position:absolute;left:10px;top:10px;width:100px;height:40px"
 onclick="document.getElementById('text').textContent='clicked'">go</button></body></html>`

func newUpstream(t testing.TB) *upstream {
	t.Helper()
	u := &upstream{}
	u.Upstream = testkit.NewUpstream(t, false, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/favicon.ico" {
			http.NotFound(w, r)
			return
		}
		u.hits.Add(1)
		if r.URL.Path == "/gate" {
			// Held until stopgate cuts it, so a test decides when a
			// script's next step runs.
			<-r.Context().Done()
			return
		}
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		io.WriteString(w, pageHTML)
	})
	return u
}

// env is a store, the egress proxy, the launcher and the browser guard on
// loopback, as stopgate serve wires them.
type env struct {
	store    state.Store
	ledger   *intents.Ledger
	guard    *browserguard.Guard
	launcher *browserguard.Launcher
	// guardHost is the guard's host:port.
	guardHost string
	// profiles is where the launched browsers' profiles are.
	profiles string
	// metrics is the registry the launcher and the guard count in.
	metrics *prometheus.Registry
}

// newEnv wires an env; opts change the launcher's configuration (by
// default: no linger, no cap).
func newEnv(t *testing.T, store state.Store, opts ...func(*browserguard.LauncherConfig)) *env {
	t.Helper()
	log := testkit.Logger()
	reg := prometheus.NewRegistry()
	tel := telemetry.New(telemetry.Options{Registry: reg, Logger: log})
	// The machine is shared: a second for a store step fails closed on a
	// loaded one, and these tests test other things.
	ledger := intents.NewLedger(store, intents.LedgerOptions{Owner: "browserguard:test", LeaseTTL: 15 * time.Second, StoreTimeout: 5 * time.Second, Logger: log})
	watcher := runwatch.New(store, runwatch.Options{Interval: 200 * time.Millisecond, StoreTimeout: 5 * time.Second, Logger: log})
	// The test sites listen on loopback, which the egress refuses by default.
	egress, err := proxy.New(proxy.Config{Ledger: ledger, Watcher: watcher, AutoAdmit: true, Logger: log, Rules: proxy.Rules{AllowDest: []string{"127.0.0.1"}}})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lcfg := browserguard.LauncherConfig{
		Chromium: testkit.Chromium(t), Ledger: ledger, Watcher: watcher, Egress: egress.ForRun, GuardAddr: ln.Addr().String(),
		AutoAdmit: true, TempDir: t.TempDir(), Logger: log, Telemetry: tel,
		Sandbox: browserguard.Sandbox{Helper: testBinary(t)},
		// The machine is shared: a start may wait for the CPU.
		StartTimeout: time.Minute,
	}
	for _, o := range opts {
		o(&lcfg)
	}
	launcher, err := browserguard.NewLauncher(lcfg)
	if err != nil {
		t.Fatal(err)
	}
	guard, err := browserguard.New(browserguard.Config{
		Store: store, Ledger: ledger, Watcher: watcher, Browsers: launcher.DevTools, AutoAdmit: true,
		StoreTimeout: 5 * time.Second, Logger: log, Telemetry: tel,
		Tokens: lcfg.Tokens, RequireToken: lcfg.RequireToken, Uploads: lcfg.Sandbox.Uploads,
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: guard, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	ctx, cancel := context.WithCancel(context.Background())
	for _, loop := range []func(context.Context){watcher.Run, ledger.Run} {
		go loop(ctx)
	}
	t.Cleanup(func() {
		sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer scancel()
		if err := guard.Close(sctx); err != nil {
			t.Errorf("closing the guard: %v", err)
		}
		if err := launcher.Close(sctx); err != nil {
			t.Errorf("closing the launcher: %v", err)
		}
		_ = srv.Close()
		cancel()
	})
	return &env{store: store, ledger: ledger, guard: guard, launcher: launcher, guardHost: ln.Addr().String(), profiles: lcfg.TempDir, metrics: reg}
}

// launch starts the run's browser and returns its guarded websocket URL.
func (e *env) launch(t *testing.T, run string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	got, err := e.launcher.Launch(ctx, browserguard.LaunchRequest{Run: run, Actor: "test"})
	if err != nil {
		t.Fatalf("launch: %v", err)
	}
	if !got.Guard.Admitted || !got.Created || !strings.HasPrefix(got.WSURL, "ws://"+e.guardHost+"/run/"+run+"/") {
		t.Fatalf("launch answered %+v", got)
	}
	return got.WSURL
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// intentsOf returns the run's intents of a boundary with a method.
func intentsOf(t *testing.T, s state.Store, run string, boundary state.Boundary, method string) []state.Intent {
	t.Helper()
	all, err := s.Intents(context.Background(), run)
	if err != nil {
		t.Fatalf("intents of %s: %v", run, err)
	}
	var out []state.Intent
	for _, in := range all {
		if in.Boundary == boundary && (method == "" || in.Method == method) {
			out = append(out, in)
		}
	}
	return out
}

func describe(ins []state.Intent) string {
	var b strings.Builder
	for _, in := range ins {
		fmt.Fprintf(&b, "\n  %s %s %s %s %q", in.Key, in.Method, in.Target, in.State, in.Reason)
	}
	return b.String()
}

// rawCDP is a CDP client that speaks frames directly, for what no real
// client would send.
type rawCDP struct {
	t    *testing.T
	conn *websocket.Conn
	ctx  context.Context
	next int64
}

// answer is one CDP answer.
type answer struct {
	ID        *int64          `json:"id"`
	SessionID string          `json:"sessionId"`
	Result    json.RawMessage `json:"result"`
	Error     *struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
		Data    string `json:"data"`
	} `json:"error"`
}

func dialCDP(t *testing.T, wsURL string) *rawCDP {
	t.Helper()
	ctx := testCtx(t)
	c, _, err := websocket.Dial(ctx, wsURL, nil)
	if err != nil {
		t.Fatalf("dial %s: %v", wsURL, err)
	}
	c.SetReadLimit(64 << 20)
	t.Cleanup(func() { _ = c.CloseNow() })
	return &rawCDP{t: t, conn: c, ctx: ctx, next: 1000}
}

func (r *rawCDP) send(typ websocket.MessageType, frame []byte) {
	r.t.Helper()
	if err := r.conn.Write(r.ctx, typ, frame); err != nil {
		r.t.Fatalf("write frame: %v", err)
	}
}

// next answer that is not an event.
func (r *rawCDP) answer() answer {
	r.t.Helper()
	for {
		ctx, cancel := context.WithTimeout(r.ctx, 20*time.Second)
		_, data, err := r.conn.Read(ctx)
		cancel()
		if err != nil {
			r.t.Fatalf("read answer: %v", err)
		}
		var a answer
		var probe struct {
			Method string `json:"method"`
		}
		if json.Unmarshal(data, &probe) == nil && probe.Method != "" {
			continue // an event
		}
		if err := json.Unmarshal(data, &a); err != nil {
			r.t.Fatalf("answer is not JSON: %v: %s", err, data)
		}
		return a
	}
}

// call sends a command and returns its answer.
func (r *rawCDP) call(session, method string, params any) answer {
	r.t.Helper()
	r.next++
	id := r.next
	b := testkit.CDPCommand(id, session, method, params)
	r.send(websocket.MessageText, b)
	for {
		a := r.answer()
		if a.ID != nil && *a.ID == id {
			return a
		}
	}
}

// attachPage attaches to the browser's first page and returns the session.
func (r *rawCDP) attachPage() string {
	r.t.Helper()
	targets := r.call("", "Target.getTargets", nil)
	pages, err := testkit.PageTargets(targets.Result)
	if targets.Error != nil || err != nil {
		r.t.Fatalf("Target.getTargets: %+v %s", targets.Error, targets.Result)
	}
	if len(pages) == 0 {
		r.t.Fatalf("the browser has no page: %s", targets.Result)
	}
	a := r.call("", "Target.attachToTarget", map[string]any{"targetId": pages[0], "flatten": true})
	var res struct {
		SessionID string `json:"sessionId"`
	}
	if a.Error != nil || json.Unmarshal(a.Result, &res) != nil || res.SessionID == "" {
		r.t.Fatalf("Target.attachToTarget: %+v %s", a.Error, a.Result)
	}
	return res.SessionID
}
