// Package browserguard is the browser boundary: a Chrome DevTools Protocol
// (CDP) proxy that agents connect to as if it were the browser, and a
// launcher that starts a headless Chromium for a run with its network bound
// to the egress proxy under that run.
//
// It owns the CDP connections and the launched browsers: every action
// command (navigation, input, script, uploads, new targets, released
// requests; see isAction) passes the one atomic guard through the intents
// ledger before a byte of it reaches the browser, and is recorded with its
// outcome; after a cancel the run's actions get a CDP error naming the
// run's state, and once the run is over its connections are closed and its
// browser is killed.
//
// It never forwards an action the guard did not admit, and never forwards
// a frame it cannot read the way the browser will (bad JSON, binary, too
// large, ambiguous members): those get a CDP error. When the store does not
// answer, actions fail closed. It never decides a run's state and never
// carries the browser's own network traffic: that is the egress proxy's.
package browserguard

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/coder/websocket"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/runwatch"
	"github.com/stopgate/stopgate/state"
)

// Defaults for Config fields left zero.
const (
	// DefaultMaxMessage bounds a client frame. CDP commands are small; the
	// largest real ones (setDocumentContent, a file list, a long script)
	// stay far below it.
	DefaultMaxMessage = 16 << 20
	// maxBrowserMessage bounds a browser frame: screenshots, PDFs and whole
	// DOMs come this way and may be large. Past it the connection closes.
	maxBrowserMessage = 512 << 20
	// browserFetchTimeout bounds reading /json/version from the browser and
	// dialling its websocket.
	browserFetchTimeout = 5 * time.Second
	// maxBrowserJSON bounds the /json/* answers read from the browser.
	maxBrowserJSON = 4 << 20
)

// Config wires a Guard.
type Config struct {
	// Store is read when a client connects: a run that is over gets
	// nothing to connect to.
	Store  state.Store
	Ledger *intents.Ledger
	// Watcher carries the rows of runs with open connections to the
	// guard, which closes them once the run is over.
	Watcher *runwatch.Watcher
	// Browsers finds the DevTools address (host:port) of the browser that
	// serves a run: Launcher.DevTools.
	Browsers func(run string) (addr string, ok bool)
	// AutoAdmit admits an unseen run on its first action (never a tombstone).
	AutoAdmit bool
	// MaxMessage bounds a client frame (DefaultMaxMessage when zero);
	// larger ones get a CDP error and are never forwarded.
	MaxMessage int64
	// StoreTimeout bounds the read at connect (state.DefaultTimeout when zero).
	StoreTimeout time.Duration
	Logger       *slog.Logger
}

