package control_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/state"
)

// TestConsoleInChromium: an operator logs in, finds a run, presses Stop,
// watches the drain until the run is CANCELLED, and reconciles an UNKNOWN
// effect of another run, in a real headless Chromium against the real
// control API, store and sweeper. Screenshots of each step go to
// $STOPGATE_ARTIFACTS/console (default: the test's temporary directory).
func TestConsoleInChromium(t *testing.T) {
	chromium := testkit.Chromium(t)
	store := testkit.FileStore(t)
	srv, _ := consoleAPI(t, store)
	seedConsoleRuns(t, store)

	// The sweeper of stopgate serve, ticking fast: it moves the stopped run
	// on once its drain is over.
	sweepCtx, stopSweeping := context.WithCancel(context.Background())
	sweeper := &intents.Sweeper{Store: store, Interval: 100 * time.Millisecond, Actor: "sweeper:stopgate@host/1", StoreTimeout: 2 * time.Second, Logger: testkit.Logger()}
	done := make(chan struct{})
	go func() { sweeper.Run(sweepCtx); close(done) }()
	t.Cleanup(func() { stopSweeping(); <-done })

	shots := artifactsDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	browser := headless(t, ctx, chromium, 1280, 860)
	// shot saves a screenshot. A page that reloads itself (a draining run)
	// may be caught between two loads, so it tries again, for at most 20s.
	shot := func(name string) {
		t.Helper()
		var png []byte
		var err error
		for deadline := time.Now().Add(20 * time.Second); ; {
			step, cancelStep := context.WithTimeout(browser, 5*time.Second)
			png, err = chromedp.Run(step, chromedp.FullScreenshot(100))
			cancelStep()
			if err == nil || time.Now().After(deadline) {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if err != nil {
			t.Fatalf("screenshot %s: %v", name, err)
		}
		if err := os.WriteFile(filepath.Join(shots, name), png, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	run := func(what string, actions ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		step, cancelStep := context.WithTimeout(browser, 15*time.Second)
		defer cancelStep()
		if err := chromedp.Do(step, actions...); err != nil {
			// What the browser showed when the step failed, to see why.
			if png, serr := chromedp.Run(browser, chromedp.FullScreenshot(100)); serr == nil {
				_ = os.WriteFile(filepath.Join(shots, "failed.png"), png, 0o644)
			}
			t.Fatalf("%s: %v (at %s; failed.png in %s)", what, err, currentURL(t, browser), shots)
		}
	}
	text := func(sel string) string {
		t.Helper()
		s, err := chromedp.Run(browser, chromedp.Text(chromedp.CSS(sel)))
		if err != nil {
			t.Fatalf("read %s: %v", sel, err)
		}
		return strings.TrimSpace(s)
	}
	// untilStatus waits, bounded, for the page (which refreshes itself
	// while the run drains) to show status.
	untilStatus := func(status state.Status) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			s, err := chromedp.Run(browser, chromedp.Text(chromedp.CSS("#status")))
			if err == nil && strings.TrimSpace(s) == string(status) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("the page shows %q (%v), not %s, after 30s", s, err, status)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}

	// Log in: the console sends the visitor to the login form first.
	run("open the console", chromedp.Navigate(srv.URL+"/"), chromedp.WaitVisible(chromedp.ID("token")))
	if !strings.Contains(currentURL(t, browser), "/login?next=%2F") {
		t.Fatalf("the console without a session is at %s, want the login form", currentURL(t, browser))
	}
	shot("01-login.png")
	run("log in", chromedp.SendKeys(chromedp.ID("token"), testToken), chromedp.SendKeys(chromedp.ID("name"), "alice"),
		chromedp.Click(chromedp.ID("login")), chromedp.WaitVisible(chromedp.ID("runs")))
	if who := text("#who"); who != "operator (console:alice)" {
		t.Fatalf("acting as %q, want operator (console:alice)", who)
	}
	if n := text("#count-active"); !strings.HasSuffix(n, "3") {
		t.Errorf("ACTIVE count %q, want 3", n)
	}
	shot("02-runs.png")

	// Open a run and press Stop.
	run("open checkout-7f3a", chromedp.Click(chromedp.CSS(`a[href="/runs/checkout-7f3a"]`)), chromedp.WaitVisible(chromedp.ID("stop-form")))
	shot("03-run-active.png")
	run("press Stop", chromedp.SendKeys(chromedp.ID("reason"), "customer asked to stop"), chromedp.SendKeys(chromedp.ID("drain"), "20s"),
		chromedp.Click(chromedp.ID("stop")), chromedp.WaitVisible(chromedp.ID("draining")))
	if got := text("#status"); got != string(state.StatusCancelling) {
		t.Fatalf("after Stop the page shows %q, want CANCELLING", got)
	}
	shot("04-run-draining.png")
	row, err := store.Get(context.Background(), "checkout-7f3a")
	if err != nil || row.Status != state.StatusCancelling || row.Reason != "customer asked to stop" || row.DrainDeadline.Sub(row.CancelledAt) != 20*time.Second {
		t.Fatalf("the row after Stop: %+v %v", row, err)
	}
	// The provider answers the one request in flight: the drain is over,
	// and the page, refreshing itself, shows the run CANCELLED.
	if _, err := store.Finish(context.Background(), state.FinishRequest{RunID: "checkout-7f3a", Key: "POST-api.stripe.com-charges-91e2", Attempt: 1,
		Outcome: state.IntentResponded, StatusCode: 200, Actor: "stopgate@host/1"}); err != nil {
		t.Fatal(err)
	}
	untilStatus(state.StatusCancelled)
	if r := text("#status-reason"); r != "drained" {
		t.Errorf("status reason %q, want drained", r)
	}
	shot("05-run-cancelled.png")

	// Reconcile the UNKNOWN effect of another run.
	run("open refund-19c2", chromedp.Navigate(srv.URL+"/runs/refund-19c2"), chromedp.WaitVisible(chromedp.ID("reconcile")))
	shot("06-run-unknown.png")
	run("record Not applied", chromedp.Click(chromedp.CSS(`#reconcile input[value="not_applied"]`)),
		chromedp.SendKeys(chromedp.CSS(`#reconcile input[name="note"]`), "no refund re_3Q9 in the provider dashboard"),
		chromedp.Click(chromedp.CSS("#reconcile button")), chromedp.WaitVisible(chromedp.ID("notice")))
	untilStatus(state.StatusCancelled)
	shot("07-run-reconciled.png")
	run("back to the runs", chromedp.Navigate(srv.URL+"/?status=CANCELLED"), chromedp.WaitVisible(chromedp.ID("runs")))
	shot("08-runs-cancelled.png")

	// The record names the operator as the session proved it.
	for id, kind := range map[string]string{"checkout-7f3a": state.EventRunCancelled, "refund-19c2": state.EventIntentResolved} {
		events, err := store.Events(context.Background(), id)
		if err != nil {
			t.Fatal(err)
		}
		i := slices.IndexFunc(events, func(e state.Event) bool { return e.Kind == kind })
		if i < 0 || events[i].Actor != "operator (console:alice)" {
			t.Errorf("%s of %s recorded as %+v, want by operator (console:alice)", kind, id, events)
		}
	}
	in, err := store.Intent(context.Background(), "refund-19c2", "POST-pay.example.com-refunds-5b7c")
	if err != nil || in.State != state.IntentNotApplied || in.Note != "no refund re_3Q9 in the provider dashboard" || in.Source != "operator" {
		t.Fatalf("the reconciled effect: %+v %v", in, err)
	}
	t.Logf("screenshots in %s", shots)
}

// headless starts chromium at the given window size and is a chromedp
// context on its first tab. The browser is started on this context, so
// that it outlives each step's; it ends with the test.
func headless(t *testing.T, ctx context.Context, chromium string, width, height int) context.Context {
	t.Helper()
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(ctx, append(slices.Clone(chromedp.DefaultExecAllocatorOptions[:]),
		chromedp.ExecPath(chromium), chromedp.NoSandbox, chromedp.WindowSize(width, height), chromedp.UserDataDir(t.TempDir()))...)
	browser, cancelBrowser := chromedp.NewContext(allocCtx)
	t.Cleanup(func() { cancelBrowser(); cancelAlloc() })
	if err := chromedp.Do(browser); err != nil {
		t.Fatalf("start chromium: %v", err)
	}
	return browser
}

func currentURL(t *testing.T, ctx context.Context) string {
	t.Helper()
	u, err := chromedp.Run(ctx, chromedp.Location())
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// artifactsDir is where the test's screenshots go: $STOPGATE_ARTIFACTS/console,
// else a temporary directory of the test.
func artifactsDir(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("STOPGATE_ARTIFACTS")
	if dir == "" {
		return t.TempDir()
	}
	dir = filepath.Join(dir, "console")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// seeded ends the test when a step of its seeding failed.
func seeded(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// seedConsoleRuns writes the runs an operator finds on a busy morning, the
// way the edges write them: admitted, effects guarded and reported, one
// finished, one stopped long ago, one UNKNOWN after its carrier died.
func seedConsoleRuns(t *testing.T, store state.Store) {
	t.Helper()
	ctx := context.Background()
	admitAs := func(id, actor string) {
		_, err := store.Admit(ctx, state.AdmitRequest{RunID: id, Actor: actor})
		seeded(t, err)
	}
	effect := func(id, key, method, target, carrier string, b state.Boundary) {
		g, err := store.Guard(ctx, state.GuardRequest{RunID: id, Key: key, ExplicitKey: true, Boundary: b, Method: method, Target: target,
			LeaseOwner: carrier, LeaseTTL: 10 * time.Minute, Actor: carrier})
		seeded(t, err)
		if !g.Admitted {
			t.Fatalf("guard %s: %+v", key, g)
		}
	}
	answered := func(id, key, carrier string, code int) {
		_, err := store.Finish(ctx, state.FinishRequest{RunID: id, Key: key, Attempt: 1, Outcome: state.IntentResponded, StatusCode: code, Actor: carrier})
		seeded(t, err)
	}
	const proxy = "stopgate@host/1"

	admitAs("nightly-sync-01", "operator (cli:bob)")
	effect("nightly-sync-01", "GET-api.github.com-repos-1c0d", "GET", "https://api.github.com/repos/acme/shop/pulls", proxy, state.BoundaryHTTP)
	answered("nightly-sync-01", "GET-api.github.com-repos-1c0d", proxy, 200)
	_, err := store.Complete(ctx, state.CompleteRequest{RunID: "nightly-sync-01", Version: 1, Actor: "operator (cli:bob)", Reason: "all repositories synced"})
	seeded(t, err)

	_, err = store.Cancel(ctx, state.CancelRequest{RunID: "ghost-run", Actor: "operator (cli:bob)", Reason: "never start this one"})
	seeded(t, err)

	unknownRun(t, store, "refund-19c2", "POST-pay.example.com-refunds-5b7c")

	admitAs("research-agent-3", "operator (cli:alice)")
	effect("research-agent-3", "claim:fetch-sources", "", "", "worker:research-agent-3", state.BoundaryClaim)
	admitAs("email-digest-5", "operator (cli:alice)")

	admitAs("checkout-7f3a", "operator (cli:alice)")
	effect("checkout-7f3a", "POST-api.openai.com-responses-0a1b", "POST", "https://api.openai.com/v1/responses", proxy, state.BoundaryHTTP)
	answered("checkout-7f3a", "POST-api.openai.com-responses-0a1b", proxy, 200)
	effect("checkout-7f3a", "GET-shop.example.com-cart-77aa", "GET", "https://shop.example.com/cart/8812", proxy, state.BoundaryHTTP)
	answered("checkout-7f3a", "GET-shop.example.com-cart-77aa", proxy, 200)
	effect("checkout-7f3a", "POST-api.stripe.com-charges-91e2", "POST", "https://api.stripe.com/v1/charges", proxy, state.BoundaryHTTP)
}

// unknownRun is a run stopped while a refund was in flight, whose carrier
// then died: the effect is UNKNOWN, and so is the run.
func unknownRun(t *testing.T, store state.Store, id, key string) {
	t.Helper()
	ctx := context.Background()
	if _, err := store.Admit(ctx, state.AdmitRequest{RunID: id, Actor: "operator (cli:alice)"}); err != nil {
		t.Fatal(err)
	}
	g, err := store.Guard(ctx, state.GuardRequest{RunID: id, Key: key, ExplicitKey: true, Boundary: state.BoundaryHTTP,
		Method: "POST", Target: "https://pay.example.com/v1/refunds", LeaseOwner: "stopgate@host/2", LeaseTTL: time.Minute, Actor: "stopgate@host/2"})
	if err != nil || !g.Admitted {
		t.Fatalf("guard: %+v %v", g, err)
	}
	if _, err := store.Cancel(ctx, state.CancelRequest{RunID: id, Actor: "operator (cli:alice)", Reason: "runaway refunds", DrainTimeout: 0}); err != nil {
		t.Fatal(err)
	}
	if run, err := store.Tick(ctx, state.TickRequest{RunID: id, Actor: "sweeper:stopgate@host/1"}); err != nil || run.Status != state.StatusUnknown {
		t.Fatalf("tick: %+v %v; want UNKNOWN", run, err)
	}
}

// TestConsoleDrawsARunsBudgetInChromium: a run cancelled by its budget, in
// a real Chromium: each limit's bar is drawn (the one crossed marked), the
// tokens by model listed. It saves budget.png beside the other screenshots.
func TestConsoleDrawsARunsBudgetInChromium(t *testing.T) {
	chromium := testkit.Chromium(t)
	store := testkit.FileStore(t)
	srv, _ := consoleAPI(t, store)
	ctx := context.Background()
	if _, err := store.Admit(ctx, state.AdmitRequest{RunID: "agent-budget", Actor: "operator", Budget: state.Budget{
		MaxEffects: 4, MaxTokens: 2000, MaxSpend: state.NanoUSD / 10, MaxWallTime: time.Hour, DrainTimeout: 10 * time.Second}}); err != nil {
		t.Fatal(err)
	}
	for i, target := range []string{"https://api.openai.com/v1/chat/completions", "https://api.anthropic.com/v1/messages", "https://api.github.com/repos/x", "https://api.openai.com/v1/chat/completions", "https://api.github.com/repos/y"} {
		res, err := store.Guard(ctx, state.GuardRequest{RunID: "agent-budget", Key: fmt.Sprintf("k%d", i), ExplicitKey: true, Boundary: state.BoundaryHTTP,
			Method: "POST", Target: target, LeaseTTL: time.Minute, Actor: "proxy", RequestBytes: 300})
		if err != nil {
			t.Fatal(err)
		}
		if !res.Admitted {
			continue
		}
		llm := map[int]*state.LLMUsage{
			0: {Model: "gpt-4o", Known: true, InputTokens: 420, OutputTokens: 180, Priced: true, Spend: 2_850_000},
			1: {Model: "claude-sonnet-4-5", Known: true, InputTokens: 610, OutputTokens: 240, Priced: true, Spend: 5_430_000},
			3: {Model: "gpt-4o"},
		}[i]
		if _, err := store.Finish(ctx, state.FinishRequest{RunID: "agent-budget", Key: res.Intent.Key, Attempt: 1, Outcome: state.IntentResponded,
			StatusCode: 200, ResponseBytes: 2048, LLM: llm, Actor: "proxy"}); err != nil {
			t.Fatal(err)
		}
	}
	browser := headless(t, ctx, chromium, 1280, 900)
	step, cancelStep := context.WithTimeout(browser, time.Minute)
	defer cancelStep()
	if err := chromedp.Do(step, chromedp.Navigate(srv.URL+"/"), chromedp.WaitVisible(chromedp.ID("token")),
		chromedp.SendKeys(chromedp.ID("token"), testToken), chromedp.Click(chromedp.ID("login")), chromedp.WaitVisible(chromedp.ID("runs")),
		chromedp.Navigate(srv.URL+"/runs/agent-budget"), chromedp.WaitVisible(chromedp.ID("usage"))); err != nil {
		t.Fatalf("open the run: %v", err)
	}
	bars, err := chromedp.Run(step, chromedp.Evaluate[int](`document.querySelectorAll('#usage .limit svg.meter rect.fill').length`))
	if err != nil || bars != 4 {
		t.Fatalf("%d limit bars drawn (%v), want 4: max_effects, max_wall_time, max_tokens, max_spend_usd", bars, err)
	}
	crossed, err := chromedp.Run(step, chromedp.Evaluate[string](`document.querySelector('#usage .limit.crossed').dataset.limit`))
	if err != nil || crossed != "max_effects" {
		t.Fatalf("the limit marked crossed: %q (%v)", crossed, err)
	}
	width, err := chromedp.Run(step, chromedp.Evaluate[float64](`document.querySelector('#usage .limit.crossed svg.meter').getBoundingClientRect().width`))
	if err != nil || width < 100 {
		t.Fatalf("the crossed limit's bar is %v px wide (%v): not drawn", width, err)
	}
	png, err := chromedp.Run(step, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	dir := artifactsDir(t)
	if err := os.WriteFile(filepath.Join(dir, "budget.png"), png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("budget.png in %s", dir)
}
