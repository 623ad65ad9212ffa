package control

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/base64"
	"errors"
	"fmt"
	"html/template"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/signed"
	"github.com/stopgate/stopgate/state"
)

// The operator console: server-rendered pages on the control listener at
// /, for people. It shows what the API shows (runs by status, a run's
// timeline of transitions and effects) and does what an operator does
// there (stop a run, reconcile an UNKNOWN effect) through the same store
// steps as the API, under the same tokens: an Authorization header, or a
// session cookie that the login form sets once it has seen a token. No
// script, no external asset: a page of a draining run refreshes itself.

//go:embed console.html
var consoleHTML string

//go:embed console.css
var consoleCSS string

// maxFormBytes bounds a console form.
const maxFormBytes = 64 << 10

// drainRefresh is how often the page of a draining run reloads.
const drainRefresh = 1

// consolePath reports whether the console, not the API, serves path.
func consolePath(path string) bool {
	return path == "/" || path == "/login" || path == "/logout" || strings.HasPrefix(path, "/runs/")
}

// console is the console's share of the Handler.
type console struct {
	tmpl *template.Template
	keys sessionKeys
	// csp allows the page's one inline style sheet and nothing else.
	csp string
	mux *http.ServeMux
}

func (h *Handler) newConsole(operatorToken string) error {
	keys, err := newSessionKeys(operatorToken)
	if err != nil {
		return fmt.Errorf("control: console session key: %w", err)
	}
	tmpl, err := template.New("console").Funcs(template.FuncMap{
		"when":      func(t time.Time) string { return fmtWhen(t) },
		"clock":     func(t time.Time) string { return t.UTC().Format("15:04:05.000") },
		"day":       func(t time.Time) string { return t.UTC().Format("2006-01-02") },
		"lower":     func(s any) string { return strings.ToLower(fmt.Sprint(s)) },
		"kindWords": kindWords,
		"counts":    fmtCounts,
		"seg":       url.PathEscape,
		"odd":       func(i int) int { return i % 2 },
	}).Parse(consoleHTML)
	if err != nil {
		return fmt.Errorf("control: console templates: %w", err)
	}
	sum := sha256.Sum256([]byte(consoleCSS))
	h.console = console{
		tmpl: tmpl, keys: keys,
		csp: "default-src 'none'; style-src 'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'; img-src data:; " +
			"form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
		mux: http.NewServeMux(),
	}
	m := h.console.mux
	m.HandleFunc("GET /{$}", h.page(h.runsPage))
	m.HandleFunc("GET /login", h.loginPage)
	m.HandleFunc("POST /login", h.login)
	m.HandleFunc("POST /logout", h.action(false, h.logout))
	m.HandleFunc("GET /runs/{run}", h.page(h.runPage))
	m.HandleFunc("POST /runs/{run}/stop", h.action(true, h.stop))
	m.HandleFunc("POST /runs/{run}/intents/{key}/resolve", h.action(true, h.reconcile))
	m.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		h.render(w, r, http.StatusNotFound, view{Page: "error", Title: "Not found", Error: "There is no page " + r.URL.Path + "."})
	})
	return nil
}

// view is what a page template reads.
type view struct {
	Page, Title string
	// Who is the actor the record names for this visitor; Anonymous
	// pages (the login form, early refusals) name nobody.
	Who       string
	Anonymous bool
	CanAct    bool
	// LoggedIn: a session cookie, which the logout button ends.
	LoggedIn bool
	CSRF     string
	Refresh  int
	Error    string
	Notice   string
	Runs     *runsView
	Run      *runView
	Login    *loginView
}

// consoleVisitor is who a console request is, and its session's cookie
// value (empty without one), which its forms' CSRF token is bound to.
type consoleVisitor struct {
	p      Principal
	cookie string
}

