package browserguard_test

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/stopgate/stopgate/browserguard"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/state"
)

func signer(t *testing.T) *runtoken.Signer {
	t.Helper()
	s, err := runtoken.New([]byte(strings.Repeat("k", 32)))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestRunTokensInTheURL (issue 23, finding 5): with tokens required, the
// browser's URLs carry a run token, and the guard takes no request without
// one that verifies and names the run: not the /json endpoints, not the
// websocket upgrade. A worker asking with its own token gets a URL with
// that token; one that expires while connected has its actions refused.
func TestRunTokensInTheURL(t *testing.T) {
	store := testkit.FileStore(t)
	tokens := signer(t)
	e := newEnv(t, store, func(c *browserguard.LauncherConfig) { c.Tokens, c.RequireToken = tokens, true })
	up := newUpstream(t)
	ws := e.launch(t, "tok")
	u := strings.TrimPrefix(ws, "ws://"+e.guardHost+"/run/tok/")
	cred, rest, _ := strings.Cut(u, "/")
	claims, err := tokens.Verify(cred, time.Now())
	if err != nil || claims.RunID != "tok" || claims.Version != 1 || !strings.HasPrefix(rest, "devtools/browser/") {
		t.Fatalf("the launch's URL %s: credential %q (%+v, %v), want a token for run tok at version 1", ws, cred, claims, err)
	}

	other := tokens.Sign("other", 1, time.Now().Add(time.Hour))
	expired := tokens.Sign("tok", 1, time.Now().Add(-time.Second))
	forged, _ := runtoken.New([]byte(strings.Repeat("x", 32)))
	for _, c := range []struct{ cred, say string }{
		{"1", "requires a run token"},
		{"0", "requires a run token"},
		{other, "is for run other, not tok"},
		{expired, "expired"},
		{forged.Sign("tok", 1, time.Now().Add(time.Hour)), "signature does not match"},
	} {
		for _, path := range []string{"/json/version", "/json/list"} {
			resp, err := http.Get("http://" + e.guardHost + "/run/tok/" + c.cred + path)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusUnauthorized || resp.Header.Get("X-Stopgate-Refusal") != "unauthorized" || !strings.Contains(string(body), c.say) {
				t.Errorf("GET %s with %.12s…: %d %s, want 401 unauthorized saying %q", path, c.cred, resp.StatusCode, body, c.say)
			}
		}
		_, resp, err := websocket.Dial(testCtx(t), "ws://"+e.guardHost+"/run/tok/"+c.cred+"/"+rest, nil)
		if err == nil || resp == nil || resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("websocket with %.12s…: %v, want 401", c.cred, err)
		}
	}

	// With the token: what the guard hands out keeps it.
	if got, err := testkit.DebuggerURL("http://" + e.guardHost + "/run/tok/" + cred + "/json/version"); err != nil || got != ws {
		t.Fatalf("/json/version with the token: %q %v, want %s", got, err, ws)
	}
	c := dialCDP(t, ws)
	if a := c.call("", "Target.createTarget", map[string]any{"url": up.URL + "/"}); a.Error != nil {
		t.Fatalf("an action with the token: %+v", a.Error)
	}

	// A worker's own token is the one its URL carries.
	mine := tokens.Sign("tok", 1, time.Now().Add(2*time.Second))
	got, err := e.launcher.Launch(testCtx(t), browserguard.LaunchRequest{Run: "tok", Actor: "worker:tok", Token: mine})
	if err != nil || !strings.Contains(got.WSURL, "/run/tok/"+mine+"/devtools/browser/") {
		t.Fatalf("a worker's launch: %+v %v, want its own token in the URL", got, err)
	}
	for _, bad := range []browserguard.LaunchRequest{
		{Run: "tok", Token: other},
		{Run: "tok", Token: mine, Observed: 2},
	} {
		if _, err := e.launcher.Launch(testCtx(t), bad); !errors.Is(err, state.ErrInvalid) {
			t.Errorf("launch %+v: %v, want invalid", bad, err)
		}
	}
	short := dialCDP(t, got.WSURL)
	mc, err := tokens.Verify(mine, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Until(mc.Expires) + 100*time.Millisecond)
	a := short.call("", "Target.createTarget", map[string]any{"url": up.URL + "/late"})
	if a.Error == nil || !strings.Contains(a.Error.Message, "unauthorized: the run token this connection was opened with expired") {
		t.Errorf("an action after the connection's token expired: %+v %s", a.Error, a.Result)
	}
	// Reads too: the credential is over, as at the egress proxy.
	if a := short.call("", "Target.getTargets", nil); a.Error == nil || !strings.Contains(a.Error.Message, "expired") {
		t.Errorf("a read after the token expired: %+v %s, want the refusal", a.Error, a.Result)
	}
}

