package browserguard_test

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/coder/websocket"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
)

// TestChromedpThroughTheGuard drives a real Chromium with chromedp through
// the guard: actions work and are recorded while the run is ACTIVE, the
// page loads go through the egress proxy, and after the cancel every
// action gets a CDP error naming the run's state while nothing new reaches
// the site. Once the run is CANCELLED its connection closes and its
// browser is stopped.
func TestChromedpThroughTheGuard(t *testing.T) {
	store := testkit.FileStore(t)
	e := newEnv(t, store)
	up := newUpstream(t)
	ws := e.launch(t, "r1")

	// Discovery through /json/version under the run's prefix, as
	// Playwright's and Puppeteer's connectOverCDP do it.
	for _, path := range []string{"/json/version", "/json/version/"} {
		resp, err := http.Get("http://" + e.guardHost + "/run/r1/1" + path)
		if err != nil {
			t.Fatal(err)
		}
		var doc struct {
			WS      string `json:"webSocketDebuggerUrl"`
			Browser string `json:"Browser"`
		}
		err = json.NewDecoder(resp.Body).Decode(&doc)
		resp.Body.Close()
		if err != nil || doc.WS != ws || doc.Browser == "" {
			t.Fatalf("GET %s: %v %+v, want webSocketDebuggerUrl %s", path, err, doc, ws)
		}
	}

	ctx, cancel := testkit.Attach(testCtx(t), ws)
	defer cancel()

	// The query is part of the key but not of the recorded target.
	if err := chromedp.Do(ctx, chromedp.Navigate(up.URL+"/?token=secret")); err != nil {
		t.Fatalf("navigate while ACTIVE: %v", err)
	}
	if title, err := chromedp.Run(ctx, chromedp.Title()); err != nil || title != "guarded page" {
		t.Fatalf("title: %q %v", title, err)
	}
	if err := chromedp.Do(ctx, chromedp.MouseClickXY(50, 30)); err != nil {
		t.Fatalf("click while ACTIVE: %v", err)
	}
	if text, err := chromedp.Run(ctx, chromedp.Text(chromedp.ID("text"))); err != nil || text != "clicked" {
		t.Fatalf("text after the click: %q %v", text, err)
	}
	if n := up.hits.Load(); n != 1 {
		t.Fatalf("the site saw %d page loads, want 1", n)
	}

	nav := intentsOf(t, store, "r1", state.BoundaryBrowser, "Page.navigate")
	if len(nav) != 1 || nav[0].State != state.IntentResponded || nav[0].Target != up.URL+"/" {
		t.Fatalf("Page.navigate intents:%s\nwant one RESPONDED for %s/", describe(nav), up.URL)
	}
	if clicks := intentsOf(t, store, "r1", state.BoundaryBrowser, "Input.dispatchMouseEvent"); len(clicks) < 2 {
		t.Fatalf("Input.dispatchMouseEvent intents:%s\nwant a press and a release", describe(clicks))
	}
	var loaded bool
	for _, in := range intentsOf(t, store, "r1", state.BoundaryHTTP, "GET") {
		loaded = loaded || in.Target == up.URL+"/" && in.State == state.IntentResponded && in.StatusCode == http.StatusOK
	}
	if !loaded {
		t.Fatalf("the page load is not an http intent of r1 (it did not go through the egress proxy):%s",
			describe(intentsOf(t, store, "r1", state.BoundaryHTTP, "")))
	}

	release := holdCancelling(t, store, "r1")
	if _, err := store.Cancel(context.Background(), state.CancelRequest{RunID: "r1", Actor: "test", Reason: "operator stop", DrainTimeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
	const state2 = "run_not_active: run r1 is CANCELLING at cancel_version 2 (the request observed 1): nothing was sent; recorded CANCELLED_BEFORE_DISPATCH"
	for _, tc := range []struct {
		method string
		do     func() error
	}{
		{"Page.navigate", func() error { return chromedp.Do(ctx, chromedp.Navigate(up.URL+"/next")) }},
		{"Input.dispatchMouseEvent", func() error { return chromedp.Do(ctx, chromedp.MouseClickXY(50, 30)) }},
		{"Runtime.evaluate", func() error {
			_, err := chromedp.Run(ctx, chromedp.Evaluate[int](`fetch("/from-script"); 1`))
			return err
		}},
	} {
		err := tc.do()
		t.Logf("chromedp %s after the cancel: %v", tc.method, err)
		want := "stopgate refused " + tc.method + ": " + state2
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s after the cancel: %v, want a CDP error saying %q", tc.method, err, want)
		}
	}
	// Reads still work: the agent can look at what it did.
	if entries, err := chromedp.Run(ctx, chromedp.NavigationEntries()); err != nil || len(entries.Entries) == 0 {
		t.Errorf("Page.getNavigationHistory after the cancel: %v %+v", err, entries)
	}
	time.Sleep(200 * time.Millisecond) // anything that slipped through would reach the site by now
	if n := up.hits.Load(); n != 1 {
		t.Fatalf("the site saw %d page loads after the cancel, want still 1", n)
	}
	var refused bool
	for _, in := range intentsOf(t, store, "r1", state.BoundaryBrowser, "Page.navigate") {
		refused = refused || in.Target == up.URL+"/next" && in.State == state.IntentCancelledBeforeDispatch
	}
	if !refused {
		t.Fatalf("no CANCELLED_BEFORE_DISPATCH intent for the refused navigation:%s",
			describe(intentsOf(t, store, "r1", state.BoundaryBrowser, "")))
	}

	release()
	// Nothing is in flight: the sweeper's tick makes the run CANCELLED,
	// and then its connection closes and its browser goes.
	// (The browser's own background requests may hold a tunnel open for a
	// moment; the egress proxy cuts it.)
	testkit.Eventually(t, 5*time.Second, "the sweeper's tick makes r1 CANCELLED", func() bool {
		row, err := store.Tick(context.Background(), state.TickRequest{RunID: "r1", Actor: "test"})
		return err == nil && row.Status == state.StatusCancelled
	})
	testkit.Eventually(t, 5*time.Second, "the CDP connection of the CANCELLED run closes", func() bool { return e.guard.Connections() == 0 })
	testkit.Eventually(t, 10*time.Second, "the browser of the CANCELLED run stops", func() bool { _, ok := e.launcher.DevTools("r1"); return !ok })
	if _, _, err := websocket.Dial(testCtx(t), ws, nil); err == nil {
		t.Fatal("a new CDP connection for the CANCELLED run was accepted")
	}
	err := chromedp.Do(ctx, chromedp.Navigate(up.URL+"/closed"))
	if err == nil {
		t.Fatal("chromedp navigated after its connection closed")
	}
	t.Logf("chromedp after the browser stopped: %v", err)
}

// TestBadFramesGetCDPErrors: whatever a client sends, a frame the guard
// cannot read as the browser would is answered with a CDP error, never
// forwarded, and the connection goes on working.
func TestBadFramesGetCDPErrors(t *testing.T) {
	store := testkit.FileStore(t)
	e := newEnv(t, store)
	c := dialCDP(t, e.launch(t, "r2"))

	huge := `{"id":11,"method":"Runtime.evaluate","params":{"expression":"` + strings.Repeat("a", 16<<20) + `"}}`
	id := func(n int64) *int64 { return &n }
	for _, tc := range []struct {
		name  string
		typ   websocket.MessageType
		frame string
		id    *int64
		say   string
	}{
		{"not JSON", websocket.MessageText, "navigate please", nil, "frame is not JSON"},
		{"not an object", websocket.MessageText, `[1,2]`, nil, "not a JSON object"},
		{"not UTF-8", websocket.MessageText, "{\"id\":1,\"method\":\"\xff\"}", nil, "not valid UTF-8"},
		{"no id", websocket.MessageText, `{"method":"Page.navigate","params":{"url":"http://example.com/"}}`, nil, "command has no id"},
		{"id not an integer", websocket.MessageText, `{"id":"4","method":"Browser.getVersion"}`, nil, "is not a 32-bit integer"},
		{"no method", websocket.MessageText, `{"id":5}`, id(5), "command 5 has no method"},
		{"method not a string", websocket.MessageText, `{"id":6,"method":["Page.navigate"]}`, id(6), "method is not a string"},
		{"binary", websocket.MessageBinary, `{"id":7,"method":"Browser.getVersion"}`, id(7), "binary frame"},
		{"method twice", websocket.MessageText, `{"id":8,"method":"DOM.getDocument","method":"Page.navigate"}`, id(8), `"method" appears twice`},
		{"escaped twin", websocket.MessageText, `{"id":9,"method":"DOM.getDocument","\u006dethod":"Page.navigate"}`, id(9), `"method" appears twice`},
		{"trailing data", websocket.MessageText, `{"id":10,"method":"Browser.getVersion"} {}`, id(10), "data after its JSON object"},
		{"over 16 MiB", websocket.MessageText, huge, id(11), "larger than 16777216 bytes"},
	} {
		c.send(tc.typ, []byte(tc.frame))
		a := c.answer()
		switch {
		case a.Error == nil:
			t.Errorf("%s: answered %s, want a CDP error", tc.name, a.Result)
		case a.Error.Code != -32600 || !strings.Contains(a.Error.Message, tc.say) || !strings.Contains(a.Error.Message, "nothing was forwarded"):
			t.Errorf("%s: error %d %q, want -32600 saying %q", tc.name, a.Error.Code, a.Error.Message, tc.say)
		case (a.ID == nil) != (tc.id == nil) || a.ID != nil && *a.ID != *tc.id:
			t.Errorf("%s: answer id %v, want %v", tc.name, a.ID, tc.id)
		}
	}
	a := c.call("", "Browser.getVersion", nil)
	if a.Error != nil || !strings.Contains(string(a.Result), "product") {
		t.Fatalf("a valid read after the bad frames: %+v %s", a.Error, a.Result)
	}
	for _, in := range intentsOf(t, store, "r2", state.BoundaryBrowser, "") {
		if in.Method != "launch" {
			t.Errorf("a bad frame was recorded as an action: %s %s %s", in.Key, in.Method, in.State)
		}
	}
}

// TestStoreDownFailsClosed: when the store does not answer, actions get a
// CDP error and nothing reaches the site; reads go on.
func TestStoreDownFailsClosed(t *testing.T) {
	t.Run("Embedded", func(t *testing.T) {
		store := testkit.FileStore(t)
		storeDown(t, store, func() { _ = store.Close() })
	})
	t.Run("Redis", func(t *testing.T) {
		srv := redisserver.Start(t, redisserver.Options{})
		store, err := redisstore.Open(testCtx(t), srv.URL(), redisstore.Options{OpTimeout: 500 * time.Millisecond, Logger: testkit.Logger()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = store.Close() })
		storeDown(t, store, srv.Kill)
	})
}

func storeDown(t *testing.T, store state.Store, down func()) {
	e := newEnv(t, store)
	up := newUpstream(t)
	c := dialCDP(t, e.launch(t, "r3"))
	page := c.attachPage()
	if a := c.call(page, "Page.navigate", map[string]any{"url": up.URL + "/"}); a.Error != nil {
		t.Fatalf("navigate with the store up: %+v", a.Error)
	}
	testkit.Eventually(t, 5*time.Second, "the first page load reaches the site", func() bool { return up.hits.Load() == 1 })

	down()
	for _, cmd := range []struct {
		method string
		params map[string]any
	}{
		{"Page.navigate", map[string]any{"url": up.URL + "/again"}},
		{"Runtime.evaluate", map[string]any{"expression": `fetch("/from-script")`}},
		{"Input.insertText", map[string]any{"text": "hello"}},
	} {
		a := c.call(page, cmd.method, cmd.params)
		msg := refusalOf(a)
		if !strings.Contains(msg, "store did not answer") || !strings.HasPrefix(msg, "stopgate refused "+cmd.method+": store_unavailable:") ||
			!strings.Contains(msg, "nothing was done (fail closed)") || !strings.Contains(msg, "run r3") {
			t.Errorf("%s with the store down: %+v %s, want a refusal saying the store did not answer", cmd.method, a.Error, a.Result)
		}
	}
	if a := c.call(page, "DOM.getDocument", nil); a.Error != nil {
		t.Errorf("a read with the store down: %+v", a.Error)
	}
	time.Sleep(200 * time.Millisecond)
	if n := up.hits.Load(); n != 1 {
		t.Fatalf("the site saw %d requests, want 1: something went out unguarded", n)
	}
}

// refusalOf is the guard's refusal in an answer: a CDP error (-32000), or,
// for a script evaluation, the Error the script is answered as having
// thrown; "" when the answer is neither.
func refusalOf(a answer) string {
	if a.Error != nil {
		if a.Error.Code != -32000 {
			return ""
		}
		return a.Error.Message
	}
	var r struct {
		ExceptionDetails *struct {
			Exception struct {
				Description string `json:"description"`
			} `json:"exception"`
		} `json:"exceptionDetails"`
	}
	if json.Unmarshal(a.Result, &r) != nil || r.ExceptionDetails == nil {
		return ""
	}
	return strings.TrimPrefix(r.ExceptionDetails.Exception.Description, "Error: ")
}

// TestGuardRefusesWhatIsNotACDPClient: foreign Host headers (DNS
// rebinding), cross-origin websockets (a web page), bad paths and runs
// without a browser are answered at the door.
func TestGuardRefusesWhatIsNotACDPClient(t *testing.T) {
	store := testkit.FileStore(t)
	e := newEnv(t, store)
	ws := e.launch(t, "r4")
	base := "http://" + e.guardHost
	for _, tc := range []struct {
		path, host string
		status     int
		code       string
	}{
		{"/run/r4/1/json/version", "evil.example:80", http.StatusForbidden, "host_not_allowed"},
		{"/run/r4/1/json/version", "localhost", http.StatusOK, ""},
		{"/run/nobody/1/json/version", "", http.StatusNotFound, "no_browser"},
		{"/run/bad%20run/1/json/version", "", http.StatusBadRequest, "bad_run_identity"},
		{"/run/r4/x/json/version", "", http.StatusBadRequest, "bad_run_identity"},
		{"/run/r4/1/json/new", "", http.StatusNotFound, "not_found"},
		{"/json/version", "", http.StatusNotFound, "not_found"},
	} {
		req, _ := http.NewRequest(http.MethodGet, base+tc.path, nil)
		if tc.host != "" {
			req.Host = tc.host
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != tc.status || resp.Header.Get("X-Stopgate-Refusal") != tc.code {
			t.Errorf("GET %s (Host %q): %d %q, want %d %q", tc.path, tc.host, resp.StatusCode, resp.Header.Get("X-Stopgate-Refusal"), tc.status, tc.code)
		}
	}
	_, resp, err := websocket.Dial(testCtx(t), ws, &websocket.DialOptions{HTTPHeader: http.Header{"Origin": {"http://evil.example"}}})
	if err == nil || resp == nil || resp.StatusCode != http.StatusForbidden {
		t.Errorf("a cross-origin websocket was not refused: %v", err)
	}
	if e.guard.Connections() != 0 {
		t.Errorf("%d connections open after refusals", e.guard.Connections())
	}
}

// sendEvaluate sends a Runtime.evaluate that awaits its promise, without
// waiting for the answer, and returns its id.
func (r *rawCDP) sendEvaluate(session, expression string) int64 {
	r.t.Helper()
	r.next++
	b, _ := json.Marshal(map[string]any{"id": r.next, "sessionId": session, "method": "Runtime.evaluate",
		"params": map[string]any{"expression": expression, "awaitPromise": true, "returnByValue": true}})
	r.send(websocket.MessageText, b)
	return r.next
}

// inFlight waits until the run has an IN_FLIGHT browser intent of method.
func inFlight(t *testing.T, s state.Store, run, method string) state.Intent {
	t.Helper()
	var got state.Intent
	testkit.Eventually(t, 5*time.Second, method+" is IN_FLIGHT", func() bool {
		for _, in := range intentsOf(t, s, run, state.BoundaryBrowser, method) {
			if in.State == state.IntentInFlight {
				got = in
				return true
			}
		}
		return false
	})
	return got
}

// TestActionInFlight: an action admitted before the cancel finishes and is
// recorded, but what it tries to do on the network after the cancel is
// refused by the egress proxy; an action whose connection drops, or whose
// drain deadline passes, is recorded UNKNOWN, and nothing new reaches the
// site either way.
func TestActionInFlight(t *testing.T) {
	store := testkit.FileStore(t)
	e := newEnv(t, store)
	up := newUpstream(t)

	t.Run("AcrossTheCancel", func(t *testing.T) {
		c := dialCDP(t, e.launch(t, "r5"))
		page := c.attachPage()
		if a := c.call(page, "Page.navigate", map[string]any{"url": up.URL + "/"}); a.Error != nil {
			t.Fatalf("navigate: %+v", a.Error)
		}
		testkit.Eventually(t, 5*time.Second, "the page load reaches the site", func() bool { return up.hits.Load() == 1 })
		// The script waits on a request the site holds; the cancel cuts it
		// (a GET is cut at once), and what the script sends next is new
		// work of a cancelled run.
		id := c.sendEvaluate(page, `fetch("/gate").catch(() => 0).then(() => fetch("/late")).then(x => x.status, () => -1)`)
		in := inFlight(t, store, "r5", "Runtime.evaluate")
		testkit.Eventually(t, 5*time.Second, "the script's first request is held at the site", func() bool { return up.hits.Load() == 2 })
		// The cut GET is UNKNOWN (bytes were sent): once the evaluate is
		// answered the run would be UNKNOWN and its connection closed,
		// racing the answer we read. A claim in flight keeps it draining.
		holdCancelling(t, store, "r5")
		if _, err := store.Cancel(context.Background(), state.CancelRequest{RunID: "r5", Actor: "test", DrainTimeout: time.Minute}); err != nil {
			t.Fatal(err)
		}
		var a answer
		for a = c.answer(); a.ID == nil || *a.ID != id; a = c.answer() {
		}
		if a.Error != nil || !strings.Contains(string(a.Result), `"value":409`) {
			t.Fatalf("the script's fetch after the cancel: %+v %s, want the egress proxy's 409", a.Error, a.Result)
		}
		if got, _ := store.Intent(context.Background(), "r5", in.Key); got.State != state.IntentResponded {
			t.Errorf("the evaluate admitted before the cancel is %s, want RESPONDED", got.State)
		}
		var refused bool
		for _, h := range intentsOf(t, store, "r5", state.BoundaryHTTP, "GET") {
			refused = refused || h.Target == up.URL+"/late" && h.State == state.IntentCancelledBeforeDispatch
		}
		if !refused || up.hits.Load() != 2 {
			t.Fatalf("the script's request after the cancel: refused %v, site hits %d (want refused, 2):%s",
				refused, up.hits.Load(), describe(intentsOf(t, store, "r5", state.BoundaryHTTP, "")))
		}
	})

	t.Run("ConnectionDrops", func(t *testing.T) {
		c := dialCDP(t, e.launch(t, "r6"))
		page := c.attachPage()
		c.sendEvaluate(page, `new Promise(() => {})`)
		in := inFlight(t, store, "r6", "Runtime.evaluate")
		_ = c.conn.CloseNow()
		testkit.Eventually(t, 5*time.Second, "the unanswered action is UNKNOWN", func() bool {
			got, _ := store.Intent(context.Background(), "r6", in.Key)
			return got.State == state.IntentUnknown && strings.Contains(got.Reason, "closed before the browser answered")
		})
	})

	t.Run("DrainDeadline", func(t *testing.T) {
		c := dialCDP(t, e.launch(t, "r7"))
		page := c.attachPage()
		c.sendEvaluate(page, `new Promise(() => {})`)
		in := inFlight(t, store, "r7", "Runtime.evaluate")
		if _, err := store.Cancel(context.Background(), state.CancelRequest{RunID: "r7", Actor: "test", DrainTimeout: 100 * time.Millisecond}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(150 * time.Millisecond)
		row, err := store.Tick(context.Background(), state.TickRequest{RunID: "r7", Actor: "test"})
		if err != nil || row.Status != state.StatusUnknown || row.StatusReason != state.ReasonDrainTimeout {
			t.Fatalf("tick past the drain deadline: %v %s (%s)", err, row.Status, row.StatusReason)
		}
		if got, _ := store.Intent(context.Background(), "r7", in.Key); got.State != state.IntentUnknown {
			t.Errorf("the action cut by the drain deadline is %s, want UNKNOWN", got.State)
		}
		// The client is told why its connection closes, then the browser goes.
		ctx, cancel := context.WithTimeout(c.ctx, 5*time.Second)
		defer cancel()
		for {
			if _, _, err := c.conn.Read(ctx); err != nil {
				if websocket.CloseStatus(err) != websocket.StatusPolicyViolation || !strings.Contains(err.Error(), "run r7 is UNKNOWN") {
					t.Fatalf("the UNKNOWN run's connection ended with %v, want 1008 naming the run's state", err)
				}
				break
			}
		}
		testkit.Eventually(t, 10*time.Second, "the browser of the UNKNOWN run stops", func() bool { _, ok := e.launcher.DevTools("r7"); return !ok })
	})
}

// TestPageEndpointIsGuarded: clients that find a page in /json/list and
// connect to its own endpoint are guarded the same way.
func TestPageEndpointIsGuarded(t *testing.T) {
	store := testkit.FileStore(t)
	e := newEnv(t, store)
	up := newUpstream(t)
	e.launch(t, "r8")
	resp, err := http.Get("http://" + e.guardHost + "/run/r8/1/json/list")
	if err != nil {
		t.Fatal(err)
	}
	var list []map[string]any
	err = json.NewDecoder(resp.Body).Decode(&list)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	var pageWS string
	for _, target := range list {
		if _, ok := target["devtoolsFrontendUrl"]; ok {
			t.Errorf("/json/list hands out a frontend URL around the guard: %v", target)
		}
		if ws, _ := target["webSocketDebuggerUrl"].(string); target["type"] == "page" && pageWS == "" {
			pageWS = ws
		}
	}
	if !strings.HasPrefix(pageWS, "ws://"+e.guardHost+"/run/r8/1/devtools/page/") {
		t.Fatalf("page endpoint %q is not the guard's (list %v)", pageWS, list)
	}
	c := dialCDP(t, pageWS)
	if a := c.call("", "Page.navigate", map[string]any{"url": up.URL + "/"}); a.Error != nil {
		t.Fatalf("navigate on the page endpoint: %+v", a.Error)
	}
	testkit.Eventually(t, 5*time.Second, "the page load reaches the site", func() bool { return up.hits.Load() == 1 })
	holdCancelling(t, store, "r8")
	if _, err := store.Cancel(context.Background(), state.CancelRequest{RunID: "r8", Actor: "test", DrainTimeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
	a := c.call("", "Page.navigate", map[string]any{"url": up.URL + "/again"})
	if a.Error == nil || !strings.Contains(a.Error.Message, "run r8 is CANCELLING") {
		t.Fatalf("navigate on the page endpoint after the cancel: %+v %s", a.Error, a.Result)
	}
	time.Sleep(200 * time.Millisecond)
	if n := up.hits.Load(); n != 1 {
		t.Fatalf("the site saw %d page loads, want 1", n)
	}
}

// holdCancelling keeps run draining: a claim of a worker still in flight, so
// that an outcome the browser's own background requests record meanwhile
// cannot drain the run to CANCELLED (and close its connection) before the
// test has looked at its refusals. Calling the result lets the claim go.
func holdCancelling(t *testing.T, store state.Store, run string) (release func()) {
	t.Helper()
	res, err := store.Guard(context.Background(), state.GuardRequest{
		RunID: run, Key: "claim:hold", ExplicitKey: true, Boundary: state.BoundaryClaim,
		LeaseOwner: "test", LeaseTTL: time.Minute, Actor: "test",
	})
	if err != nil || !res.Admitted {
		t.Fatalf("hold %s: %+v %v", run, res, err)
	}
	return func() {
		t.Helper()
		if _, err := store.Finish(context.Background(), state.FinishRequest{RunID: run, Key: "claim:hold", Attempt: res.Intent.Attempts, Outcome: state.IntentNotSent, Actor: "test"}); err != nil {
			t.Fatalf("release %s: %v", run, err)
		}
	}
}
