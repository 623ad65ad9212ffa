// Package control is the control plane's HTTP JSON API over a state.Store:
// admit, cancel and complete runs; guard the boundaries that do not travel
// through the egress proxy (queue claims, retries, any other effect) and
// record their outcomes; reconcile UNKNOWN intents (by an operator, or by a
// provider's signed webhook); and read rows, intents and the audit log. It
// owns the wire format (the types in api.go, the status codes, the
// error bodies) and the checks at the edge: who the caller is (auth.go:
// operator, worker of one run, read-only), what that lets it do, the actor
// the audit log records, body size and shape. It streams a run's row to
// the workers that watch it (watch.go), and serves the operator console, the
// same acts for people (console.go).
//
// It never dispatches an effect, never cuts a connection and never moves a
// run on by itself (moving runs on is the sweeper's job): every transition is
// one call of the store, which does the atomic step.
package control

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"runtime/debug"
	"slices"
	"strings"
	"time"

	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/runwatch"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/telemetry"
)

// Defaults for Options left zero.
const (
	// ReadyTimeout bounds the store ping behind /readyz.
	ReadyTimeout = time.Second
	// MaxBodyBytes bounds every request body.
	MaxBodyBytes = 1 << 20
	// MaxActorLen bounds the X-Stopgate-Actor header.
	MaxActorLen = 128
)

// ActorHeader is the name an operator gives itself within the operator
// scope (the CLI sends cli:$USER); the audit log records it beside what the
// token proves: "operator (cli:alice)". A worker's or a reader's is ignored.
const ActorHeader = "X-Stopgate-Actor"

// Options configure a Handler.
type Options struct {
	Store state.Store
	// Token is the operator's bearer token. Every request but /healthz,
	// /readyz, /metrics and /v1/ca must carry a token; New refuses to
	// build a handler without this one unless Open is set.
	Token string
	// ReadToken, when set, is a bearer token of the read-only scope.
	ReadToken string
	// Open serves the API to callers without a credential, as an
	// anonymous operator. Credentials that are presented are still checked
	// and scoped. Only for a listener nobody else can reach.
	Open bool
	// DrainTimeout is the drain of a cancel that names none. Zero means
	// none: in-flight work is cut at the sweeper's next pass. The server
	// passes its --drain-timeout (30s by default).
	DrainTimeout time.Duration
	// StoreTimeout bounds each request's store calls; zero means
	// state.DefaultTimeout, as on every other edge. A store slower than
	// this answers 503.
	StoreTimeout time.Duration
	// Logger receives panics, store failures and, at debug level, every
	// request. Nil discards.
	Logger *slog.Logger
	// Telemetry receives the decision of every boundary this API guards
	// (claims, retries, intents) and of every outcome reported; nil counts
	// privately and logs nothing.
	Telemetry *telemetry.Telemetry
	// CACertPEM is the egress proxy's MITM CA certificate, served at
	// /v1/ca for workers to trust; nil answers 404.
	CACertPEM []byte
	// Metrics, if set, serves /metrics (Prometheus); open like the probes.
	Metrics http.Handler
	// WebhookSecret returns the HMAC secret of a webhook source that may
	// resolve UNKNOWN intents; nil means no webhook source is configured.
	WebhookSecret func(source string) ([]byte, bool)
	// Browsers launches a guarded browser for a run (POST
	// /v1/runs/{run}/browsers); nil answers 503 browser_unavailable.
	Browsers BrowserLauncher
	// Tokens signs run tokens at POST /v1/runs/{run}/tokens (nil answers
	// 404), and verifies them as the bearer tokens of workers, each bound
	// to the run its token names.
	Tokens *runtoken.Signer
	// Endpoints is served at GET /v1/endpoints.
	Endpoints Endpoints
	// Transparent makes the bindings of /v1/transparent/bindings; nil
	// answers 404 transparent_off.
	Transparent TransparentBinder
	// Watcher is the process's watch on runs: GET /v1/runs/{run}/watch
	// holds its runs in it (watch.go); nil answers that path 404.
	Watcher *runwatch.Watcher
	// Watch bounds the watches; zero fields take the defaults.
	Watch WatchOptions
	// ReloadPolicy serves POST /v1/policy/reload; nil answers 404.
	ReloadPolicy PolicyReloader
	// Budgets is the budget the policy in force gives a run admitted with
	// those labels and given that budget (policy.Budgets.Admitted, with
	// the server's drain); nil admits runs with the budget given alone.
	Budgets func(runID string, labels map[string]string, given state.Budget) state.Budget
}

