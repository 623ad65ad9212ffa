package control_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
)

// steppedClock is a store's clock that the test moves on, so that a run's
// seven seconds are recorded in no time.
type steppedClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *steppedClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *steppedClock) at(d time.Duration, start time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = start.Add(d)
}

// TestConsoleDrawsARunInChromium: a run's page draws each of its effects
// as a bar from its admission to its outcome, coloured by its state, with
// the cancel, the drain deadline and every cut marked, and the list of
// runs is searched by id prefix, status and time, in a real headless
// Chromium. The picture goes to $STOPGATE_ARTIFACTS/console/timeline.png.
func TestConsoleDrawsARunInChromium(t *testing.T) {
	chromium := testkit.Chromium(t)
	clock := &steppedClock{}
	store, err := filestore.Open(filepath.Join(t.TempDir(), "stopgate.db"), filestore.Options{Logger: testkit.Logger(), Now: clock.now})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = store.Close() })
	srv, _ := consoleAPI(t, store)
	start := time.Now().Add(-2 * time.Minute).Truncate(time.Second)
	seedTimeline(t, store, clock, start)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	browser := headless(t, ctx, chromium, 1320, 900)
	do := func(what string, actions ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		step, cancelStep := context.WithTimeout(browser, 15*time.Second)
		defer cancelStep()
		if err := chromedp.Do(step, actions...); err != nil {
			t.Fatalf("%s: %v (at %s)", what, err, currentURL(t, browser))
		}
	}
	count := func(sel string) int {
		t.Helper()
		n, err := chromedp.Run(browser, chromedp.Evaluate[int]("document.querySelectorAll("+jsString(sel)+").length"))
		if err != nil {
			t.Fatalf("count %s: %v", sel, err)
		}
		return n
	}
	attrs := func(sel, attr string) []string {
		t.Helper()
		v, err := chromedp.Run(browser, chromedp.Evaluate[[]string]("Array.from(document.querySelectorAll("+jsString(sel)+")).map(e => e.getAttribute("+jsString(attr)+"))"))
		if err != nil {
			t.Fatalf("read %s %s: %v", sel, attr, err)
		}
		return v
	}

	do("log in", chromedp.Navigate(srv.URL+"/login"), chromedp.WaitVisible(chromedp.ID("token")),
		chromedp.SendKeys(chromedp.ID("token"), testToken), chromedp.SendKeys(chromedp.ID("name"), "alice"),
		chromedp.Click(chromedp.ID("login")), chromedp.WaitVisible(chromedp.ID("runs")))

	// at waits, bounded, until the browser has loaded a page whose URL has
	// want. It asks the page itself: the target's URL moves when a navigation
	// commits, before the new document is loaded, and a question put to the
	// page in between fails as "navigated or closed".
	at := func(want string) {
		t.Helper()
		loaded := "location.href.includes(" + jsString(want) + ") && document.readyState === 'complete' && !!document.getElementById('runs')"
		for deadline := time.Now().Add(10 * time.Second); ; {
			ok, err := chromedp.Run(browser, chromedp.Evaluate[bool](loaded))
			if err == nil && ok {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("the browser is at %s, not loaded at a URL with %q (%v)", currentURL(t, browser), want, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	// Search: by id prefix, then by status, then by time.
	do("search agent-", chromedp.SendKeys(chromedp.ID("prefix"), "agent-"), chromedp.Click(chromedp.ID("search-go")))
	at("prefix=agent-")
	if got := attrs("#runs tbody a", "href"); !slices.Equal(got, []string{"/runs/agent-run-43", "/runs/agent-run-42"}) {
		t.Errorf("runs starting with agent-, latest first: %v", got)
	}
	do("and UNKNOWN", chromedp.Click(chromedp.ID("count-unknown")))
	at("status=UNKNOWN")
	if got := attrs("#runs tbody a", "href"); !slices.Equal(got, []string{"/runs/agent-run-42"}) {
		t.Errorf("UNKNOWN runs starting with agent-: %v (at %s)", got, currentURL(t, browser))
	}
	do("updated in the last minute", chromedp.Navigate(srv.URL+"/?since=1m"), chromedp.WaitVisible(chromedp.ID("runs")))
	if got := attrs("#runs tbody a", "href"); !slices.Equal(got, []string{"/runs/agent-run-43"}) {
		t.Errorf("runs updated in the last minute: %v", got)
	}

	do("open the run", chromedp.Navigate(srv.URL+"/runs/agent-run-42"), chromedp.WaitVisible(chromedp.ID("chart")))
	states := attrs("#chart g.row", "data-state")
	want := []string{"RESPONDED", "RESPONDED", "RESPONDED", "UNKNOWN", "NOT_APPLIED", "RESPONDED", "CANCELLED_BEFORE_DISPATCH"}
	if !slices.Equal(states, want) {
		t.Errorf("the effects drawn: %v, want %v", states, want)
	}
	for sel, n := range map[string]int{
		"#chart rect.bar": 6, "#chart circle.refused": 1, "#chart text.cut": 3,
		"#chart .m-cancel line": 1, "#chart .m-deadline line": 1, "#chart rect.b-unknown": 1,
	} {
		if got := count(sel); got != n {
			t.Errorf("%s: %d drawn, want %d", sel, got, n)
		}
	}
	// The cancel comes before the drain deadline, four seconds later, and
	// the effect cut at the deadline ends on it.
	cancelX, deadlineX := attrs("#chart .m-cancel line", "x1"), attrs("#chart .m-deadline line", "x1")
	if len(cancelX) != 1 || len(deadlineX) != 1 || !(atof(t, cancelX[0]) < atof(t, deadlineX[0])) {
		t.Errorf("cancel at %v, drain deadline at %v", cancelX, deadlineX)
	}
	bars := attrs(`#chart g.row[data-state="UNKNOWN"] rect.bar`, "x")
	widths := attrs(`#chart g.row[data-state="UNKNOWN"] rect.bar`, "width")
	if len(bars) == 1 && len(deadlineX) == 1 {
		if end := atof(t, bars[0]) + atof(t, widths[0]); end < atof(t, deadlineX[0])-2 || end > atof(t, deadlineX[0])+2 {
			t.Errorf("the effect cut at the drain deadline ends at x=%.1f, the deadline is at %s", end, deadlineX[0])
		}
	}

	png, err := chromedp.Run(browser, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	shot := filepath.Join(artifactsDir(t), "timeline.png")
	if err := os.WriteFile(shot, png, 0o644); err != nil {
		t.Fatal(err)
	}
	chartPNG, err := chromedp.Run(browser, chromedp.Screenshot(chromedp.ID("chart")))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(artifactsDir(t), "timeline-chart.png"), chartPNG, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("the run drawn: %s (the chart alone: timeline-chart.png beside it)", shot)
}

func jsString(s string) string {
	return "'" + strings.ReplaceAll(strings.ReplaceAll(s, `\`, `\\`), "'", `\'`) + "'"
}

func atof(t *testing.T, s string) float64 {
	t.Helper()
	var f float64
	for i, part := range strings.SplitN(s, ".", 2) {
		for _, c := range part {
			if c < '0' || c > '9' {
				t.Fatalf("%q is not a number", s)
			}
		}
		if i == 0 {
			for _, c := range part {
				f = f*10 + float64(c-'0')
			}
		} else {
			scale := 0.1
			for _, c := range part {
				f += float64(c-'0') * scale
				scale /= 10
			}
		}
	}
	return f
}

// seedTimeline records a run the way the proxy would over seven seconds:
// calls answered, a stream to an inference API and a read cut at the
// cancel, a charge that drains until its deadline and is cut there
// (UNKNOWN), a request refused after the cancel, and an email answered
// during the drain; then another run, touched later.
func seedTimeline(t *testing.T, store state.Store, clock *steppedClock, start time.Time) {
	t.Helper()
	ctx := context.Background()
	const run, proxy = "agent-run-42", "stopgate@host/1"
	at := func(ms int) { clock.at(time.Duration(ms)*time.Millisecond, start) }
	guard := func(key, method, target string) state.GuardResult {
		g, err := store.Guard(ctx, state.GuardRequest{RunID: run, Key: key, ExplicitKey: true, Boundary: state.BoundaryHTTP,
			Method: method, Target: target, LeaseOwner: proxy, LeaseTTL: time.Hour, Actor: proxy})
		seeded(t, err)
		return g
	}
	finish := func(key string, outcome state.IntentState, code int, reason, source string) {
		_, err := store.Finish(ctx, state.FinishRequest{RunID: run, Key: key, Attempt: 1, Outcome: outcome, StatusCode: code, Reason: reason, Source: source, Actor: proxy})
		seeded(t, err)
	}
	at(0)
	_, err := store.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "operator (cli:alice)"})
	seeded(t, err)
	at(300)
	guard("plan", "POST", "https://api.openai.com/v1/responses")
	at(600)
	guard("repo", "GET", "https://api.github.com/repos/acme/shop")
	at(900)
	finish("repo", state.IntentResponded, 200, "", "")
	at(1200)
	guard("events", "GET", "https://status.example.com/events")
	at(1500)
	finish("events", state.IntentResponded, 200, "", "")
	at(1900)
	finish("plan", state.IntentResponded, 200, "", "")
	at(2000)
	guard("charge", "POST", "https://api.stripe.com/v1/charges")
	at(2400)
	guard("stream", "POST", "https://api.openai.com/v1/chat/completions")
	// An email on its way when the run is stopped: its answer comes
	// during the drain.
	at(2900)
	guard("email", "POST", "https://api.mailgun.net/v3/messages")
	at(3000)
	_, err = store.Cancel(ctx, state.CancelRequest{RunID: run, Actor: "operator (console:alice)", Reason: "runaway spend", DrainTimeout: 4 * time.Second})
	seeded(t, err)
	at(3020)
	finish("stream", state.IntentNotApplied, 0, "run_cancelled: destination without effects", state.SourcePolicy)
	seeded(t, store.Note(ctx, state.NoteRequest{RunID: run, Key: "events", Kind: state.EventIntentCut, Reason: "run_cancelled: safe request", Actor: proxy}))
	at(3400)
	if g := guard("notify", "POST", "https://hooks.slack.com/services/T0/B0"); g.Admitted {
		t.Fatal("admitted after the cancel")
	}
	at(5200)
	finish("email", state.IntentResponded, 202, "", "")
	at(7000)
	finish("charge", state.IntentUnknown, 0, "drain_timeout", "")
	at(7050)
	if r, err := store.Tick(ctx, state.TickRequest{RunID: run, Actor: "sweeper:stopgate@host/1"}); err != nil || r.Status != state.StatusUnknown {
		t.Fatalf("tick: %+v %v", r, err)
	}
	at(8000)
	_, err = store.Admit(ctx, state.AdmitRequest{RunID: "billing-sync", Actor: "operator (cli:alice)"})
	seeded(t, err)
	clock.at(time.Since(start)-5*time.Second, start)
	_, err = store.Admit(ctx, state.AdmitRequest{RunID: "agent-run-43", Actor: "operator (cli:alice)"})
	seeded(t, err)
	clock.at(time.Since(start), start)
}
