package browserguard_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/coder/websocket"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/stopgate/stopgate/browserguard"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/state"
)

// TestCleanAudit: a run whose page only visits a site on loopback has
// nothing else in its record. Chromium's own background calls (component
// updates, sign-in, field trials, network time, ...) would be recorded as
// the run's effects, since they go through its egress proxy; the launcher
// turns them off.
func TestCleanAudit(t *testing.T) {
	store := testkit.FileStore(t)
	e := newEnv(t, store)
	up := newUpstream(t)
	launched := time.Now()
	ws := e.launch(t, "clean")

	ctx, cancel := testkit.Attach(testCtx(t), ws)
	defer cancel()
	if err := chromedp.Do(ctx, chromedp.Navigate(up.URL+"/only")); err != nil {
		t.Fatalf("navigate: %v", err)
	}
	// The browser's own calls start within seconds of its start (sign-in
	// asks for the accounts at once and retries; the component updater
	// checks after a few seconds); give them that long to show.
	time.Sleep(time.Until(launched.Add(6 * time.Second)))

	site, err := url.Parse(up.URL)
	if err != nil {
		t.Fatal(err)
	}
	all, err := store.Intents(context.Background(), "clean")
	if err != nil {
		t.Fatal(err)
	}
	var loads, other []state.Intent
	for _, in := range all {
		if in.Boundary == state.BoundaryBrowser {
			continue
		}
		u, err := url.Parse(in.Target)
		if err != nil || u.Host != site.Host {
			other = append(other, in)
			continue
		}
		loads = append(loads, in)
	}
	if len(other) > 0 {
		t.Errorf("the run's record holds hosts its page never visited:%s", describe(other))
	}
	if len(loads) != 1 || loads[0].Target != up.URL+"/only" {
		t.Errorf("the page's own load is not the one request recorded:%s", describe(loads))
	}
}

// TestAttachIsNotALaunch: asking again for a run's browser hands out the
// same one, and the record says so: one launch, then an attach.
func TestAttachIsNotALaunch(t *testing.T) {
	store := testkit.FileStore(t)
	e := newEnv(t, store)
	ws := e.launch(t, "twice")
	again, err := e.launcher.Launch(testCtx(t), browserguard.LaunchRequest{Run: "twice", Actor: "test"})
	if err != nil || !again.Guard.Admitted || again.Created || again.WSURL != ws {
		t.Fatalf("second launch: %+v %v; want the same browser (%s), not created", again, err, ws)
	}
	launches := intentsOf(t, store, "twice", state.BoundaryBrowser, "launch")
	attaches := intentsOf(t, store, "twice", state.BoundaryBrowser, "attach")
	if len(launches) != 1 || len(attaches) != 1 || attaches[0].State != state.IntentResponded || !strings.Contains(attaches[0].Reason, "running since") {
		t.Fatalf("record: launches%s\nattaches%s\nwant one launch and one RESPONDED attach", describe(launches), describe(attaches))
	}
	// Both URLs reach the one browser.
	c := dialCDP(t, again.WSURL)
	if a := c.call("", "Browser.getVersion", nil); a.Error != nil {
		t.Fatalf("the attached URL does not reach the browser: %+v", a.Error)
	}
}

// TestBrowserCap: past the cap a launch is refused with a reason and
// recorded NOT_SENT; once a run is over and its browser gone, there is
// room again.
func TestBrowserCap(t *testing.T) {
	store := testkit.FileStore(t)
	e := newEnv(t, store, func(c *browserguard.LauncherConfig) { c.MaxBrowsers = 1 })
	e.launch(t, "first")
	got, err := e.launcher.Launch(testCtx(t), browserguard.LaunchRequest{Run: "second", Actor: "test"})
	if !errors.Is(err, browserguard.ErrBrowserLimit) || !strings.Contains(err.Error(), "1 browsers are running, the most this stopgate runs (--browser-max 1)") || got.WSURL != "" {
		t.Fatalf("launch past the cap: %+v %v; want ErrBrowserLimit saying why", got, err)
	}
	refused := intentsOf(t, store, "second", state.BoundaryBrowser, "launch")
	if len(refused) != 1 || refused[0].State != state.IntentNotSent || !strings.Contains(refused[0].Reason, "--browser-max 1") {
		t.Fatalf("the refused launch is not recorded NOT_SENT with its reason:%s", describe(refused))
	}

	if _, err := store.Cancel(context.Background(), state.CancelRequest{RunID: "first", Actor: "test"}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 5*time.Second, "the first run is CANCELLED", func() bool {
		row, err := store.Tick(context.Background(), state.TickRequest{RunID: "first", Actor: "test"})
		return err == nil && row.Status == state.StatusCancelled
	})
	testkit.Eventually(t, 15*time.Second, "the first run's browser stops", func() bool { _, ok := e.launcher.DevTools("first"); return !ok })
	if got, err := e.launcher.Launch(testCtx(t), browserguard.LaunchRequest{Run: "second", Actor: "test"}); err != nil || !got.Created {
		t.Fatalf("launch once there is room: %+v %v", got, err)
	}
}