// Handler serves the API. Create it with New.
type Handler struct {
	store        state.Store
	caPEM        []byte
	webhook      func(source string) ([]byte, bool)
	browsers     BrowserLauncher
	tokens       *runtoken.Signer
	endpointInfo Endpoints
	transparent  TransparentBinder
	watches      *watches
	reload       PolicyReloader
	budgets      func(runID string, labels map[string]string, given state.Budget) state.Budget
	creds        credentials
	drain        time.Duration
	storeTimeout time.Duration
	log          *slog.Logger
	tel          *telemetry.Telemetry
	metrics      http.Handler
	mux          *http.ServeMux
	console      console
}

// New returns the API handler over opts.Store.
func New(opts Options) (*Handler, error) {
	if opts.Store == nil {
		return nil, errors.New("control: no store")
	}
	if err := state.CheckDrainTimeout(opts.DrainTimeout); err != nil {
		return nil, fmt.Errorf("control: %w", err)
	}
	creds, err := newCredentials(opts)
	if err != nil {
		return nil, err
	}
	h := &Handler{
		store:        opts.Store,
		caPEM:        opts.CACertPEM,
		webhook:      opts.WebhookSecret,
		browsers:     opts.Browsers,
		tokens:       opts.Tokens,
		endpointInfo: opts.Endpoints,
		transparent:  opts.Transparent,
		watches:      newWatches(opts.Watcher, opts.Watch),
		reload:       opts.ReloadPolicy,
		budgets:      opts.Budgets,
		creds:        creds,
		drain:        opts.DrainTimeout,
		storeTimeout: opts.StoreTimeout,
		log:          opts.Logger,
		tel:          opts.Telemetry,
		metrics:      opts.Metrics,
		mux:          http.NewServeMux(),
	}
	if h.storeTimeout <= 0 {
		h.storeTimeout = state.DefaultTimeout
	}
	if h.log == nil {
		h.log = slog.New(slog.DiscardHandler)
	}
	if h.tel == nil {
		h.tel = telemetry.New(telemetry.Options{})
	}
	h.routes()
	if err := h.newConsole(opts.Token); err != nil {
		return nil, err
	}
	return h, nil
}

// apiFunc handles one endpoint: it returns the status and body of a
// success, or an error that writeError turns into the JSON error body.
type apiFunc func(r *http.Request, actor string) (int, any, error)

// route is one endpoint: what it needs of the caller (access), and what
// a refusal calls the act (what).
type route struct {
	method, path string
	access       access
	what         string
	fn           apiFunc
}

