// Package browserguard is the browser boundary: a Chrome DevTools Protocol
// (CDP) proxy that agents connect to as if it were the browser, and a
// launcher that starts a headless Chromium for a run with its network bound
// to the egress proxy under that run.
//
// It owns the CDP connections and the launched browsers. A launched
// browser listens on no port: its only DevTools connection is a pipe that
// the launcher holds, so the guard is the only way to drive it. Every
// action command (navigation, input, script, uploads, new targets,
// released requests; see isAction) passes the one atomic guard through the
// intents ledger before a byte of it reaches the browser, and is recorded
// with its outcome; after a cancel the run's actions get a CDP error naming
// the run's state and the refusal. Once the run is over its browser lingers
// (reads still work, actions are refused), then it is stopped and its
// connections are closed with the refusal as their close reason.
//
// It never forwards an action the guard did not admit, and never forwards
// a frame it cannot read the way the browser will (bad JSON, binary, too
// large, ambiguous members): those get a CDP error. When the store does not
// answer, actions fail closed. It never decides a run's state and never
// carries the browser's own network traffic: that is the egress proxy's.
package browserguard

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/coder/websocket"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/runwatch"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/telemetry"
)

// Defaults for Config fields left zero.
const (
	// DefaultMaxMessage bounds a client frame. CDP commands are small; the
	// largest real ones (setDocumentContent, a file list, a long script)
	// stay far below it.
	DefaultMaxMessage = 16 << 20
	// browserFetchTimeout bounds the guard's own calls to the browser:
	// what /json/* serve, opening and closing a connection's session.
	browserFetchTimeout = 5 * time.Second
)

// Config wires a Guard.
type Config struct {
	// Store is read when a client connects, to know whether its run is over.
	Store  state.Store
	Ledger *intents.Ledger
	// Watcher carries the rows of runs with open connections to the guard.
	Watcher *runwatch.Watcher
	// Browsers finds the DevTools connection of the browser that serves a
	// run: Launcher.DevTools.
	Browsers func(run string) (*DevTools, bool)
	// AutoAdmit admits an unseen run on its first action (never a tombstone).
	AutoAdmit bool
	// Budget is the budget the policy gives a run the guard admits
	// (AutoAdmit); nil admits it without one.
	Budget func(run string) state.Budget
	// Tokens verifies run tokens in the URLs' credential segment; with
	// RequireToken, a URL without a token that verifies (and names its
	// run) is refused, on the /json endpoints and the websocket upgrade
	// alike, as the egress proxy refuses a request without one.
	Tokens       *runtoken.Signer
	RequireToken bool
	// MaxMessage bounds a client frame (DefaultMaxMessage when zero);
	// larger ones get a CDP error and are never forwarded.
	MaxMessage int64
	// Uploads is the directory whose RUN subdirectory run RUN's pages may
	// be given files from (DOM.setFileInputFiles, dropped files); empty:
	// no files at all. The launcher's Sandbox.Uploads.
	Uploads string
	// StoreTimeout bounds the read at connect (state.DefaultTimeout when zero).
	StoreTimeout time.Duration
	// Telemetry receives every action's decision and counts the open CDP
	// connections; nil counts privately and logs nothing.
	Telemetry *telemetry.Telemetry
	Logger    *slog.Logger
}

// Guard is the CDP proxy; it is an http.Handler.
type Guard struct {
	cfg Config
	log *slog.Logger
	mux *http.ServeMux

	mu       sync.Mutex
	sessions map[string]map[*session]struct{}
	closed   bool
	open     sync.WaitGroup
}

