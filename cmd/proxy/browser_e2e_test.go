package main

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/state"
)

// TestBrowserEndToEnd: an agent asks for its run's browser with the CLI,
// drives it with chromedp through the guard, the operator cancels the run,
// and the next navigation is refused; the audit shows both.
func TestBrowserEndToEnd(t *testing.T) {
	chromium := testkit.Chromium(t)
	var hits atomic.Int64
	site := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/favicon.ico" {
			http.NotFound(w, r)
			return
		}
		hits.Add(1)
		w.Header().Set("Content-Type", "text/html")
		io.WriteString(w, `<!doctype html><title>shop</title><link rel="icon" href="data:,"><p>checkout</p>`)
	}))
	defer site.Close()

	// The sweeper is slowed and a claim held (below) so that the run stays
	// CANCELLING (connection open, actions refused) for the walk; the
	// browser package's tests cover what happens once it is CANCELLED.
	s := startServe(t, "--data-dir", t.TempDir(), "--chromium", chromium, "--sweep-interval", "1m")
	out := s.must(t, 0, "browser", "--run", "b1")
	ws, _, _ := strings.Cut(out, "\n")
	if !strings.HasPrefix(ws, "ws://127.0.0.1:") || !strings.Contains(ws, "/run/b1/1/devtools/browser/") {
		t.Fatalf("first line of stopgate browser is %q, want the guarded ws:// URL", ws)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cdp, cancelCDP := testkit.Attach(ctx, ws)
	defer cancelCDP()
	if err := chromedp.Do(cdp, chromedp.Navigate(site.URL+"/checkout")); err != nil {
		t.Fatalf("navigate while ACTIVE: %v\nserve log:\n%s", err, s.Log())
	}
	if title, err := chromedp.Run(cdp, chromedp.Title()); err != nil || title != "shop" {
		t.Fatalf("title %q, %v", title, err)
	}
	if hits.Load() != 1 {
		t.Fatalf("the site saw %d requests, want 1", hits.Load())
	}

	// A worker's claim still in flight keeps the run draining, so that an
	// outcome the browser's own background requests record meanwhile
	// cannot finish the drain (and close the connection) before we look.
	s.must(t, 0, "claim", "b1", "hold", "--worker", "test")
	s.must(t, 0, "cancel", "b1", "--reason", "operator stop")
	err := chromedp.Do(cdp, chromedp.Navigate(site.URL+"/pay"))
	const want = "stopgate refused Page.navigate: run_not_active: run b1 is CANCELLING at cancel_version 2 (the request observed 1): nothing was sent; recorded CANCELLED_BEFORE_DISPATCH"
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("navigate after the cancel: %v, want a CDP error saying %q", err, want)
	}
	time.Sleep(200 * time.Millisecond)
	if hits.Load() != 1 {
		t.Fatalf("the site saw %d requests after the cancel, want still 1", hits.Load())
	}
	if msg := s.must(t, 1, "browser", "--run", "b1"); !strings.Contains(msg, "run_not_active") {
		t.Errorf("stopgate browser for the cancelled run: %q", msg)
	}

	doc := s.audit(t, "b1")
	has := func(boundary state.Boundary, method, target string, st state.IntentState) bool {
		for _, in := range doc.Intents {
			if in.Boundary == boundary && in.Method == method && in.Target == target && in.State == st {
				return true
			}
		}
		return false
	}
	for _, w := range []struct {
		boundary       state.Boundary
		method, target string
		st             state.IntentState
	}{
		{state.BoundaryBrowser, "launch", "chromium:" + chromium, state.IntentResponded},
		{state.BoundaryBrowser, "Page.navigate", site.URL + "/checkout", state.IntentResponded},
		{state.BoundaryHTTP, "GET", site.URL + "/checkout", state.IntentResponded},
		{state.BoundaryBrowser, "Page.navigate", site.URL + "/pay", state.IntentCancelledBeforeDispatch},
		// Asked again while its browser runs: an attach, refused.
		{state.BoundaryBrowser, "attach", "chromium:" + chromium, state.IntentCancelledBeforeDispatch},
	} {
		if !has(w.boundary, w.method, w.target, w.st) {
			t.Errorf("audit lacks %s %s %s %s:\n%s", w.boundary, w.method, w.target, w.st, s.must(t, 0, "audit", "b1"))
		}
	}

	cancelCDP()
	if err := s.Stop(); err != nil {
		t.Fatalf("stop: %v\n%s", err, s.Log())
	}
	if !strings.Contains(s.Log(), "browser stopped") {
		t.Errorf("serve did not stop the browser on shutdown:\n%s", s.Log())
	}
}