func (h *Handler) routes() {
	h.mux.HandleFunc("GET /healthz", h.healthz)
	h.mux.HandleFunc("GET /readyz", h.readyz)
	h.mux.HandleFunc("GET /v1/ca", h.ca)
	if h.metrics != nil {
		h.mux.Handle("GET /metrics", h.metrics)
	}
	routes := []route{
		{http.MethodPost, "/v1/runs", accessOperate, "admit runs", h.admit},
		{http.MethodGet, "/v1/runs", accessRead, "list runs", h.list},
		{http.MethodGet, "/v1/runs/{run}", accessRead, "read the row", h.get},
		{http.MethodPost, "/v1/runs/{run}/cancel", accessOperate, "cancel runs", h.cancel},
		{http.MethodPost, "/v1/runs/{run}/complete", accessOperate, "complete runs", h.complete},
		{http.MethodGet, "/v1/runs/{run}/events", accessRead, "read the events", h.events},
		{http.MethodGet, "/v1/runs/{run}/intents", accessRead, "read the intents", h.intents},
		{http.MethodGet, "/v1/runs/{run}/audit", accessRead, "read the audit", h.audit},
		{http.MethodPost, "/v1/runs/{run}/claims", accessWork, "claim steps", h.claim},
		{http.MethodPost, "/v1/runs/{run}/retries", accessWork, "schedule retries", h.retry},
		{http.MethodPost, "/v1/runs/{run}/retries/{step}/{attempt}/dispatch", accessWork, "dispatch retries", h.dispatchRetry},
		{http.MethodPost, "/v1/runs/{run}/intents", accessWork, "guard effects", h.beginIntent},
		{http.MethodGet, "/v1/runs/{run}/intents/{key}", accessRead, "read intents", h.getIntent},
		{http.MethodPatch, "/v1/runs/{run}/intents/{key}", accessWork, "report outcomes", h.finishIntent},
		{http.MethodPost, "/v1/runs/{run}/intents/{key}/renew", accessWork, "renew leases", h.renewIntent},
		{http.MethodPost, "/v1/runs/{run}/intents/{key}/notes", accessWork, "note effects", h.noteIntent},
		{http.MethodPost, "/v1/runs/{run}/tokens", accessOperate, "mint run tokens", h.issueToken},
		{http.MethodPost, resolvePath, accessResolve, "resolve UNKNOWN intents", h.resolve},
		{http.MethodPost, "/v1/runs/{run}/browsers", accessWork, "launch browsers", h.launchBrowser},
		{http.MethodGet, "/v1/endpoints", accessRead, "read where to send an agent", h.endpoints},
		{http.MethodPost, "/v1/transparent/bindings", accessOperate, "bind a uid to a run", h.bind},
		{http.MethodPost, "/v1/transparent/bindings/{id}/renew", accessOperate, "renew a binding", h.renewBinding},
		{http.MethodDelete, "/v1/transparent/bindings/{id}", accessOperate, "remove a binding", h.unbind},
		{http.MethodPost, "/v1/policy/reload", accessOperate, "reload the policy", h.reloadPolicy},
		{http.MethodPost, AcknowledgeResetPath, accessOperate, "acknowledge a store reset", h.acknowledgeReset},
	}
	allowed := map[string][]string{}
	for _, rt := range routes {
		h.mux.Handle(rt.method+" "+rt.path, h.api(rt))
		allowed[rt.path] = append(allowed[rt.path], rt.method)
	}
	// The watch is a stream, not one JSON answer: a handler of its own
	// behind the same check of the caller.
	h.mux.Handle("GET "+watchPath, h.scoped(accessRead, "watch the run", h.watch))
	allowed[watchPath] = []string{http.MethodGet}
	allowed["/healthz"] = []string{http.MethodGet}
	allowed["/readyz"] = []string{http.MethodGet}
	// A pattern without a method is less specific than the same path with
	// one, so these catch only the wrong methods, and answer them in JSON
	// rather than with the mux's plain-text 405.
	for path, methods := range allowed {
		if slices.Contains(methods, http.MethodGet) {
			methods = append(methods, http.MethodHead)
		}
		slices.Sort(methods)
		allow := strings.Join(methods, ", ")
		h.mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Allow", allow)
			h.writeError(w, r, refusal.New(refusal.MethodNotAllowed, "%s is not allowed on %s; use %s", r.Method, path, allow))
		})
	}
	h.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		h.writeError(w, r, refusal.New(refusal.NotFound, "no endpoint %s", r.URL.Path))
	})
}

// ServeHTTP recovers from panics, says who the caller is (a request
// without a valid credential goes no further than a 401), then routes.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	rw := &responseWriter{ResponseWriter: w}
	defer func() {
		if p := recover(); p != nil {
			if p == http.ErrAbortHandler {
				panic(p) // the server's own way to abort a response
			}
			h.log.Error("control: panic serving request", "method", r.Method, "path", r.URL.Path, "panic", p, "stack", string(debug.Stack()))
			if !rw.wrote {
				h.writeError(rw, r, refusal.New(refusal.Internal, "internal error; the server log has the details"))
			}
		}
		h.log.Debug("control: request", "method", r.Method, "path", r.URL.Path, "status", rw.status, "duration", time.Since(start))
	}()
	if err := crossSite(r); err != nil {
		h.log.Info("control: cross-site request refused", "method", r.Method, "path", r.URL.Path, "origin", r.Header.Get("Origin"), "remote", r.RemoteAddr)
		if consolePath(r.URL.Path) {
			h.render(rw, r, http.StatusForbidden, view{Page: "error", Title: "Forbidden", Anonymous: true, Error: errText(err, "")})
			return
		}
		h.writeError(rw, r, err)
		return
	}
	if openPath(r.URL.Path) {
		h.mux.ServeHTTP(rw, r)
		return
	}
	if consolePath(r.URL.Path) {
		h.console.mux.ServeHTTP(rw, r)
		return
	}
	var p Principal
	var err error
	if h.signedWebhook(r) {
		// A provider's webhook holds no token: its signature stands in
		// for one on the resolve route alone, and resolve verifies it.
		p = Principal{Scope: scopeWebhook}
	} else if p, err = h.authenticate(r); err != nil {
		rw.Header().Set("WWW-Authenticate", `Bearer realm="stopgate"`)
		h.log.Debug("control: unauthenticated request", "method", r.Method, "path", r.URL.Path, "remote", r.RemoteAddr, "err", err)
		h.writeError(rw, r, err)
		return
	}
	h.mux.ServeHTTP(rw, withPrincipal(r, p))
}

// api adapts an endpoint: scoped, with its store calls bounded and its
// answer written.
func (h *Handler) api(rt route) http.Handler {
	return h.scoped(rt.access, rt.what, func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), h.storeTimeout)
		defer cancel()
		status, body, err := rt.fn(r.WithContext(ctx), principalOf(r).Actor())
		if err != nil {
			h.writeError(w, r, err)
			return
		}
		refusal.WriteJSON(w, status, body)
	})
}