// New builds a guard from cfg.
func New(cfg Config) (*Guard, error) {
	if cfg.Store == nil || cfg.Ledger == nil || cfg.Watcher == nil || cfg.Browsers == nil {
		return nil, errors.New("browserguard: a store, a ledger, a run watcher and a browser lookup are required")
	}
	if cfg.RequireToken && cfg.Tokens == nil {
		return nil, errors.New("browserguard: run tokens are required but there is no run-token secret to verify them")
	}
	if cfg.MaxMessage <= 0 {
		cfg.MaxMessage = DefaultMaxMessage
	}
	if cfg.StoreTimeout <= 0 {
		cfg.StoreTimeout = state.DefaultTimeout
	}
	if cfg.Telemetry == nil {
		cfg.Telemetry = telemetry.New(telemetry.Options{})
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	g := &Guard{
		cfg: cfg, log: cfg.Logger, mux: http.NewServeMux(),
		sessions: map[string]map[*session]struct{}{},
	}
	const prefix = "GET /run/{run}/{cred}"
	for _, p := range []string{"/json/version", "/json/version/{$}"} {
		g.mux.HandleFunc(prefix+p, g.jsonVersion)
	}
	for _, p := range []string{"/json", "/json/{$}", "/json/list", "/json/list/{$}"} {
		g.mux.HandleFunc(prefix+p, g.jsonList)
	}
	g.mux.HandleFunc(prefix+"/devtools/browser/{id}", g.serveCDP("browser"))
	g.mux.HandleFunc(prefix+"/devtools/page/{id}", g.serveCDP("page"))
	g.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		refusal.New(refusal.NotFound,
			"no endpoint %s %s: this is stopgate's browser guard; connect to ws://HOST/run/RUN/CREDENTIAL/devtools/browser/ID "+
				"(stopgate browser --run RUN prints it; CREDENTIAL is the cancel_version or the run's token) or GET /run/RUN/CREDENTIAL/json/version; /json/new is not served, "+
				"open pages with Target.createTarget, which is guarded", r.Method, r.URL.Path).WriteHTTP(w)
	})
	cfg.Watcher.Add(g)
	return g, nil
}

// ServeHTTP refuses a Host that is not an IP address or localhost, as
// Chromium's own DevTools endpoint does: a web page that rebinds its name
// to 127.0.0.1 must not drive the browser through the guard.
func (g *Guard) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !localHost(r.Host) {
		refusal.New(refusal.HostNotAllowed, "Host %q: the browser guard answers only to an IP address or localhost", r.Host).WriteHTTP(w)
		return
	}
	g.mux.ServeHTTP(w, r)
}

func localHost(hostport string) bool {
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		host = hostport
	}
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	return strings.EqualFold(host, "localhost") || net.ParseIP(host) != nil
}

// credential is who a request to the guard says it is: a run, the
// cancel_version it observed, and the segment that said so (the version,
// or a run token, which the URLs the guard hands out keep).
type credential struct {
	run     string
	version int64
	segment string
	// expires is the token's end; zero for a bare version.
	expires time.Time
}

// credentialOf reads and checks the run and its credential in the path:
// a refusal when the run or the version cannot be read (400), or when a
// token does not verify, names another run, or is missing where tokens
// are required (401).
func (g *Guard) credentialOf(r *http.Request) (credential, *refusal.Refusal) {
	run, seg := r.PathValue("run"), r.PathValue("cred")
	if err := state.ValidateRunID(run); err != nil {
		return credential{}, refusal.Wrap(err, refusal.BadRunIdentity, "%v", err)
	}
	if runtoken.IsToken(seg) {
		if g.cfg.Tokens == nil {
			return credential{}, refusal.New(refusal.Unauthorized, "this browser guard has no run-token secret: put the cancel_version in the URL instead of a token")
		}
		c, err := g.cfg.Tokens.Verify(seg, time.Now())
		if err != nil {
			return credential{}, refusal.Wrap(err, refusal.Unauthorized, "the run token in the URL was refused: %v", err)
		}
		if c.RunID != run {
			return credential{}, refusal.New(refusal.Unauthorized, "the run token in the URL is for run %s, not %s", c.RunID, run)
		}
		return credential{run: run, version: c.Version, segment: seg, expires: c.Expires}, nil
	}
	v, err := strconv.ParseInt(seg, 10, 64)
	if err != nil || v < 0 {
		return credential{}, refusal.New(refusal.BadRunIdentity, "%v", fmt.Errorf("%w: %q in the path: want the cancel_version observed (1 or more), 0 to check ACTIVE alone, or a run token",
			state.ErrInvalid, state.Clip(seg, 64)))
	}
	if g.cfg.RequireToken {
		return credential{}, refusal.New(refusal.Unauthorized,
			"this stopgate requires a run token: connect to ws://HOST/run/%s/TOKEN/devtools/browser/ID, the URL stopgate browser --run %s prints", run, run)
	}
	return credential{run: run, version: v, segment: seg}, nil
}

// guardedPrefix is the path prefix of a run's guarded endpoints; cred is
// the cancel_version or a run token.
func guardedPrefix(run, cred string) string {
	return "/run/" + run + "/" + cred
}

// browserFor answers the errors common to the /json endpoints: a bad
// path or credential, no browser for the run.
func (g *Guard) browserFor(w http.ResponseWriter, r *http.Request) (credential, *DevTools, bool) {
	cred, rf := g.credentialOf(r)
	if rf != nil {
		rf.WriteHTTP(w)
		return credential{}, nil, false
	}
	d, ok := g.cfg.Browsers(cred.run)
	if !ok {
		noBrowser(cred.run).WriteHTTP(w)
		return credential{}, nil, false
	}
	return cred, d, true
}