// visitor says who r is: its bearer token, else its session cookie, else
// (open control plane) an anonymous operator. ok is false when r proves
// nothing; err says why when it presented something that did not verify.
func (h *Handler) visitor(r *http.Request) (v consoleVisitor, ok bool, err error) {
	token, err := bearer(r)
	if err == nil {
		p, err := h.creds.check(token, time.Now())
		return consoleVisitor{p: p}, err == nil, err
	}
	if !errors.Is(err, errNoCredential) {
		return v, false, err
	}
	if c, cerr := r.Cookie(SessionCookie); cerr == nil && c.Value != "" {
		s, err := h.console.keys.open(c.Value, time.Now())
		if err == nil {
			claimed := "console"
			if s.Name != "" {
				claimed += ":" + s.Name
			}
			return consoleVisitor{p: Principal{Scope: s.Scope, Claimed: claimed}, cookie: c.Value}, true, nil
		}
		if !h.creds.open {
			return v, false, err
		}
	}
	if h.creds.open {
		return consoleVisitor{p: Principal{Scope: ScopeOperator, Anonymous: true, Claimed: "console"}}, true, nil
	}
	return v, false, nil
}

// page wraps a GET page: a visitor who proves nothing is sent to the login
// form; a worker's token does not open the console.
func (h *Handler) page(fn func(w http.ResponseWriter, r *http.Request, v consoleVisitor)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		v, ok, err := h.visitor(r)
		if !ok {
			if _, hasBearer := r.Header["Authorization"]; hasBearer {
				h.render(w, r, http.StatusUnauthorized, view{Page: "error", Title: "Not authorized", Error: errText(err, "The bearer token was refused.")})
				return
			}
			q := url.Values{"next": {r.URL.RequestURI()}}
			if err != nil {
				q.Set("expired", "1")
			}
			http.Redirect(w, r, "/login?"+q.Encode(), http.StatusSeeOther)
			return
		}
		if err := v.p.allow(accessRead, "", consoleWhat); err != nil {
			h.render(w, r, http.StatusForbidden, view{Page: "error", Title: "Forbidden", Error: errText(err, "")})
			return
		}
		fn(w, r, v)
	}
}

// consoleWhat is what a visitor does in the console, for the refusal of
// one who may not: the console spans runs, so it is a route of no run.
const consoleWhat = "open the console"

// canAct says whether p may use the console's forms that change a run: the
// rule of the API's routes that do (Principal.allow), not one of its own.
func canAct(p Principal) bool { return p.allow(accessOperate, "", "") == nil }

// action wraps a form POST: the visitor must prove itself (no redirect: a
// form must not be lost silently), a cookie session must send its form's
// CSRF token, and, for what changes a run, it must be an operator.
func (h *Handler) action(operatorOnly bool, fn func(w http.ResponseWriter, r *http.Request, v consoleVisitor)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		v, ok, err := h.visitor(r)
		if !ok {
			h.render(w, r, http.StatusUnauthorized, view{Page: "error", Title: "Not authorized", Error: errText(err, "Log in first.")})
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
		if err := r.ParseForm(); err != nil {
			h.render(w, r, http.StatusBadRequest, view{Page: "error", Title: "Bad form", Error: "The form could not be read: " + err.Error()})
			return
		}
		if v.cookie != "" && !signed.Equal(r.PostForm.Get(csrfField), h.console.keys.csrf(v.cookie)) {
			h.render(w, r, http.StatusForbidden, view{Page: "error", Title: "Forbidden",
				Error: "The form's CSRF token is missing or stale: reload the page and try again."})
			return
		}
		need, what := accessRead, consoleWhat
		if operatorOnly {
			need, what = accessOperate, "stop runs or reconcile effects"
		}
		if err := v.p.allow(need, "", what); err != nil {
			h.render(w, r, http.StatusForbidden, view{Page: "error", Title: "Forbidden", Error: errText(err, "")})
			return
		}
		fn(w, r, v)
	}
}

func errText(err error, fallback string) string {
	var rf *refusal.Refusal
	if errors.As(err, &rf) {
		return rf.Message
	}
	if err != nil {
		return err.Error()
	}
	return fallback
}

