package control_test

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"html"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/state"
)

// The operator console over HTTP, as a browser speaks to it: the login,
// its cookie, the CSRF token of every form, and what each scope sees.
// console_browser_test.go drives it in a real Chromium.

// consoleAPI serves the API (and so the console) with an operator token, a
// read-only token and a run-token signer.
func consoleAPI(t *testing.T, store state.Store) (*httptest.Server, *runtoken.Signer) {
	t.Helper()
	signer, err := runtoken.New([]byte("0123456789abcdef0123456789abcdef"))
	if err != nil {
		t.Fatal(err)
	}
	h, err := control.New(control.Options{Store: store, Token: testToken, ReadToken: readToken, Tokens: signer,
		DrainTimeout: 30 * time.Second, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv, signer
}

// browserLike is an HTTP client that keeps cookies and does not follow
// redirects, so each answer can be looked at.
type browserLike struct {
	t    *testing.T
	base string
	hc   *http.Client
	jar  map[string]*http.Cookie
}

func newBrowserLike(t *testing.T, srv *httptest.Server) *browserLike {
	return &browserLike{t: t, base: srv.URL, jar: map[string]*http.Cookie{}, hc: &http.Client{
		Timeout:       10 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}}
}

type page struct {
	status int
	header http.Header
	body   string
}

func (b *browserLike) do(method, path string, form url.Values, header map[string]string) page {
	b.t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequest(method, b.base+path, body)
	if err != nil {
		b.t.Fatal(err)
	}
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for _, c := range b.jar {
		req.AddCookie(c)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := b.hc.Do(req)
	if err != nil {
		b.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	for _, c := range resp.Cookies() {
		if c.MaxAge < 0 {
			delete(b.jar, c.Name)
		} else {
			b.jar[c.Name] = c
		}
	}
	raw, _ := io.ReadAll(resp.Body)
	return page{status: resp.StatusCode, header: resp.Header, body: string(raw)}
}

func (b *browserLike) login(token, name string) page {
	b.t.Helper()
	return b.do("POST", "/login", url.Values{"token": {token}, "name": {name}, "next": {"/"}}, nil)
}

var csrfRE = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

func csrfOf(t *testing.T, p page) string {
	t.Helper()
	m := csrfRE.FindStringSubmatch(p.body)
	if m == nil {
		t.Fatalf("no CSRF token on the page (%d):\n%s", p.status, p.body)
	}
	return m[1]
}

func runStatus(t *testing.T, store state.Store, id string) state.Status {
	t.Helper()
	run, err := store.Get(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	return run.Status
}

func admit(t *testing.T, store state.Store, ids ...string) {
	t.Helper()
	for _, id := range ids {
		if _, err := store.Admit(context.Background(), state.AdmitRequest{RunID: id, Actor: "operator"}); err != nil {
			t.Fatal(err)
		}
	}
}

func TestConsoleSendsTheUnauthenticatedToTheLoginForm(t *testing.T) {
	store := testkit.FileStore(t)
	srv, _ := consoleAPI(t, store)
	admit(t, store, "r1")
	b := newBrowserLike(t, srv)
	for path, next := range map[string]string{"/": "/", "/runs/r1": "/runs/r1", "/?status=ACTIVE": "/?status=ACTIVE"} {
		p := b.do("GET", path, nil, nil)
		if p.status != http.StatusSeeOther || p.header.Get("Location") != "/login?next="+url.QueryEscape(next) {
			t.Errorf("GET %s without a session: %d Location %q, want 303 to the login form", path, p.status, p.header.Get("Location"))
		}
	}
	if p := b.do("GET", "/login", nil, nil); p.status != 200 || !strings.Contains(p.body, `name="token"`) {
		t.Fatalf("login form: %d\n%s", p.status, p.body)
	}
	// A form posted without a session is refused, never redirected.
	if p := b.do("POST", "/runs/r1/stop", url.Values{"reason": {"x"}}, nil); p.status != http.StatusUnauthorized {
		t.Errorf("stop without a session: %d, want 401", p.status)
	}
	// A wrong bearer token is a 401 page, not a redirect to a login it would not use.
	if p := b.do("GET", "/", nil, map[string]string{"Authorization": "Bearer sgop_wrong"}); p.status != http.StatusUnauthorized {
		t.Errorf("wrong bearer: %d, want 401", p.status)
	}
	if s := runStatus(t, store, "r1"); s != state.StatusActive {
		t.Fatalf("r1 is %s, want ACTIVE", s)
	}
}

func TestConsoleLoginSetsAStrictHttpOnlyCookieThatIsNotTheToken(t *testing.T) {
	store := testkit.FileStore(t)
	srv, signer := consoleAPI(t, store)
	admit(t, store, "r1")
	b := newBrowserLike(t, srv)

	for name, tc := range map[string]struct {
		token, name string
		status      int
		says        string
	}{
		"Wrong":       {"sgop_guessed", "", 401, "That token was refused"},
		"Empty":       {"", "", 400, "Paste the operator token"},
		"RunToken":    {signer.Sign("r1", 1, time.Now().Add(time.Hour)), "", 403, "may not open the console"},
		"NameOfSpace": {testToken, "alice smith", 400, "no spaces"},
	} {
		p := b.login(tc.token, tc.name)
		if p.status != tc.status || !strings.Contains(p.body, tc.says) || len(b.jar) != 0 {
			t.Errorf("%s: %d cookies %v, want %d saying %q\n%s", name, p.status, b.jar, tc.status, tc.says, p.body)
		}
	}

	p := b.login(testToken, "alice")
	if p.status != http.StatusSeeOther || p.header.Get("Location") != "/" {
		t.Fatalf("login: %d Location %q", p.status, p.header.Get("Location"))
	}
	c := b.jar[control.SessionCookie]
	if c == nil {
		t.Fatalf("no session cookie: %v", p.header["Set-Cookie"])
	}
	set := strings.Join(p.header["Set-Cookie"], "; ")
	for _, attr := range []string{"HttpOnly", "SameSite=Strict", "Path=/", "Max-Age="} {
		if !strings.Contains(set, attr) {
			t.Errorf("Set-Cookie %q lacks %s", set, attr)
		}
	}
	if strings.Contains(c.Value, testToken) || strings.Contains(c.Value, strings.TrimPrefix(testToken, "sgop_")) {
		t.Errorf("the cookie carries the token: %q", c.Value)
	}
	home := b.do("GET", "/", nil, nil)
	if home.status != 200 || !strings.Contains(home.body, "operator (console:alice)") || !strings.Contains(home.body, ">r1<") {
		t.Fatalf("runs page after login: %d\n%s", home.status, home.body)
	}

	// A forged or altered cookie proves nothing.
	b.jar[control.SessionCookie] = &http.Cookie{Name: control.SessionCookie, Value: c.Value[:len(c.Value)-2] + "xx"}
	if p := b.do("GET", "/", nil, nil); p.status != http.StatusSeeOther || !strings.Contains(p.header.Get("Location"), "expired=1") {
		t.Errorf("altered cookie: %d %q, want a redirect to log in again", p.status, p.header.Get("Location"))
	}
	b.jar[control.SessionCookie] = c

	// Logging out ends the session in the browser.
	if p := b.do("POST", "/logout", url.Values{"csrf": {csrfOf(t, home)}}, nil); p.status != http.StatusSeeOther || len(b.jar) != 0 {
		t.Errorf("logout: %d, cookies %v", p.status, b.jar)
	}
}

func TestConsoleFormsNeedTheirCSRFTokenAndTheSameOrigin(t *testing.T) {
	store := testkit.FileStore(t)
	srv, _ := consoleAPI(t, store)
	admit(t, store, "r1")
	b := newBrowserLike(t, srv)
	b.login(testToken, "alice")
	csrf := csrfOf(t, b.do("GET", "/runs/r1", nil, nil))

	for name, tc := range map[string]struct {
		form   url.Values
		header map[string]string
	}{
		"NoToken":         {url.Values{"reason": {"x"}}, nil},
		"WrongToken":      {url.Values{"reason": {"x"}, "csrf": {"AAAA" + csrf[4:]}}, nil},
		"OtherSite":       {url.Values{"reason": {"x"}, "csrf": {csrf}}, map[string]string{"Sec-Fetch-Site": "cross-site"}},
		"OtherPortSameIP": {url.Values{"reason": {"x"}, "csrf": {csrf}}, map[string]string{"Sec-Fetch-Site": "same-site"}},
		"OtherOrigin":     {url.Values{"reason": {"x"}, "csrf": {csrf}}, map[string]string{"Origin": "http://evil.example"}},
		"OpaqueOrigin":    {url.Values{"reason": {"x"}, "csrf": {csrf}}, map[string]string{"Origin": "null"}},
		"AnotherSessions": {url.Values{"reason": {"x"}, "csrf": {csrfOf(t, loggedIn(t, srv).do("GET", "/runs/r1", nil, nil))}}, nil},
	} {
		if p := b.do("POST", "/runs/r1/stop", tc.form, tc.header); p.status != http.StatusForbidden {
			t.Errorf("%s: %d, want 403\n%s", name, p.status, p.body)
		}
	}
	if s := runStatus(t, store, "r1"); s != state.StatusActive {
		t.Fatalf("r1 is %s after refused forms, want ACTIVE", s)
	}
	p := b.do("POST", "/runs/r1/stop", url.Values{"reason": {"by the form"}, "drain": {"5s"}, "csrf": {csrf}},
		map[string]string{"Origin": srv.URL, "Sec-Fetch-Site": "same-origin"})
	if p.status != http.StatusSeeOther || p.header.Get("Location") != "/runs/r1?did=stop" {
		t.Fatalf("stop: %d %q\n%s", p.status, p.header.Get("Location"), p.body)
	}
	run, _ := store.Get(context.Background(), "r1")
	if run.Status != state.StatusCancelling || run.Reason != "by the form" || run.DrainDeadline.Sub(run.CancelledAt) != 5*time.Second {
		t.Fatalf("after Stop: %+v", run)
	}
	events, _ := store.Events(context.Background(), "r1")
	if last := events[len(events)-1]; last.Kind != state.EventRunCancelled || last.Actor != "operator (console:alice)" {
		t.Fatalf("the cancel is recorded as %+v, want by operator (console:alice)", last)
	}
	page := b.do("GET", "/runs/r1?did=stop", nil, nil)
	if !strings.Contains(page.body, `http-equiv="refresh"`) || !strings.Contains(page.body, "Draining") {
		t.Errorf("the page of a draining run does not follow the drain:\n%s", page.body)
	}
	if strings.Contains(page.body, `id="stop-form"`) {
		t.Errorf("a stopped run still shows the Stop button")
	}
}

func loggedIn(t *testing.T, srv *httptest.Server) *browserLike {
	b := newBrowserLike(t, srv)
	if p := b.login(testToken, "mallory"); p.status != http.StatusSeeOther {
		t.Fatalf("login: %d", p.status)
	}
	return b
}

func TestConsoleReadOnlySessionShowsAndChangesNothing(t *testing.T) {
	store := testkit.FileStore(t)
	srv, _ := consoleAPI(t, store)
	admit(t, store, "r1")
	unknownRun(t, store, "r2", "charge-42")
	b := newBrowserLike(t, srv)
	b.login(readToken, "")
	for _, path := range []string{"/", "/runs/r1", "/runs/r2"} {
		p := b.do("GET", path, nil, nil)
		if p.status != 200 || strings.Contains(p.body, `id="stop-form"`) || strings.Contains(p.body, "Record outcome") || !strings.Contains(p.body, "read-only") {
			t.Errorf("GET %s as read-only: %d, shows a form or hides the scope:\n%s", path, p.status, p.body)
		}
	}
	csrf := csrfOf(t, b.do("GET", "/", nil, nil)) // the logout form's
	for path, form := range map[string]url.Values{
		"/runs/r1/stop":                      {"csrf": {csrf}},
		"/runs/r2/intents/charge-42/resolve": {"csrf": {csrf}, "outcome": {"applied"}},
	} {
		if p := b.do("POST", path, form, nil); p.status != http.StatusForbidden || !strings.Contains(p.body, "a read-only token may not stop runs") {
			t.Errorf("POST %s as read-only: %d\n%s", path, p.status, p.body)
		}
	}
	if runStatus(t, store, "r1") != state.StatusActive || runStatus(t, store, "r2") != state.StatusUnknown {
		t.Fatalf("a read-only session changed a run")
	}
	if p := b.do("POST", "/logout", url.Values{"csrf": {csrf}}, nil); p.status != http.StatusSeeOther || len(b.jar) != 0 {
		t.Errorf("a read-only session logging out: %d, cookies %v", p.status, b.jar)
	}
}

func TestConsoleTakesTheBearerHeaderForScripts(t *testing.T) {
	store := testkit.FileStore(t)
	srv, signer := consoleAPI(t, store)
	admit(t, store, "r1", "r2")
	b := newBrowserLike(t, srv)
	op := map[string]string{"Authorization": "Bearer " + testToken}
	if p := b.do("GET", "/", nil, op); p.status != 200 || !strings.Contains(p.body, ">r1<") {
		t.Fatalf("GET / with the operator's bearer: %d\n%s", p.status, p.body)
	}
	// No cookie, so no CSRF token to send: the header cannot be forged by another site.
	if p := b.do("POST", "/runs/r1/stop", url.Values{"reason": {"script"}}, op); p.status != http.StatusSeeOther {
		t.Fatalf("stop with the bearer: %d\n%s", p.status, p.body)
	}
	if s := runStatus(t, store, "r1"); s != state.StatusCancelling {
		t.Fatalf("r1 is %s", s)
	}
	worker := map[string]string{"Authorization": "Bearer " + signer.Sign("r2", 1, time.Now().Add(time.Hour))}
	if p := b.do("GET", "/runs/r2", nil, worker); p.status != http.StatusForbidden {
		t.Errorf("a worker's token on the console: %d, want 403", p.status)
	}
	if p := b.do("POST", "/runs/r2/stop", url.Values{}, worker); p.status != http.StatusForbidden {
		t.Errorf("a worker's token pressing Stop: %d, want 403", p.status)
	}
	if s := runStatus(t, store, "r2"); s != state.StatusActive {
		t.Fatalf("r2 is %s", s)
	}
}

func TestConsolePagesAreLockedDown(t *testing.T) {
	store := testkit.FileStore(t)
	srv, _ := consoleAPI(t, store)
	admit(t, store, "r1")
	b := newBrowserLike(t, srv)
	b.login(testToken, "")
	p := b.do("GET", "/runs/r1", nil, nil)
	csp := p.header.Get("Content-Security-Policy")
	style := regexp.MustCompile(`(?s)<style>(.*?)</style>`).FindStringSubmatch(p.body)
	if style == nil {
		t.Fatal("no style sheet")
	}
	sum := sha256.Sum256([]byte(style[1]))
	for _, want := range []string{"default-src 'none'", "'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'", "frame-ancestors 'none'", "form-action 'self'"} {
		if !strings.Contains(csp, want) {
			t.Errorf("CSP %q lacks %s", csp, want)
		}
	}
	for h, want := range map[string]string{"X-Frame-Options": "DENY", "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Content-Type": "text/html; charset=utf-8"} {
		if got := p.header.Get(h); got != want {
			t.Errorf("%s %q, want %q", h, got, want)
		}
	}
	if strings.Contains(p.body, "<script") || strings.Contains(p.body, "http://") || strings.Contains(p.body, "https://") {
		t.Errorf("the page loads a script or an external asset:\n%s", p.body)
	}
	// The login sends nobody elsewhere.
	for _, next := range []string{"//evil.example/", "https://evil.example/", "/\\evil.example", "javascript:alert(1)"} {
		nb := newBrowserLike(t, srv)
		p := nb.do("POST", "/login", url.Values{"token": {testToken}, "next": {next}}, nil)
		if p.header.Get("Location") != "/" {
			t.Errorf("next %q: redirected to %q, want /", next, p.header.Get("Location"))
		}
	}
	// Text from the record is escaped.
	if _, err := store.Cancel(context.Background(), state.CancelRequest{RunID: "r1", Actor: "operator", Reason: `<img src=x onerror=alert(1)>`, DrainTimeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
	if p := b.do("GET", "/runs/r1", nil, nil); strings.Contains(p.body, "<img src=x") || !strings.Contains(p.body, "&lt;img src=x") {
		t.Errorf("a reason was not escaped:\n%s", p.body)
	}
}

// TestAPIRefusesWritesFromOtherSites: a page elsewhere cannot make an
// operator's browser change anything, on the API either; even a control
// plane served open is not reachable by a web page this way.
func TestAPIRefusesWritesFromOtherSites(t *testing.T) {
	store := testkit.FileStore(t)
	srv := serveOpts(t, control.Options{Store: store, Open: true})
	admit(t, store, "r1")
	none := map[string]string{"Authorization": ""}
	for name, h := range map[string]map[string]string{
		"CrossSite":   {"Sec-Fetch-Site": "cross-site"},
		"SameSite":    {"Sec-Fetch-Site": "same-site"},
		"OtherOrigin": {"Origin": "http://evil.example"},
	} {
		h["Authorization"] = ""
		if r := do(t, srv, "POST", "/v1/runs/r1/cancel", "", h); r.status != http.StatusForbidden {
			t.Errorf("%s: cancel %d, want 403", name, r.status)
		}
	}
	if r := do(t, srv, "GET", "/v1/runs/r1", "", map[string]string{"Authorization": "", "Sec-Fetch-Site": "cross-site"}); r.status != 200 {
		t.Errorf("a cross-site read: %d", r.status)
	}
	if s := runStatus(t, store, "r1"); s != state.StatusActive {
		t.Fatalf("r1 is %s", s)
	}
	if r := do(t, srv, "POST", "/v1/runs/r1/cancel", "", none); r.status != http.StatusAccepted {
		t.Errorf("a program's cancel: %d", r.status)
	}
}

// TestConsoleShowsARunsUsageAgainstItsLimits: the run's page draws each
// limit of its budget with what is used of it (the one that cancelled the
// run marked), its tokens by model, its spend and its unknown usage.
func TestConsoleShowsARunsUsageAgainstItsLimits(t *testing.T) {
	store := testkit.FileStore(t)
	srv, _ := consoleAPI(t, store)
	ctx := context.Background()
	if _, err := store.Admit(ctx, state.AdmitRequest{RunID: "b1", Actor: "test", Budget: state.Budget{MaxEffects: 2, MaxTokens: 1000, DrainTimeout: time.Second}}); err != nil {
		t.Fatal(err)
	}
	var ins []state.Intent
	for i := range 3 {
		res, err := store.Guard(ctx, state.GuardRequest{RunID: "b1", Key: fmt.Sprintf("k%d", i), ExplicitKey: true, Boundary: state.BoundaryHTTP,
			Target: "https://api.example/v1", LeaseTTL: time.Minute, Actor: "p"})
		if err != nil {
			t.Fatal(err)
		}
		ins = append(ins, res.Intent)
	}
	for i, llm := range []*state.LLMUsage{{Model: "gpt-x", Known: true, InputTokens: 120, OutputTokens: 30, Priced: true, Spend: 2_500_000}, {Model: "gpt-x"}} {
		if _, err := store.Finish(ctx, state.FinishRequest{RunID: "b1", Key: ins[i].Key, Attempt: 1, Outcome: state.IntentResponded, StatusCode: 200, LLM: llm, Actor: "p"}); err != nil {
			t.Fatal(err)
		}
	}
	b := newBrowserLike(t, srv)
	b.login(testToken, "")
	p := b.do("GET", "/runs/b1", nil, nil)
	for _, want := range []string{
		`data-limit="max_effects"`, "2 / 2", "crossed: cancelled the run", `data-limit="max_tokens"`, "150 / 1000",
		`id="usage-tokens">120 / 30<`, `id="usage-spend">$0.0025<`, `id="usage-unknown">1 unknown<`, ">gpt-x<", "api.example</span> 2",
	} {
		if !strings.Contains(p.body, want) {
			t.Errorf("the run's page lacks %q", want)
		}
	}
	if t.Failed() {
		t.Log(p.body)
	}
}

// TestConsoleAndAPIDecideWhoMayStopARunAlike: for each credential, the
// console's Stop button and the API's cancel answer alike — allowed, or
// 403 with the same words — because both ask Principal.allow.
func TestConsoleAndAPIDecideWhoMayStopARunAlike(t *testing.T) {
	store := testkit.FileStore(t)
	srv, signer := consoleAPI(t, store)
	for name, tc := range map[string]struct {
		token string
		may   bool
	}{
		"operator":  {testToken, true},
		"read-only": {readToken, false},
		"worker":    {signer.Sign("w-run", 1, time.Now().Add(time.Hour)), false},
	} {
		t.Run(name, func(t *testing.T) {
			runAPI, runConsole := "api-"+name, "console-"+name
			if name == "worker" {
				runAPI, runConsole = "w-run", "w-run"
			}
			admit(t, store, runAPI)
			if runConsole != runAPI {
				admit(t, store, runConsole)
			}
			bearer := map[string]string{"Authorization": "Bearer " + tc.token}
			b := newBrowserLike(t, srv)
			console := b.do("POST", "/runs/"+runConsole+"/stop", url.Values{"reason": {"test"}}, bearer)
			api := b.do("POST", "/v1/runs/"+runAPI+"/cancel", nil, bearer)
			consoleMay, apiMay := console.status == http.StatusSeeOther, api.status == http.StatusAccepted
			if consoleMay != tc.may || apiMay != tc.may {
				t.Fatalf("console %d, API %d; want both to allow: %v\nconsole: %s\nAPI: %s", console.status, api.status, tc.may, console.body, api.body)
			}
			if tc.may {
				return
			}
			var refused struct{ Message string }
			if err := json.Unmarshal([]byte(api.body), &refused); err != nil || refused.Message == "" {
				t.Fatalf("API refusal %q: %v", api.body, err)
			}
			// The words that name the credential and what would do.
			why := refused.Message[strings.LastIndex(refused.Message, ":")+1:]
			if console.status != http.StatusForbidden || !strings.Contains(html.UnescapeString(console.body), strings.TrimSpace(why)) {
				t.Errorf("console %d does not give the API's reason %q:\n%s", console.status, why, console.body)
			}
		})
	}
}