// askBrowser makes one of the guard's own calls to the browser behind a
// /json endpoint, bounded by browserFetchTimeout; a browser that does not
// answer is refused as unreachable, naming the method it left unanswered.
func askBrowser[T any](w http.ResponseWriter, r *http.Request, method string, call func(context.Context) (T, error)) (T, bool) {
	ctx, cancel := context.WithTimeout(r.Context(), browserFetchTimeout)
	defer cancel()
	v, err := call(ctx)
	if err != nil {
		refusal.Wrap(err, refusal.BrowserUnreachable, "the browser did not answer %s: %v", method, err).WriteHTTP(w)
		return v, false
	}
	return v, true
}

func noBrowser(run string) *refusal.Refusal {
	return refusal.New(refusal.NoBrowser, "no browser is running for run %s: start one with stopgate browser --run %s (POST /v1/runs/%s/browsers)", run, run, run)
}

// jsonVersion answers /json/version as Chromium would, with the websocket
// URL of the guard, for clients that discover the browser from an HTTP
// endpoint (Playwright's connectOverCDP).
func (g *Guard) jsonVersion(w http.ResponseWriter, r *http.Request) {
	cred, d, ok := g.browserFor(w, r)
	if !ok {
		return
	}
	v, ok := askBrowser(w, r, "Browser.getVersion", d.version)
	if !ok {
		return
	}
	refusal.WriteJSON(w, http.StatusOK, map[string]string{
		"Browser":              v.Product,
		"Protocol-Version":     v.ProtocolVersion,
		"User-Agent":           v.UserAgent,
		"V8-Version":           v.JsVersion,
		"WebKit-Version":       v.Revision,
		"webSocketDebuggerUrl": guardedWS(r.Host, cred, "/devtools/browser/"+d.BrowserID()),
	})
}

// jsonList answers /json/list as Chromium would, with guarded websocket
// URLs, for clients that connect to page endpoints. There is no DevTools
// frontend to point at: the browser serves none.
func (g *Guard) jsonList(w http.ResponseWriter, r *http.Request) {
	cred, d, ok := g.browserFor(w, r)
	if !ok {
		return
	}
	infos, ok := askBrowser(w, r, "Target.getTargets", d.targets)
	if !ok {
		return
	}
	list := []map[string]string{}
	for _, t := range infos {
		switch t.Type {
		case "browser", "browser_ui", "tab":
			// Not what Chromium lists either.
			continue
		}
		list = append(list, map[string]string{
			"description": "", "id": string(t.TargetID), "title": t.Title, "type": t.Type, "url": t.URL,
			"webSocketDebuggerUrl": guardedWS(r.Host, cred, "/devtools/page/"+string(t.TargetID)),
		})
	}
	refusal.WriteJSON(w, http.StatusOK, list)
}

// guardedWS is a websocket URL of the guard on the host the client used,
// with the credential the client used.
func guardedWS(host string, cred credential, path string) string {
	return (&url.URL{Scheme: "ws", Host: host, Path: guardedPrefix(cred.run, cred.segment) + path}).String()
}

