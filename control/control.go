// Package control is the control plane's HTTP JSON API over a state.Store:
// admit, cancel and complete runs; guard the boundaries that do not travel
// through the egress proxy (queue claims, retries, any other effect) and
// record their outcomes; reconcile UNKNOWN intents (by an operator, or by a
// provider's signed webhook); and read rows, intents and the audit log. It
// owns the wire format (the types in api.go, the status codes, the
// error bodies) and the checks at the edge: the bearer token, the actor
// header, body size and shape.
//
// It never dispatches an effect, never cuts a connection and never moves a
// run on by itself (moving runs on is the sweeper's job): every transition is
// one call of the store, which does the atomic step.
package control

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"runtime/debug"
	"slices"
	"strings"
	"time"

	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/state"
)

// Defaults for Options left zero.
const (
	DefaultStoreTimeout = 5 * time.Second
	// ReadyTimeout bounds the store ping behind /readyz.
	ReadyTimeout = time.Second
	// MaxBodyBytes bounds every request body.
	MaxBodyBytes = 1 << 20
	// MaxActorLen bounds the X-Stopgate-Actor header.
	MaxActorLen = 128
	// DefaultActor is recorded in the audit log when a request names none.
	DefaultActor = "api"
)

// ActorHeader names who is acting, for the audit log (the CLI sends cli:$USER).
const ActorHeader = "X-Stopgate-Actor"

// Options configure a Handler.
type Options struct {
	Store state.Store
	// Token, when set, is the bearer token every /v1 request must carry.
	// /healthz and /readyz stay open so that probes need no secret.
	Token string
	// DrainTimeout is the drain of a cancel that names none. Zero means
	// none: in-flight work is cut at the sweeper's next pass. The server
	// passes its --drain-timeout (30s by default).
	DrainTimeout time.Duration
	// StoreTimeout bounds each request's store calls; zero means
	// DefaultStoreTimeout. A store slower than this answers 503.
	StoreTimeout time.Duration
	// Logger receives panics, store failures and, at debug level, every
	// request. Nil discards.
	Logger *slog.Logger
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
	// Tokens signs run tokens at POST /v1/runs/{run}/tokens; nil answers 404.
	Tokens *runtoken.Signer
	// Endpoints is served at GET /v1/endpoints.
	Endpoints Endpoints
	// Transparent makes the bindings of /v1/transparent/bindings; nil
	// answers 404 transparent_off.
	Transparent TransparentBinder
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
	tokenSum     [sha256.Size]byte
	hasToken     bool
	drain        time.Duration
	storeTimeout time.Duration
	log          *slog.Logger
	metrics      http.Handler
	mux          *http.ServeMux
}

// New returns the API handler over opts.Store.
func New(opts Options) (*Handler, error) {
	if opts.Store == nil {
		return nil, errors.New("control: no store")
	}
	if opts.DrainTimeout < 0 {
		return nil, fmt.Errorf("control: drain timeout %s is negative", opts.DrainTimeout)
	}
	h := &Handler{
		store:        opts.Store,
		caPEM:        opts.CACertPEM,
		webhook:      opts.WebhookSecret,
		browsers:     opts.Browsers,
		tokens:       opts.Tokens,
		endpointInfo: opts.Endpoints,
		transparent:  opts.Transparent,
		drain:        opts.DrainTimeout,
		storeTimeout: opts.StoreTimeout,
		log:          opts.Logger,
		metrics:      opts.Metrics,
		mux:          http.NewServeMux(),
	}
	if h.storeTimeout <= 0 {
		h.storeTimeout = DefaultStoreTimeout
	}
	if h.log == nil {
		h.log = slog.New(slog.DiscardHandler)
	}
	if opts.Token != "" {
		// Compare digests so the comparison takes the same time whatever
		// the length of the token presented.
		h.tokenSum = sha256.Sum256([]byte(opts.Token))
		h.hasToken = true
	}
	h.routes()
	return h, nil
}

// apiFunc handles one endpoint: it returns the status and body of a
// success, or an error that writeError turns into the JSON error body.
type apiFunc func(r *http.Request, actor string) (int, any, error)