// TestUploadsOnlyFromTheRunsDirectory: a page is given files only from the
// run's upload directory, which its sandbox holds read-only; any other
// file, or a link out of the directory, is refused and recorded.
func TestUploadsOnlyFromTheRunsDirectory(t *testing.T) {
	store := testkit.FileStore(t)
	uploads := t.TempDir()
	// The browser may not be root: its files must be readable to it.
	runDir := filepath.Join(uploads, "up")
	if err := os.MkdirAll(runDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(uploads, 0o755); err != nil {
		t.Fatal(err)
	}
	invoice := filepath.Join(runDir, "invoice.txt")
	if err := os.WriteFile(invoice, []byte("invoice 42"), 0o644); err != nil {
		t.Fatal(err)
	}
	secret := filepath.Join(t.TempDir(), "operator.token")
	if err := os.WriteFile(secret, []byte("sgop_secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(secret, filepath.Join(runDir, "link.txt")); err != nil {
		t.Fatal(err)
	}
	e := newEnv(t, store, func(c *browserguard.LauncherConfig) { c.Sandbox.Uploads = uploads })
	c := dialCDP(t, e.launch(t, "up"))
	page := c.attachPage()
	c.call(page, "Page.navigate", map[string]any{"url": "data:text/html,<input type=file id=f><pre id=out></pre><script>" +
		"document.getElementById('f').addEventListener('change', e => e.target.files[0].text().then(x => document.getElementById('out').textContent = x))</script>"})
	var root int
	testkit.Eventually(t, 10*time.Second, "the page is loaded", func() bool {
		a := c.call(page, "DOM.getDocument", nil)
		var d struct {
			Root struct {
				NodeID      int    `json:"nodeId"`
				DocumentURL string `json:"documentURL"`
			} `json:"root"`
		}
		_ = json.Unmarshal(a.Result, &d)
		root = d.Root.NodeID
		return strings.HasPrefix(d.Root.DocumentURL, "data:")
	})
	q := c.call(page, "DOM.querySelector", map[string]any{"nodeId": root, "selector": "#f"})
	var in struct {
		NodeID int `json:"nodeId"`
	}
	if err := json.Unmarshal(q.Result, &in); err != nil || in.NodeID == 0 {
		t.Fatalf("the file input: %+v %s", q.Error, q.Result)
	}
	for _, f := range []string{secret, filepath.Join(runDir, "link.txt"), filepath.Join(runDir, "..", "up", "..", filepath.Base(uploads))} {
		msg := refusalOf(c.call(page, "DOM.setFileInputFiles", map[string]any{"nodeId": in.NodeID, "files": []string{f}}))
		if !strings.HasPrefix(msg, "stopgate refused DOM.setFileInputFiles: command_not_allowed: ") || !strings.Contains(msg, "recorded CANCELLED_BEFORE_DISPATCH") {
			t.Errorf("upload of %s: %q, want command_not_allowed, recorded", f, msg)
		}
	}
	if a := c.call(page, "DOM.setFileInputFiles", map[string]any{"nodeId": in.NodeID, "files": []string{invoice}}); a.Error != nil {
		t.Fatalf("upload from the run's directory: %+v", a.Error)
	}
	testkit.Eventually(t, 10*time.Second, "the page read the uploaded file", func() bool {
		a := c.call(page, "Runtime.evaluate", map[string]any{"expression": "document.getElementById('out').textContent", "returnByValue": true})
		return strings.Contains(string(a.Result), "invoice 42")
	})
	var refused int
	for _, in := range intentsOf(t, store, "up", state.BoundaryBrowser, "DOM.setFileInputFiles") {
		if in.State == state.IntentCancelledBeforeDispatch {
			refused++
		}
	}
	if refused != 3 {
		t.Errorf("%d refused uploads recorded, want 3:%s", refused, describe(intentsOf(t, store, "up", state.BoundaryBrowser, "")))
	}
}