// TestBrowserLingersAfterTheRunIsOver: once the run is CANCELLED its
// browser stays for the linger: actions get the refusal naming CANCELLED,
// reads (screenshot, DOM, accessibility tree) work, and a client may still
// connect to look. Then the browser stops, every connection is closed with
// the refusal as its reason, and a new one is refused with it.
func TestBrowserLingersAfterTheRunIsOver(t *testing.T) {
	store := testkit.FileStore(t)
	const linger = 8 * time.Second
	e := newEnv(t, store, func(c *browserguard.LauncherConfig) { c.Linger = linger })
	up := newUpstream(t)
	ws := e.launch(t, "l1")
	c := dialCDP(t, ws)
	page := c.attachPage()
	if a := c.call(page, "Page.navigate", map[string]any{"url": up.URL + "/"}); a.Error != nil {
		t.Fatalf("navigate while ACTIVE: %+v", a.Error)
	}
	// Loaded, not only requested: a page still committing its navigation
	// answers reads with "Not attached to an active page".
	testkit.Eventually(t, 20*time.Second, "the page is loaded", func() bool {
		a := c.call(page, "DOM.getDocument", map[string]any{"depth": 0})
		var doc struct {
			Root struct {
				DocumentURL string `json:"documentURL"`
			} `json:"root"`
		}
		return a.Error == nil && json.Unmarshal(a.Result, &doc) == nil && doc.Root.DocumentURL == up.URL+"/"
	})

	if _, err := store.Cancel(context.Background(), state.CancelRequest{RunID: "l1", Actor: "test", Reason: "operator stop"}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 5*time.Second, "the run is CANCELLED", func() bool {
		row, err := store.Tick(context.Background(), state.TickRequest{RunID: "l1", Actor: "test"})
		return err == nil && row.Status == state.StatusCancelled
	})
	over := time.Now()

	const refused = "run_not_active: run l1 is CANCELLED at cancel_version 2 (the request observed 1): nothing was sent; recorded CANCELLED_BEFORE_DISPATCH under "
	for _, cmd := range []struct {
		method string
		params map[string]any
	}{
		{"Page.navigate", map[string]any{"url": up.URL + "/after"}},
		{"Input.dispatchMouseEvent", map[string]any{"type": "mousePressed", "x": 10, "y": 10, "button": "left", "clickCount": 1}},
		{"Runtime.evaluate", map[string]any{"expression": "document.title"}},
	} {
		want := "stopgate refused " + cmd.method + ": " + refused
		if got := refusalOf(c.call(page, cmd.method, cmd.params)); !strings.HasPrefix(got, want) {
			t.Errorf("%s while the browser lingers: %q, want %q and the intent", cmd.method, got, want)
		}
	}
	for _, read := range []string{"Page.captureScreenshot", "DOM.getDocument", "Accessibility.getFullAXTree"} {
		if a := c.call(page, read, nil); a.Error != nil || len(a.Result) < 10 {
			t.Errorf("%s while the browser lingers: %+v %.80s", read, a.Error, a.Result)
		}
	}
	late := dialCDP(t, ws)
	if a := late.call("", "Target.getTargets", nil); a.Error != nil {
		t.Errorf("a connection opened while the browser lingers cannot read: %+v", a.Error)
	}
	if elapsed := time.Since(over); elapsed > linger {
		t.Fatalf("the checks took %s, longer than the linger (%s): the machine is too slow for this test", elapsed, linger)
	}

	const closed = "stopgate: run l1 is CANCELLED at cancel_version 2: browser closed (run_not_active)"
	for name, conn := range map[string]*rawCDP{"first": c, "late": late} {
		ctx, cancel := context.WithTimeout(context.Background(), linger+10*time.Second)
		var err error
		for err == nil {
			_, _, err = conn.conn.Read(ctx)
		}
		cancel()
		var ce websocket.CloseError
		if !errors.As(err, &ce) || ce.Code != websocket.StatusPolicyViolation || ce.Reason != closed {
			t.Errorf("the %s connection ended with %v, want 1008 %q", name, err, closed)
		}
	}
	testkit.Eventually(t, 10*time.Second, "the browser stops", func() bool { _, ok := e.launcher.DevTools("l1"); return !ok })
	_, resp, err := websocket.Dial(testCtx(t), ws, nil)
	if err == nil || resp == nil || resp.StatusCode != http.StatusConflict || resp.Header.Get("X-Stopgate-Refusal") != "run_not_active" {
		t.Errorf("a connection after the browser stopped: %v %v, want 409 run_not_active", resp, err)
	}
	if n := up.hits.Load(); n != 1 {
		t.Errorf("the site saw %d requests, want 1", n)
	}
}