// render writes a page with the console's headers.
func (h *Handler) render(w http.ResponseWriter, r *http.Request, status int, v view) {
	if v.Who == "" && !v.Anonymous {
		if vis, ok, _ := h.visitor(r); ok {
			v.Who, v.CanAct, v.LoggedIn = vis.p.Actor(), canAct(vis.p), vis.cookie != ""
			if vis.cookie != "" {
				v.CSRF = h.console.keys.csrf(vis.cookie)
			}
		}
	}
	var buf bytes.Buffer
	if err := h.console.tmpl.ExecuteTemplate(&buf, "layout", struct {
		view
		CSS template.CSS
	}{v, template.CSS(consoleCSS)}); err != nil {
		h.log.Error("control: console page failed to render", "page", v.Page, "err", err)
		http.Error(w, "the page failed to render; the server log has the details", http.StatusInternalServerError)
		return
	}
	hd := w.Header()
	hd.Set("Content-Type", "text/html; charset=utf-8")
	hd.Set("Content-Security-Policy", h.console.csp)
	hd.Set("Cache-Control", "no-store")
	hd.Set("X-Content-Type-Options", "nosniff")
	hd.Set("X-Frame-Options", "DENY")
	// same-origin rather than no-referrer: with no-referrer a browser sends
	// its own forms with "Origin: null".
	hd.Set("Referrer-Policy", "same-origin")
	w.WriteHeader(status)
	if r.Method != http.MethodHead {
		_, _ = w.Write(buf.Bytes())
	}
}

func (v consoleVisitor) view(h *Handler, page, title string) view {
	out := view{Page: page, Title: title, Who: v.p.Actor(), CanAct: canAct(v.p), LoggedIn: v.cookie != ""}
	if v.cookie != "" {
		out.CSRF = h.console.keys.csrf(v.cookie)
	}
	return out
}

// --- login ---

type loginView struct {
	Next, Name string
}

func (h *Handler) loginPage(w http.ResponseWriter, r *http.Request) {
	v := view{Page: "login", Title: "Log in", Login: &loginView{Next: safeNext(r.URL.Query().Get("next"))}}
	if r.URL.Query().Get("expired") != "" {
		v.Error = "Your session has expired or is no longer valid: log in again."
	}
	v.Anonymous = true
	h.render(w, r, http.StatusOK, v)
}

// login takes a token from the form, and answers a session cookie that
// says which scope it proved. The token itself is not kept.
func (h *Handler) login(w http.ResponseWriter, r *http.Request) {
	r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
	if err := r.ParseForm(); err != nil {
		h.render(w, r, http.StatusBadRequest, view{Page: "error", Title: "Bad form", Anonymous: true, Error: "The form could not be read: " + err.Error()})
		return
	}
	lv := &loginView{Next: safeNext(r.PostForm.Get("next")), Name: r.PostForm.Get("name")}
	fail := func(status int, msg string) {
		h.render(w, r, status, view{Page: "login", Title: "Log in", Anonymous: true, Error: msg, Login: lv})
	}
	name, err := consoleName(lv.Name)
	if err != nil {
		fail(http.StatusBadRequest, "Your name: "+err.Error()+".")
		return
	}
	token := strings.TrimSpace(r.PostForm.Get("token"))
	if token == "" {
		fail(http.StatusBadRequest, "Paste the operator token (operator.token in stopgate's data directory) or the read-only token.")
		return
	}
	p, err := h.creds.check(token, time.Now())
	switch {
	case err != nil:
		h.log.Info("control: console login refused", "remote", r.RemoteAddr)
		fail(http.StatusUnauthorized, "That token was refused.")
		return
	}
	if err := p.allow(accessRead, "", consoleWhat); err != nil {
		fail(http.StatusForbidden, errText(err, ""))
		return
	}
	value, err := h.console.keys.issue(p.Scope, name, time.Now())
	if err != nil {
		fail(http.StatusInternalServerError, "The session could not be created: "+err.Error())
		return
	}
	setSessionCookie(w, r, value, int(SessionTTL/time.Second))
	h.log.Info("control: console login", "scope", p.Scope, "name", name, "remote", r.RemoteAddr)
	http.Redirect(w, r, lv.Next, http.StatusSeeOther)
}

func (h *Handler) logout(w http.ResponseWriter, r *http.Request, _ consoleVisitor) {
	setSessionCookie(w, r, "", -1)
	http.Redirect(w, r, "/login", http.StatusSeeOther)
}

// safeNext keeps a post-login redirect on this site: a path, never a URL
// to elsewhere ("//evil.example", "https://…", "/\evil").
func safeNext(next string) string {
	if !strings.HasPrefix(next, "/") || strings.HasPrefix(next, "//") || strings.ContainsAny(next, "\\\r\n") {
		return "/"
	}
	u, err := url.Parse(next)
	if err != nil || u.Host != "" || u.Scheme != "" {
		return "/"
	}
	return next
}