type route struct {
	method, path string
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
		{http.MethodPost, "/v1/runs", h.admit},
		{http.MethodGet, "/v1/runs", h.list},
		{http.MethodGet, "/v1/runs/{run}", h.get},
		{http.MethodPost, "/v1/runs/{run}/cancel", h.cancel},
		{http.MethodPost, "/v1/runs/{run}/complete", h.complete},
		{http.MethodGet, "/v1/runs/{run}/events", h.events},
		{http.MethodGet, "/v1/runs/{run}/intents", h.intents},
		{http.MethodGet, "/v1/runs/{run}/audit", h.audit},
		{http.MethodPost, "/v1/runs/{run}/claims", h.claim},
		{http.MethodPost, "/v1/runs/{run}/retries", h.retry},
		{http.MethodPost, "/v1/runs/{run}/retries/{step}/{attempt}/dispatch", h.dispatchRetry},
		{http.MethodPost, "/v1/runs/{run}/intents", h.beginIntent},
		{http.MethodGet, "/v1/runs/{run}/intents/{key}", h.getIntent},
		{http.MethodPatch, "/v1/runs/{run}/intents/{key}", h.finishIntent},
		{http.MethodPost, "/v1/runs/{run}/intents/{key}/renew", h.renewIntent},
		{http.MethodPost, "/v1/runs/{run}/tokens", h.issueToken},
		{http.MethodPost, resolvePath, h.resolve},
		{http.MethodPost, "/v1/runs/{run}/browsers", h.launchBrowser},
		{http.MethodGet, "/v1/endpoints", h.endpoints},
		{http.MethodPost, "/v1/transparent/bindings", h.bind},
		{http.MethodPost, "/v1/transparent/bindings/{id}/renew", h.renewBinding},
		{http.MethodDelete, "/v1/transparent/bindings/{id}", h.unbind},
	}
	allowed := map[string][]string{}
	for _, rt := range routes {
		h.mux.Handle(rt.method+" "+rt.path, h.api(rt.fn))
		allowed[rt.path] = append(allowed[rt.path], rt.method)
	}
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

// ServeHTTP recovers from panics, checks the token, then routes.
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
	// A signed webhook resolve authenticates by its signature instead of
	// the token; resolve verifies it (signedWebhook).
	if h.hasToken && !openPath(r.URL.Path) && !h.signedWebhook(r) && !h.authorized(r) {
		rw.Header().Set("WWW-Authenticate", `Bearer realm="stopgate"`)
		h.writeError(rw, r, refusal.New(refusal.Unauthorized, "missing or wrong bearer token: send Authorization: Bearer <token> (stopgate --token or STOPGATE_TOKEN)"))
		return
	}
	h.mux.ServeHTTP(rw, r)
}

func (h *Handler) authorized(r *http.Request) bool {
	scheme, token, ok := strings.Cut(r.Header.Get("Authorization"), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return false
	}
	sum := sha256.Sum256([]byte(strings.TrimSpace(token)))
	return subtle.ConstantTimeCompare(sum[:], h.tokenSum[:]) == 1
}

// api adapts an apiFunc: it reads the actor, bounds the store calls, and
// writes the answer.
func (h *Handler) api(fn apiFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		actor, err := actorOf(r)
		if err != nil {
			h.writeError(w, r, err)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), h.storeTimeout)
		defer cancel()
		status, body, err := fn(r.WithContext(ctx), actor)
		if err != nil {
			h.writeError(w, r, err)
			return
		}
		writeJSON(w, status, body)
	})
}

func actorOf(r *http.Request) (string, error) {
	vals := r.Header.Values(ActorHeader)
	if len(vals) == 0 {
		return DefaultActor, nil
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
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

func (h *Handler) readyz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), ReadyTimeout)
	defer cancel()
	if err := h.store.Ping(ctx); err != nil {
		h.writeError(w, r, refusal.New(refusal.StoreUnavailable, "store did not answer a ping within %s: %v", ReadyTimeout, err))
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ready"})
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