// Guard is the CDP proxy; it is an http.Handler.
type Guard struct {
	cfg Config
	log *slog.Logger
	mux *http.ServeMux
	// hc reaches the browser's DevTools endpoint directly: no proxy from
	// the environment (a sidecar may inherit its worker's HTTP_PROXY).
	hc *http.Client

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
	if cfg.MaxMessage <= 0 {
		cfg.MaxMessage = DefaultMaxMessage
	}
	if cfg.StoreTimeout <= 0 {
		cfg.StoreTimeout = state.DefaultTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	g := &Guard{
		cfg: cfg, log: cfg.Logger, mux: http.NewServeMux(),
		hc:       &http.Client{Transport: &http.Transport{Proxy: nil, DisableCompression: true}, Timeout: browserFetchTimeout},
		sessions: map[string]map[*session]struct{}{},
	}
	const prefix = "GET /run/{run}/{version}"
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
			"no endpoint %s %s: this is stopgate's browser guard; connect to ws://HOST/run/RUN/VERSION/devtools/browser/ID "+
				"(stopgate browser --run RUN prints it) or GET /run/RUN/VERSION/json/version; /json/new is not served, "+
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

// runOf reads the run and the observed version from the path.
func runOf(r *http.Request) (string, int64, error) {
	run := r.PathValue("run")
	if err := state.ValidateRunID(run); err != nil {
		return "", 0, err
	}
	v, err := strconv.ParseInt(r.PathValue("version"), 10, 64)
	if err != nil || v < 0 {
		return "", 0, fmt.Errorf("%w: version %q in the path: want the cancel_version observed (1 or more), or 0 to check ACTIVE alone",
			state.ErrInvalid, r.PathValue("version"))
	}
	return run, v, nil
}

func guardedPrefix(run string, version int64) string {
	return "/run/" + run + "/" + strconv.FormatInt(version, 10)
}

// browserFor answers the errors common to every endpoint: a bad path, no
// browser for the run.
func (g *Guard) browserFor(w http.ResponseWriter, r *http.Request) (run string, version int64, addr string, ok bool) {
	run, version, err := runOf(r)
	if err != nil {
		refusal.Wrap(err, refusal.BadRunIdentity, "%v", err).WriteHTTP(w)
		return "", 0, "", false
	}
	addr, ok = g.cfg.Browsers(run)
	if !ok {
		refusal.New(refusal.NoBrowser, "no browser is running for run %s: start one with stopgate browser --run %s (POST /v1/runs/%s/browsers)",
			run, run, run).WriteHTTP(w)
		return "", 0, "", false
	}
	return run, version, addr, true
}

// jsonVersion serves the browser's /json/version with its websocket URL
// pointing at the guard, for clients that discover the browser from an
// HTTP endpoint (Playwright's and Puppeteer's connectOverCDP).
func (g *Guard) jsonVersion(w http.ResponseWriter, r *http.Request) {
	run, version, addr, ok := g.browserFor(w, r)
	if !ok {
		return
	}
	var doc map[string]any
	if err := g.browserJSON(r.Context(), addr, "/json/version", &doc); err != nil {
		refusal.Wrap(err, refusal.BrowserUnreachable, "%v", err).WriteHTTP(w)
		return
	}
	rewriteWS(doc, r.Host, guardedPrefix(run, version))
	writeJSON(w, http.StatusOK, doc)
}

// jsonList serves the browser's target list with guarded websocket URLs,
// for clients that connect to page endpoints. The DevTools frontend URLs
// point at the browser itself, around the guard, and are left out.
func (g *Guard) jsonList(w http.ResponseWriter, r *http.Request) {
	run, version, addr, ok := g.browserFor(w, r)
	if !ok {
		return
	}
	var list []map[string]any
	if err := g.browserJSON(r.Context(), addr, "/json/list", &list); err != nil {
		refusal.Wrap(err, refusal.BrowserUnreachable, "%v", err).WriteHTTP(w)
		return
	}
	for _, t := range list {
		rewriteWS(t, r.Host, guardedPrefix(run, version))
		for k := range t {
			if strings.HasPrefix(k, "devtoolsFrontendUrl") {
				delete(t, k)
			}
		}
	}
	writeJSON(w, http.StatusOK, list)
}

func (g *Guard) browserJSON(ctx context.Context, addr, path string, dst any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+path, nil)
	if err != nil {
		return fmt.Errorf("browser at %s: %w", addr, err)
	}
	resp, err := g.hc.Do(req)
	if err != nil {
		return fmt.Errorf("browser at %s did not answer %s: %w", addr, path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("browser at %s answered %s to %s", addr, resp.Status, path)
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, maxBrowserJSON)).Decode(dst); err != nil {
		return fmt.Errorf("browser at %s: reading %s: %w", addr, path, err)
	}
	return nil
}

// rewriteWS points a webSocketDebuggerUrl at the guard: the same path
// (/devtools/browser/ID), under the run's prefix, on the host the client
// used to reach the guard.
func rewriteWS(doc map[string]any, host, prefix string) {
	raw, ok := doc["webSocketDebuggerUrl"].(string)
	if !ok {
		return
	}
	u, err := url.Parse(raw)
	if err != nil {
		delete(doc, "webSocketDebuggerUrl")
		return
	}
	doc["webSocketDebuggerUrl"] = (&url.URL{Scheme: "ws", Host: host, Path: prefix + u.Path}).String()
}

// serveCDP serves /devtools/{kind}/{id}: it checks the run, dials the
// browser, then carries frames both ways until either side goes, the run
// is over, or the guard closes.
func (g *Guard) serveCDP(kind string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		run, version, addr, ok := g.browserFor(w, r)
		if !ok {
			return
		}
		// Connecting is not an effect, so a run nobody admitted yet may
		// connect (its first action admits it, or is refused). A run that
		// is over gets nothing to connect to.
		ctx, cancel := context.WithTimeout(r.Context(), g.cfg.StoreTimeout)
		row, err := g.cfg.Store.Get(ctx, run)
		cancel()
		switch {
		case errors.Is(err, state.ErrNotFound):
		case err != nil:
			refusal.FromError(err).WriteHTTP(w)
			return
		case row.Over():
			rf := refusal.New(refusal.RunNotActive, "run %s is %s at cancel_version %d: its browser connections are closed", run, row.Status, row.CancelVersion)
			rf.RunID, rf.Run, rf.ObservedVersion = run, &row, version
			rf.WriteHTTP(w)
			return
		}

		target := "ws://" + addr + "/devtools/" + kind + "/" + url.PathEscape(r.PathValue("id"))
		dctx, cancel := context.WithTimeout(r.Context(), browserFetchTimeout)
		browser, _, err := websocket.Dial(dctx, target, &websocket.DialOptions{HTTPClient: g.hc})
		cancel()
		if err != nil {
			refusal.Wrap(err, refusal.BrowserUnreachable, "browser DevTools at %s: %v", target, err).WriteHTTP(w)
			return
		}
		browser.SetReadLimit(maxBrowserMessage)
		// Accept checks Origin against Host: a web page cannot open a CDP
		// connection to the guard (CDP clients send no Origin).
		client, err := websocket.Accept(w, r, nil)
		if err != nil {
			_ = browser.CloseNow()
			g.log.Debug("websocket upgrade refused", "run", run, "err", err)
			return
		}
		// Frames past MaxMessage are read to their end, answered, and
		// dropped; past four times that, the connection is closed (1009).
		client.SetReadLimit(4 * g.cfg.MaxMessage)

		s := newSession(g, run, version, client, browser)
		if !g.add(s) {
			_ = client.Close(websocket.StatusGoingAway, "stopgate is shutting down")
			_ = browser.CloseNow()
			return
		}
		defer g.remove(s)
		g.log.Info("CDP connection open", "run", run, "observed_version", version, "endpoint", kind)
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
	ids := make([]string, 0, len(g.sessions))
	for id := range g.sessions {
		ids = append(ids, id)
	}
	return ids
}

func (g *Guard) of(run string) []*session {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]*session, 0, len(g.sessions[run]))
	for s := range g.sessions[run] {
		out = append(out, s)
	}
	return out
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

// Enforce closes the connections of a run that is over. While a run is
// CANCELLING its connections stay open, for reads; its actions are refused
// by the guard one by one.
func (g *Guard) Enforce(row state.Run) {
	if !row.Over() {
		return
	}
	for _, s := range g.of(row.ID) {
		g.log.Info("closing CDP connection: run is over", "run", row.ID, "status", row.Status, "cancel_version", row.CancelVersion)
		s.end(websocket.StatusPolicyViolation, fmt.Sprintf("stopgate: run %s is %s", row.ID, row.Status))
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

func writeJSON(w http.ResponseWriter, status int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(body)
}