// --- runs ---

type runsView struct {
	Filter string // status, "" for all
	// Query is the id prefix searched, Since the time (as typed).
	Query, Since string
	Total        int
	Counts       []statusCount
	Rows         []state.Run
	// Capped: more runs matched than a page lists.
	Capped int
}

type statusCount struct {
	Status state.Status
	N      int
}

// maxListedRuns bounds the runs one page lists: the counts cover them all.
const maxListedRuns = 500

var listedStatuses = []state.Status{state.StatusActive, state.StatusCancelling, state.StatusUnknown, state.StatusCancelled, state.StatusCompleted}

func (h *Handler) runsPage(w http.ResponseWriter, r *http.Request, v consoleVisitor) {
	out := v.view(h, "runs", "Runs")
	qv := r.URL.Query()
	rv := &runsView{Query: strings.TrimSpace(qv.Get("prefix")), Since: strings.TrimSpace(qv.Get("since"))}
	out.Runs = rv
	// The API's query: by status, id prefix and time, the latest first.
	q, err := ParseRunQuery(url.Values{"status": {qv.Get("status")}, "prefix": {rv.Query}, "since": {rv.Since}}, time.Now())
	if err != nil {
		out.Error = state.Why(err) + ": showing every run."
		q, rv.Query, rv.Since = RunQuery{}, "", ""
	}
	q.Sort, q.Limit = SortByUpdated, maxListedRuns
	rv.Filter = string(q.Status)
	ctx, cancel := context.WithTimeout(r.Context(), h.storeTimeout)
	defer cancel()
	runs, err := h.store.List(ctx, "")
	if err != nil {
		h.renderStoreError(w, r, out, err)
		return
	}
	counts := map[state.Status]int{}
	for _, run := range runs {
		counts[run.Status]++
	}
	rv.Total = len(runs)
	for _, s := range listedStatuses {
		rv.Counts = append(rv.Counts, statusCount{s, counts[s]})
	}
	// The latest activity first: what an operator looks for.
	matched, more := q.Apply(runs)
	for _, run := range matched {
		rv.Rows = append(rv.Rows, normRun(run))
	}
	rv.Capped = more
	h.render(w, r, http.StatusOK, out)
}