// TestConnectionsAreIsolated: each connection has its own session on the
// browser's pipe; one cannot drive the sessions of another, and what a
// connection created goes with it, as with Chromium's own websockets.
func TestConnectionsAreIsolated(t *testing.T) {
	store := testkit.FileStore(t)
	e := newEnv(t, store)
	ws := e.launch(t, "iso")
	a, b := dialCDP(t, ws), dialCDP(t, ws)

	res := a.call("", "Target.createBrowserContext", nil)
	var bc struct {
		BrowserContextID string `json:"browserContextId"`
	}
	if res.Error != nil || json.Unmarshal(res.Result, &bc) != nil || bc.BrowserContextID == "" {
		t.Fatalf("createBrowserContext: %+v %s", res.Error, res.Result)
	}
	res = a.call("", "Target.createTarget", map[string]any{"url": "about:blank", "browserContextId": bc.BrowserContextID})
	var tgt struct {
		TargetID string `json:"targetId"`
	}
	if res.Error != nil || json.Unmarshal(res.Result, &tgt) != nil {
		t.Fatalf("createTarget: %+v %s", res.Error, res.Result)
	}
	res = a.call("", "Target.attachToTarget", map[string]any{"targetId": tgt.TargetID, "flatten": true})
	var att struct {
		SessionID string `json:"sessionId"`
	}
	if res.Error != nil || json.Unmarshal(res.Result, &att) != nil || att.SessionID == "" {
		t.Fatalf("attachToTarget: %+v %s", res.Error, res.Result)
	}
	if res := a.call(att.SessionID, "Page.getFrameTree", nil); res.Error != nil {
		t.Fatalf("a read in its own session: %+v %s", res.Error, res.Result)
	}

	before := len(intentsOf(t, store, "iso", state.BoundaryBrowser, "Runtime.evaluate"))
	res = b.call(att.SessionID, "Runtime.evaluate", map[string]any{"expression": "1+1"})
	if res.Error == nil || res.Error.Code != -32001 || res.Error.Message != "Session with given id not found." {
		t.Errorf("another connection's session: %+v %s, want -32001 Session with given id not found.", res.Error, res.Result)
	}
	if after := len(intentsOf(t, store, "iso", state.BoundaryBrowser, "Runtime.evaluate")); after != before {
		t.Errorf("a command in a foreign session was recorded as an action")
	}

	contexts := func() []string {
		res := b.call("", "Target.getBrowserContexts", nil)
		var r struct {
			IDs []string `json:"browserContextIds"`
		}
		if res.Error != nil || json.Unmarshal(res.Result, &r) != nil {
			t.Fatalf("getBrowserContexts: %+v %s", res.Error, res.Result)
		}
		return r.IDs
	}
	if ids := contexts(); len(ids) != 1 || ids[0] != bc.BrowserContextID {
		t.Fatalf("browser contexts %v, want the one created (%s)", ids, bc.BrowserContextID)
	}
	_ = a.conn.Close(websocket.StatusNormalClosure, "")
	testkit.Eventually(t, 5*time.Second, "the context of the connection that left is disposed of", func() bool { return len(contexts()) == 0 })
}