// scoped checks that the caller's scope allows the act (on the run of the
// path) and names the actor, then hands the request on.
func (h *Handler) scoped(a access, what string, next http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p := principalOf(r)
		if err := p.allow(a, r.PathValue("run"), what); err != nil {
			h.log.Info("control: forbidden", "method", r.Method, "path", r.URL.Path, "actor", p.Actor(), "remote", r.RemoteAddr)
			h.writeError(w, r, err)
			return
		}
		claimed, err := claimedName(r)
		if err != nil {
			h.writeError(w, r, err)
			return
		}
		if p.Scope == ScopeOperator {
			// Within the operator scope the caller may say who it is;
			// a worker or a reader is its token, nothing else.
			p.Claimed = claimed
			r = withPrincipal(r, p)
		}
		next(w, r)
	})
}

// claimedName reads X-Stopgate-Actor: empty when absent, refused when
// malformed (whoever sends it).
func claimedName(r *http.Request) (string, error) {
	vals := r.Header.Values(ActorHeader)
	if len(vals) == 0 {
		return "", nil
	}
	if len(vals) > 1 {
		return "", refusal.New(refusal.InvalidRequest, "%s", ActorHeader+" is given more than once")
	}
	a := vals[0]
	if a == "" || len(a) > MaxActorLen {
		return "", refusal.New(refusal.InvalidRequest, "%s must be 1 to %d characters, got %d", ActorHeader, MaxActorLen, len(a))
	}
	for i := 0; i < len(a); i++ {
		if a[i] < 0x20 || a[i] > 0x7e {
			return "", refusal.New(refusal.InvalidRequest, "%s has a byte outside printable ASCII at offset %d", ActorHeader, i)
		}
	}
	return a, nil
}

// crossSite refuses a request that a page of another site made a browser
// send, unless it only reads: no form or script elsewhere may stop a run
// through an operator's browser (a control plane served open has no
// credential that would stop it). Browsers say where a request comes from
// (Sec-Fetch-Site, Origin); programs send neither and are not concerned.
func crossSite(r *http.Request) error {
	switch r.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions:
		return nil
	}
	// Sec-Fetch-Site is the browser's own word, and it is sent even where
	// a referrer policy makes the Origin "null"; Origin is for browsers
	// older than it.
	switch site := r.Header.Get("Sec-Fetch-Site"); site {
	case "same-origin", "none":
		return nil
	case "":
	default:
		return refusal.New(refusal.Forbidden, "a page of another site may not send this request (Sec-Fetch-Site: %.40q)", site)
	}
	if origin := r.Header.Get("Origin"); origin != "" {
		u, err := url.Parse(origin)
		if err != nil || u.Host != r.Host {
			return refusal.New(refusal.Forbidden, "a page of another origin may not send this request (Origin: %.100q)", origin)
		}
	}
	return nil
}

// openPaths need no token: probes, the scraper, and the CA certificate,
// which is public by nature (workers must be able to fetch it).
func openPath(path string) bool {
	switch path {
	case "/healthz", "/readyz", "/metrics", "/v1/ca":
		return true
	}
	return false
}

// ca serves the MITM CA certificate workers must trust.
func (h *Handler) ca(w http.ResponseWriter, r *http.Request) {
	if len(h.caPEM) == 0 {
		h.writeError(w, r, refusal.New(refusal.NotFound, "this stopgate has no MITM CA (no egress proxy is configured)"))
		return
	}
	w.Header().Set("Content-Type", "application/x-pem-file")
	_, _ = w.Write(h.caPEM)
}

func (h *Handler) healthz(w http.ResponseWriter, r *http.Request) {
	refusal.WriteJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

func (h *Handler) readyz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), ReadyTimeout)
	defer cancel()
	if err := h.store.Ping(ctx); err != nil {
		h.writeError(w, r, refusal.New(refusal.StoreUnavailable, "store did not answer a ping within %s: %v", ReadyTimeout, err))
		return
	}
	refusal.WriteJSON(w, http.StatusOK, map[string]string{"status": "ready"})
}

// responseWriter remembers whether the header was written, so that a panic
// after the first byte does not try to write a second status, and the
// status for the request log.
type responseWriter struct {
	http.ResponseWriter
	wrote  bool
	status int
}

func (w *responseWriter) WriteHeader(code int) {
	if !w.wrote {
		w.wrote, w.status = true, code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *responseWriter) Write(b []byte) (int, error) {
	if !w.wrote {
		w.wrote, w.status = true, http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach the connection.
func (w *responseWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