// serveCDP serves /devtools/{kind}/{id}: it checks the run, opens the
// connection's session on the browser's pipe, then carries frames both
// ways until either side goes, the browser stops, or the guard closes.
func (g *Guard) serveCDP(kind string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		cred, rf := g.credentialOf(r)
		if rf != nil {
			rf.WriteHTTP(w)
			return
		}
		run, version := cred.run, cred.version
		// Connecting is not an effect, so a run nobody admitted yet may
		// connect (its first action admits it, or is refused), and so may
		// a run that is over while its browser lingers: to look, since
		// its actions are refused.
		ctx, cancel := context.WithTimeout(r.Context(), g.cfg.StoreTimeout)
		row, err := g.cfg.Store.Get(ctx, run)
		cancel()
		if err != nil && !errors.Is(err, state.ErrNotFound) {
			refusal.FromError(err).WriteHTTP(w)
			return
		}
		isOver := err == nil && row.Over()
		d, ok := g.cfg.Browsers(run)
		switch {
		case !ok && isOver:
			refusal.Over(row, "connection refused, its browser was stopped").WriteHTTP(w)
			return
		case !ok:
			noBrowser(run).WriteHTTP(w)
			return
		}
		id := r.PathValue("id")
		targetID := ""
		if kind == "page" {
			targetID = id
		} else if id != d.BrowserID() {
			refusal.New(refusal.NoBrowser, "the browser of run %s is /devtools/browser/%s, not %s (stopgate browser --run %s prints its URL)",
				run, d.BrowserID(), id, run).WriteHTTP(w)
			return
		}
		actx, cancel := context.WithTimeout(r.Context(), browserFetchTimeout)
		att, err := d.attach(actx, targetID)
		cancel()
		if err != nil {
			if kind == "page" && !errors.Is(err, errDevToolsClosed) {
				refusal.Wrap(err, refusal.NotFound, "no page %s in the browser of run %s: %v", id, run, err).WriteHTTP(w)
				return
			}
			refusal.Wrap(err, refusal.BrowserUnreachable, "the browser of run %s: %v", run, err).WriteHTTP(w)
			return
		}
		detach := func() {
			dctx, cancel := context.WithTimeout(context.Background(), browserFetchTimeout)
			att.detach(dctx)
			cancel()
		}
		// Accept checks Origin against Host: a web page cannot open a CDP
		// connection to the guard (CDP clients send no Origin).
		client, err := websocket.Accept(w, r, nil)
		if err != nil {
			detach()
			g.log.Debug("websocket upgrade refused", "run", run, "err", err)
			return
		}
		// Frames past MaxMessage are read to their end, answered, and
		// dropped; past four times that, the connection is closed (1009).
		client.SetReadLimit(4 * g.cfg.MaxMessage)

		s := newSession(g, run, version, client, att)
		s.expires = cred.expires
		if !g.add(s) {
			_ = client.Close(websocket.StatusGoingAway, "stopgate is shutting down")
			detach()
			return
		}
		defer g.remove(s)
		if isOver {
			s.noteOver(refusal.Over(row, "browser closed"))
			g.log.Info("CDP connection open for reads: the run is over, its actions are refused", "run", run, "status", row.Status, "endpoint", kind)
		} else {
			g.log.Info("CDP connection open", "run", run, "observed_version", version, "endpoint", kind)
		}
		s.serve()
	}
}

func (g *Guard) add(s *session) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return false
	}
	if g.sessions[s.run] == nil {
		g.sessions[s.run] = map[*session]struct{}{}
	}
	g.sessions[s.run][s] = struct{}{}
	g.open.Add(1)
	g.cfg.Telemetry.Metrics().Open.WithLabelValues("cdp").Inc()
	return true
}

func (g *Guard) remove(s *session) {
	g.mu.Lock()
	delete(g.sessions[s.run], s)
	if len(g.sessions[s.run]) == 0 {
		delete(g.sessions, s.run)
	}
	g.mu.Unlock()
	g.open.Done()
	g.cfg.Telemetry.Metrics().Open.WithLabelValues("cdp").Dec()
}

// Holds reports whether run has CDP connections open: the guard is a
// runwatch.Holder.
func (g *Guard) Holds(run string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.sessions[run]) > 0
}

// Runs lists the runs with CDP connections open.
func (g *Guard) Runs() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Collect(maps.Keys(g.sessions))
}

func (g *Guard) of(run string) []*session {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Collect(maps.Keys(g.sessions[run]))
}

// Connections is the number of CDP connections open now.
func (g *Guard) Connections() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	n := 0
	for _, set := range g.sessions {
		n += len(set)
	}
	return n
}

// Enforce takes a run's new row to its connections: once the run is over,
// each will be closed with the refusal as its reason, whatever closes it.
// While a run is CANCELLING, and after it is over while its browser
// lingers, its connections stay open for reads; its actions are refused by
// the guard one by one. The launcher stops the browser of a run that is
// over, which closes them.
func (g *Guard) Enforce(row state.Run) {
	if !row.Over() {
		return
	}
	for _, s := range g.of(row.ID) {
		s.noteOver(refusal.Over(row, "browser closed"))
	}
}

// Close closes every CDP connection and refuses new ones, then waits
// (until ctx ends) for their unanswered actions to be recorded UNKNOWN.
func (g *Guard) Close(ctx context.Context) error {
	g.mu.Lock()
	g.closed = true
	var all []*session
	for _, set := range g.sessions {
		for s := range set {
			all = append(all, s)
		}
	}
	g.mu.Unlock()
	for _, s := range all {
		s.end(websocket.StatusGoingAway, "stopgate is shutting down")
	}
	done := make(chan struct{})
	go func() { g.open.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("browser guard: %d CDP connections still closing: %w", g.Connections(), ctx.Err())
	}
}