// TestBrowserListensOnNoPort: the launched browser has no DevTools port
// (nor any other listening socket): the pipe the launcher holds is the only
// way to drive it, so nothing on the machine can reach it around the guard.
func TestBrowserListensOnNoPort(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("reads /proc")
	}
	store := testkit.FileStore(t)
	e := newEnv(t, store)
	e.launch(t, "noport")

	pids := browserPIDs(t, e.profiles)
	if len(pids) == 0 {
		t.Fatal("no process of the launched browser found")
	}
	for _, pid := range pids {
		// Its own network namespace's sockets, as it sees them.
		listening := listeningInodes(t, pid)
		cmdline, _ := os.ReadFile(filepath.Join("/proc", pid, "cmdline"))
		args := strings.Split(string(cmdline), "\x00")
		for _, a := range args {
			if strings.HasPrefix(a, "--remote-debugging-port") || strings.HasPrefix(a, "--remote-debugging-address") {
				t.Errorf("browser process %s has %s", pid, a)
			}
		}
		fds, _ := os.ReadDir(filepath.Join("/proc", pid, "fd"))
		for _, fd := range fds {
			link, err := os.Readlink(filepath.Join("/proc", pid, "fd", fd.Name()))
			if err != nil || !strings.HasPrefix(link, "socket:[") {
				continue
			}
			if port, ok := listening[strings.TrimSuffix(strings.TrimPrefix(link, "socket:["), "]")]; ok {
				t.Errorf("browser process %s listens on TCP port %d", pid, port)
			}
		}
	}
}

// browserPIDs are the processes started with a profile under dir.
func browserPIDs(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var pids []string
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && strings.Contains(string(cmdline), "--user-data-dir="+dir) {
			pids = append(pids, e.Name())
		}
	}
	return pids
}

// listeningInodes maps the inodes of the listening TCP sockets in pid's
// network namespace to their ports.
func listeningInodes(t *testing.T, pid string) map[string]int {
	t.Helper()
	out := map[string]int{}
	for _, file := range []string{filepath.Join("/proc", pid, "net/tcp"), filepath.Join("/proc", pid, "net/tcp6")} {
		f, err := os.Open(file)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(f)
		sc.Scan() // header
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			// local_address rem_address st ... inode is the tenth field.
			if len(fields) < 10 || fields[3] != "0A" {
				continue
			}
			_, portHex, _ := strings.Cut(fields[1], ":")
			port, _ := strconv.ParseInt(portHex, 16, 32)
			out[fields[9]] = int(port)
		}
		f.Close()
	}
	return out
}

// TestBrowserMetricsMove: a browser and its CDP connection are counted
// open while they are, and each action's decision moves the decision and
// refusal counters (docs/metrics.md).
func TestBrowserMetricsMove(t *testing.T) {
	store := testkit.FileStore(t)
	e := newEnv(t, store)
	gauge := func(kind string) float64 {
		return metric(t, e.metrics, "stopgate_open", map[string]string{"kind": kind})
	}
	ws := e.launch(t, "metered")
	c := dialCDP(t, ws)
	// The guard counts a CDP connection once it has reached the browser,
	// after the client's handshake has returned.
	testkit.Eventually(t, 10*time.Second, "the CDP connection counted open", func() bool { return gauge("cdp") == 1 })
	if gauge("browsers") != 1 || gauge("cdp") != 1 {
		t.Fatalf("open browsers %v, cdp %v; want 1 and 1", gauge("browsers"), gauge("cdp"))
	}
	if a := c.call("", "Target.createTarget", map[string]any{"url": "about:blank"}); a.Error != nil {
		t.Fatalf("an action while ACTIVE: %+v", a.Error)
	}
	release := holdCancelling(t, store, "metered")
	defer release()
	if _, err := store.Cancel(context.Background(), state.CancelRequest{RunID: "metered", Actor: "test", DrainTimeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
	if a := c.call("", "Target.createTarget", map[string]any{"url": "about:blank"}); a.Error == nil {
		t.Fatal("an action after the cancel was not refused")
	}
	for _, want := range []struct {
		name   string
		labels map[string]string
	}{
		{"stopgate_decisions_total", map[string]string{"boundary": "browser", "result": "admitted"}},
		{"stopgate_decisions_total", map[string]string{"boundary": "browser", "result": "finished"}},
		{"stopgate_decisions_total", map[string]string{"boundary": "browser", "result": "refused"}},
		{"stopgate_refusals_total", map[string]string{"boundary": "browser", "reason": "run_not_active"}},
	} {
		if v := metric(t, e.metrics, want.name, want.labels); v < 1 {
			t.Errorf("%s%v = %v, want it moved", want.name, want.labels, v)
		}
	}
	_ = c.conn.CloseNow()
	testkit.Eventually(t, 5*time.Second, "the CDP connection counted closed", func() bool { return gauge("cdp") == 0 })
}

// metric is the value of the series of name with exactly labels (0 if none).
func metric(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			if len(m.GetLabel()) != len(labels) {
				continue
			}
			for _, l := range m.GetLabel() {
				if labels[l.GetName()] != l.GetValue() {
					continue series
				}
			}
			return m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return 0
}