func (h *Handler) renderStoreError(w http.ResponseWriter, r *http.Request, out view, err error) {
	rf := refusal.FromError(err)
	if rf.Code == refusal.StoreUnavailable {
		h.log.Warn("control: store unavailable", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	out.Page, out.Error = "error", rf.Message
	h.render(w, r, rf.Status(), out)
}

// --- a run ---

type runView struct {
	Run      state.Run
	Intents  []state.Intent
	Unknown  []state.Intent
	Timeline []timelineEntry
	// Chart draws the effects on a time axis (nil: nothing to draw).
	Chart     *chart
	InFlight  int
	Draining  bool
	Remaining string
	// Limits are the run's budget beside its usage; Usage what it used.
	Limits []limitRow
	Usage  *usageView
	// DefaultDrain is the server's drain, for the Stop form.
	DefaultDrain string
	// Form values to show again after a refused form.
	Reason, Drain string
}

// limitRow is one limit of the run's budget as the console draws it: what
// is used of it, as a share of its width.
type limitRow struct {
	Limit, Text string
	Percent     int
	Crossed     bool
}

// usageView is what the run used.
type usageView struct {
	Effects, RequestBytes, ResponseBytes int64
	InputTokens, OutputTokens            int64
	LLMCalls, Unknown, Unpriced          int64
	Spend                                string
	Models                               []modelRow
	Destinations                         []destinationRow
	CancelOnUnknown                      bool
}

type modelRow struct {
	Model string
	state.ModelUsage
}

type destinationRow struct {
	Host    string
	Effects int64
}

// maxConsoleRows bounds the models and destinations a run's page lists.
const maxConsoleRows = 12

func usageOf(run state.Run, now time.Time) ([]limitRow, *usageView) {
	u := run.Usage
	elapsed := now.Sub(run.CreatedAt)
	if run.Status != state.StatusActive && !run.CancelledAt.IsZero() {
		elapsed = run.CancelledAt.Sub(run.CreatedAt)
	}
	var limits []limitRow
	for _, l := range run.Budget.Uses(u, elapsed) {
		pct := int(min(100, l.Used*100/max(l.Max, 1)))
		limits = append(limits, limitRow{Limit: l.Limit, Text: l.String(), Percent: pct,
			Crossed: run.Reason == state.BudgetReason(l.Limit)})
	}
	view := &usageView{
		Effects: u[state.CounterEffects], RequestBytes: u[state.CounterRequestBytes], ResponseBytes: u[state.CounterResponseBytes],
		InputTokens: u[state.CounterInputTokens], OutputTokens: u[state.CounterOutputTokens],
		LLMCalls: u[state.CounterLLMCalls], Unknown: u[state.CounterUnknownUsage], Unpriced: u[state.CounterUnpriced],
		Spend: state.FormatUSD(u[state.CounterSpend]), CancelOnUnknown: run.Budget.CancelOnUnknownUsage,
	}
	models := u.Models()
	for _, m := range slices.Sorted(maps.Keys(models)) {
		if len(view.Models) < maxConsoleRows {
			view.Models = append(view.Models, modelRow{m, models[m]})
		}
	}
	dests := u.Destinations()
	for _, h := range slices.SortedFunc(maps.Keys(dests), func(a, b string) int {
		if c := cmp.Compare(dests[b], dests[a]); c != 0 {
			return c
		}
		return strings.Compare(a, b)
	}) {
		if len(view.Destinations) < maxConsoleRows {
			view.Destinations = append(view.Destinations, destinationRow{h, dests[h]})
		}
	}
	return limits, view
}

// timelineEntry is one line of a run's history: a transition of the run
// or of one of its effects, with the effect it concerns.
type timelineEntry struct {
	state.Event
	Effect *state.Intent
}

func (h *Handler) runPage(w http.ResponseWriter, r *http.Request, v consoleVisitor) {
	out := v.view(h, "run", "")
	switch r.URL.Query().Get("did") {
	case "stop":
		out.Notice = "Stopped: nothing new of this run starts, from now on, anywhere."
	case "resolve":
		out.Notice = "Recorded the outcome of " + r.URL.Query().Get("key") + "."
	}
	h.showRun(w, r, out, http.StatusOK)
}

// showRun renders the run of the path into out, with status.
func (h *Handler) showRun(w http.ResponseWriter, r *http.Request, out view, status int) {
	id, err := runID(r)
	if err != nil {
		out.Page, out.Error = "error", errText(refusal.FromError(err), "")
		h.render(w, r, http.StatusBadRequest, out)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.storeTimeout)
	defer cancel()
	// The order of the API's audit: everything the row counts is in the lists.
	run, err := h.store.Get(ctx, id)
	var intents []state.Intent
	var events []state.Event
	if err == nil {
		intents, err = h.store.Intents(ctx, id)
	}
	if err == nil {
		events, err = h.store.Events(ctx, id)
	}
	if errors.Is(err, state.ErrNotFound) {
		out.Page, out.Title, out.Error = "error", "Not found", "Run "+id+" was never admitted nor cancelled."
		h.render(w, r, http.StatusNotFound, out)
		return
	}
	if err != nil {
		h.renderStoreError(w, r, out, err)
		return
	}
	rv := out.Run
	if rv == nil {
		rv = &runView{}
	}
	rv.Run, rv.Intents = normRun(run), intents
	rv.DefaultDrain = h.drain.String()
	byKey := map[string]*state.Intent{}
	for i := range intents {
		byKey[intents[i].Key] = &intents[i]
		if intents[i].State == state.IntentUnknown {
			rv.Unknown = append(rv.Unknown, intents[i])
		}
	}
	for _, e := range events {
		rv.Timeline = append(rv.Timeline, timelineEntry{Event: e, Effect: byKey[e.Intent]})
	}
	rv.Chart = runChart(run, intents, events, time.Now())
	rv.Limits, rv.Usage = usageOf(run, time.Now())
	rv.InFlight = run.Intents[state.IntentInFlight]
	if run.Status == state.StatusCancelling {
		rv.Draining = true
		out.Refresh = drainRefresh
		if left := time.Until(run.DrainDeadline); left > 0 {
			rv.Remaining = left.Round(time.Second).String()
		}
	}
	out.Run, out.Title = rv, run.ID
	h.render(w, r, status, out)
}

// stop is the Stop button: the cancel, with the form's reason and drain.
func (h *Handler) stop(w http.ResponseWriter, r *http.Request, v consoleVisitor) {
	id, err := runID(r)
	if err != nil {
		h.render(w, r, http.StatusBadRequest, view{Page: "error", Title: "Bad run id", Error: errText(refusal.FromError(err), "")})
		return
	}
	reason, drainText := strings.TrimSpace(r.PostForm.Get("reason")), strings.TrimSpace(r.PostForm.Get("drain"))
	var drain *time.Duration
	if drainText != "" {
		d, err := ParseDuration(drainText)
		if err != nil {
			h.refusedForm(w, r, v, http.StatusBadRequest, "Drain: "+err.Error(), &runView{Reason: reason, Drain: drainText})
			return
		}
		drain = &d
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.storeTimeout)
	defer cancel()
	if _, err := h.cancelRun(ctx, id, v.p.Actor(), reason, drain); err != nil {
		rf := refusal.FromError(err)
		h.refusedForm(w, r, v, rf.Status(), rf.Message, &runView{Reason: reason, Drain: drainText})
		return
	}
	http.Redirect(w, r, "/runs/"+url.PathEscape(id)+"?did=stop", http.StatusSeeOther)
}

// reconcile records what the operator found out about an UNKNOWN effect.
func (h *Handler) reconcile(w http.ResponseWriter, r *http.Request, v consoleVisitor) {
	id, key, err := intentPath(r)
	if err != nil {
		h.render(w, r, http.StatusBadRequest, view{Page: "error", Title: "Bad request", Error: errText(refusal.FromError(err), "")})
		return
	}
	var applied bool
	switch r.PostForm.Get("outcome") {
	case OutcomeApplied:
		applied = true
	case OutcomeNotApplied:
	default:
		h.refusedForm(w, r, v, http.StatusBadRequest, "Choose Applied or Not applied for "+key+".", nil)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.storeTimeout)
	defer cancel()
	req := state.ResolveRequest{RunID: id, Key: key, Applied: applied, Source: DefaultResolveSource, Note: strings.TrimSpace(r.PostForm.Get("note")), Actor: v.p.Actor()}
	if _, err := h.resolveIntent(ctx, req); err != nil {
		rf := refusal.FromError(err)
		h.refusedForm(w, r, v, rf.Status(), rf.Message, nil)
		return
	}
	http.Redirect(w, r, "/runs/"+url.PathEscape(id)+"?"+url.Values{"did": {"resolve"}, "key": {key}}.Encode(), http.StatusSeeOther)
}

// refusedForm shows the run again with what was wrong, and what was typed.
func (h *Handler) refusedForm(w http.ResponseWriter, r *http.Request, v consoleVisitor, status int, msg string, rv *runView) {
	out := v.view(h, "run", "")
	out.Error, out.Run = msg, rv
	h.showRun(w, r, out, status)
}

// --- formatting ---

func fmtWhen(t time.Time) string {
	if t.IsZero() {
		return "—"
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

func fmtCounts(m map[state.IntentState]int) string {
	if len(m) == 0 {
		return "none"
	}
	keys := slices.Sorted(maps.Keys(m))
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, " · ")
}

// kindWords says an event's kind as an operator reads it.
func kindWords(kind string) string {
	switch kind {
	case state.EventRunAdmitted:
		return "run admitted"
	case state.EventRunCancelled:
		return "run stopped"
	case state.EventRunTransition:
		return "run moved on"
	case state.EventRunCompleted:
		return "run completed"
	case state.EventIntentAdmitted:
		return "effect admitted"
	case state.EventIntentRefused:
		return "effect refused"
	case state.EventIntentOutcome:
		return "outcome reported"
	case state.EventIntentExpired:
		return "lease expired"
	case state.EventIntentRevoked:
		return "retry revoked"
	case state.EventIntentResolved:
		return "reconciled"
	}
	return cmp.Or(kind, "—")
}
