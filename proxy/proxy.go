// Package proxy is the egress proxy: a sidecar that unmodified agents reach
// through HTTP_PROXY and HTTPS_PROXY. Every request is bound to a run, passed
// through the one atomic guard of package state (via the intents ledger)
// before a byte goes upstream, and recorded with its outcome; after a cancel
// commits, the run's new requests are refused and its open connections are
// cut as the contract says.
//
// It never forwards a request the guard did not admit: when the store is
// down or slow the answer is 503, not a request sent unguarded. It never
// decides a run's state: it reads and records it through the store.
package proxy

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/elazarl/goproxy"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/state"
)

// Config wires a Proxy.
type Config struct {
	Store  state.Store
	Ledger *intents.Ledger
	CA     *CA
	// StaticRun binds every request without its own identity to one run.
	StaticRun string
	// AutoAdmit admits unseen runs on first sight (never a tombstone).
	AutoAdmit bool
	// Tokens verifies signed run tokens (proxy password or X-Run-Token);
	// with RequireToken a client can name its run no other way.
	Tokens       *runtoken.Signer
	RequireToken bool
	// PassThrough hosts are tunnelled unseen: one intent per tunnel.
	PassThrough HostSet
	// Delivery hosts may still be reached by a CANCELLING run.
	Delivery HostSet
	// MaxBody caps a request body; past it the answer is 413 and nothing is sent.
	MaxBody int64
	// SpoolDir holds request bodies too large for memory ("" = os.TempDir).
	SpoolDir string
	// RecheckInterval is how often the rows of runs with open flows are
	// read again, so that a lost cancel message costs latency, not safety.
	RecheckInterval time.Duration
	// StoreTimeout bounds each store call on the request path.
	StoreTimeout time.Duration
	// UpstreamRoots, if set, replaces the system roots for upstream TLS.
	UpstreamRoots *x509.CertPool
	// DialTimeout bounds connecting to an upstream.
	DialTimeout time.Duration
	// DialContext, if set, connects to upstreams instead of a plain
	// net.Dialer (egress through a chosen interface, or a fixed address for
	// a name, as tests do for their loopback providers).
	DialContext func(ctx context.Context, network, addr string) (net.Conn, error)
	Logger      *slog.Logger
}

// Proxy is the egress proxy; it is an http.Handler.
type Proxy struct {
	cfg       Config
	log       *slog.Logger
	gp        *goproxy.ProxyHttpServer
	transport *http.Transport
	flows     *flowSet
	static    *identity
	tokens    tokenCheck
	stats     Stats
}

// Stats count what the proxy did since it started.
type Stats struct {
	Forwarded   atomic.Int64
	Refused     atomic.Int64
	Unavailable atomic.Int64
	Cut         atomic.Int64
}

// New builds a proxy from cfg.
func New(cfg Config) (*Proxy, error) {
	if cfg.Store == nil || cfg.Ledger == nil {
		return nil, errors.New("proxy: a store and a ledger are required")
	}
	if cfg.MaxBody <= 0 {
		cfg.MaxBody = 256 << 20
	}
	if cfg.RecheckInterval <= 0 {
		cfg.RecheckInterval = 2 * time.Second
	}
	if cfg.StoreTimeout <= 0 {
		cfg.StoreTimeout = 2 * time.Second
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = 10 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.DialContext == nil {
		cfg.DialContext = (&net.Dialer{Timeout: cfg.DialTimeout, KeepAlive: 30 * time.Second}).DialContext
	}
	if cfg.RequireToken && cfg.Tokens == nil {
		return nil, errors.New("proxy: run tokens are required but no token secret is configured")
	}
	p := &Proxy{cfg: cfg, log: cfg.Logger, flows: newFlowSet(), tokens: tokenCheck{signer: cfg.Tokens, require: cfg.RequireToken}}
	if cfg.StaticRun != "" {
		if err := state.ValidateRunID(cfg.StaticRun); err != nil {
			return nil, fmt.Errorf("static run: %w", err)
		}
		p.static = &identity{run: cfg.StaticRun, via: "static"}
	}
	// Our own transport: goproxy's default reads HTTP(S)_PROXY from the
	// environment, and a sidecar that inherits its worker's environment
	// would proxy to itself.
	p.transport = &http.Transport{
		Proxy:                 nil,
		DialContext:           p.dial,
		TLSClientConfig:       &tls.Config{RootCAs: cfg.UpstreamRoots, MinVersion: tls.VersionTLS12},
		TLSHandshakeTimeout:   cfg.DialTimeout,
		MaxIdleConns:          512,
		MaxIdleConnsPerHost:   64,
		IdleConnTimeout:       90 * time.Second,
		ExpectContinueTimeout: time.Second,
		// Bytes pass as the worker sent them, compressed or not.
		DisableCompression: true,
		// HTTP/1.1 upstream keeps "were any bytes written?" answerable per request.
		TLSNextProto: map[string]func(string, *tls.Conn) http.RoundTripper{},
	}
	gp := goproxy.NewProxyHttpServer()
	gp.Tr = p.transport
	gp.ConnectDial = nil
	gp.ConnectDialWithReq = nil
	gp.KeepAcceptEncoding = true
	gp.Logger = slogPrintf{p.log}
	gp.NonproxyHandler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusBadRequest, "", map[string]any{
			"error":   "not_a_proxy_request",
			"message": "this is stopgate's egress proxy: send absolute-URI requests or CONNECT (set HTTP_PROXY/HTTPS_PROXY); the control API listens elsewhere",
		})
	})
	if cfg.CA != nil {
		gp.CertStore = &certCache{}
	}
	gp.OnRequest().HandleConnectFunc(p.handleConnect)
	gp.OnRequest().DoFunc(p.handleRequest)
	p.gp = gp
	return p, nil
}

// ServeHTTP serves proxy traffic.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodConnect || r.Header.Get("Upgrade") == "" {
		p.gp.ServeHTTP(w, r)
		return
	}
	// goproxy hijacks the client's connection for an upgrade and never
	// closes it: when the upgraded connection ends (or a cancel cuts its
	// upstream side), we close the client's side.
	uw := &upgradeWriter{ResponseWriter: w}
	p.gp.ServeHTTP(uw, r)
	if uw.conn != nil {
		_ = uw.conn.Close()
	}
}

// ForRun returns the proxy as a handler that binds every request to run,
// whatever run its headers or credentials name (they are stripped): for a
// client that cannot send credentials and must not be able to choose, such
// as a browser launched for the run, whose pages run untrusted scripts.
func (p *Proxy) ForRun(run string) (http.Handler, error) {
	if err := state.ValidateRunID(run); err != nil {
		return nil, fmt.Errorf("bind proxy to run: %w", err)
	}
	bound := &identity{run: run, via: "bound listener", bound: true}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), boundRunKey{}, bound)))
	}), nil
}

type boundRunKey struct{}

// boundRun is the identity a request gets when it names none: the run its
// listener is bound to, else the sidecar's static run.
func (p *Proxy) boundRun(r *http.Request) *identity {
	if id, ok := r.Context().Value(boundRunKey{}).(*identity); ok {
		return id
	}
	return p.static
}

// upgradeWriter remembers the connection goproxy hijacks.
type upgradeWriter struct {
	http.ResponseWriter
	conn net.Conn
}

func (w *upgradeWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	conn, rw, err := http.NewResponseController(w.ResponseWriter).Hijack()
	w.conn = conn
	return conn, rw, err
}

// Stats returns the proxy's counters.
func (p *Proxy) Stats() *Stats { return &p.stats }

// CutAll cuts every open flow, recording why: for a shutdown, so that what
// was in flight is recorded now rather than when its lease expires.
func (p *Proxy) CutAll(reason string) { p.flows.cutAll(reason) }

// OpenFlows is the number of effects this proxy is carrying now.
func (p *Proxy) OpenFlows() int { return p.flows.count() }

// Run carries cancels to open connections until ctx ends: at once from the
// store's broadcast, and every RecheckInterval from the rows themselves.
func (p *Proxy) Run(ctx context.Context) {
	cancels, err := p.cfg.Store.Cancels(ctx)
	if err != nil {
		p.log.Warn("no cancel broadcast; open connections learn of cancels by re-check only", "err", err)
	}
	t := time.NewTicker(p.cfg.RecheckInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case run, ok := <-cancels:
			if !ok {
				cancels = nil
				continue
			}
			p.enforce(ctx, run)
		case <-t.C:
			for _, run := range p.flows.runs() {
				p.enforce(ctx, run)
			}
		}
	}
}

func (p *Proxy) enforce(ctx context.Context, runID string) {
	if ctx.Err() != nil {
		return
	}
	gctx, cancel := context.WithTimeout(ctx, p.cfg.StoreTimeout)
	run, err := p.cfg.Store.Get(gctx, runID)
	cancel()
	if err != nil {
		p.log.Warn("cannot read run to enforce it on open connections", "run", runID, "err", err)
		return
	}
	if wait := p.flows.enforce(run, time.Now()); !wait.IsZero() {
		p.flows.armTimer(runID, wait, func() { p.enforce(ctx, runID) })
	}
}

type requestState struct {
	flow *flow
	body *spooledBody
	ctx  context.Context
}

// handleRequest guards one request (plain, or inside a MITM tunnel).
func (p *Proxy) handleRequest(req *http.Request, pctx *goproxy.ProxyCtx) (*http.Request, *http.Response) {
	fallback := p.boundRun(req)
	if id, ok := pctx.UserData.(identity); ok {
		fallback = &id
	}
	id, err := identify(req.Header, fallback, p.tokens)
	if err != nil {
		return req, p.identityError(req, err)
	}
	stripIdentity(req.Header)

	var body *spooledBody
	if req.Body != nil && req.Body != http.NoBody {
		body, err = spool(req.Body, p.cfg.SpoolDir, p.cfg.MaxBody)
		_ = req.Body.Close()
		if errors.Is(err, errBodyTooLarge) {
			return req, refusal(req, http.StatusRequestEntityTooLarge, "body_too_large", map[string]any{
				"message": fmt.Sprintf("request body is larger than %d bytes (the proxy's --max-body); nothing was sent", p.cfg.MaxBody),
			})
		}
		if err != nil {
			return req, refusal(req, http.StatusBadRequest, "bad_request_body", map[string]any{"message": err.Error()})
		}
		req.Body = body
		req.ContentLength = body.size
		req.TransferEncoding = nil
		req.Header.Set("Content-Length", strconv.FormatInt(body.size, 10))
	}
	digest := ""
	if body != nil {
		digest = body.digest
	}
	fullTarget := req.URL.String()
	key, explicit := req.Header.Get("Idempotency-Key"), true
	if key == "" {
		key, explicit = intents.DerivedKey(id.run, req.Method, fullTarget, digest), false
	}
	allow := p.cfg.Delivery.Match(req.URL.Host)
	boundary := state.BoundaryHTTP
	if allow {
		boundary = state.BoundaryDelivery
	}
	res, err := p.cfg.Ledger.Begin(req.Context(), state.GuardRequest{
		RunID: id.run, ObservedVersion: id.version, Key: key, ExplicitKey: explicit,
		Boundary: boundary, Method: req.Method, Target: recordedTarget(req.URL), BodyDigest: digest,
		AutoAdmit: p.cfg.AutoAdmit, AllowCancelling: allow,
	})
	if err != nil {
		closeBody(body)
		if errors.Is(err, state.ErrInvalid) {
			return req, refusal(req, http.StatusBadRequest, "bad_request", map[string]any{"message": err.Error()})
		}
		p.stats.Unavailable.Add(1)
		p.log.Warn("guard failed: refusing (fail closed)", "run", id.run, "err", err)
		return req, refusal(req, http.StatusServiceUnavailable, "store_unavailable", map[string]any{
			"run_id":  id.run,
			"message": "the run state store did not answer in time; nothing was sent (fail closed): " + err.Error(),
		})
	}
	if !res.Admitted {
		closeBody(body)
		p.stats.Refused.Add(1)
		return req, guardRefusal(req, id, res)
	}

	ctx, cut := context.WithCancelCause(req.Context())
	f := &flow{id: id, intent: res.Intent, method: req.Method, allowCancelling: allow, cut: cut}
	p.flows.add(f)
	pctx.UserData = &requestState{flow: f, body: body, ctx: ctx}
	pctx.RoundTripper = goproxy.RoundTripperFunc(p.roundTrip)
	return req, nil
}

// roundTrip sends an admitted request upstream and records its outcome. It
// never returns an error: inside a MITM tunnel goproxy would close the
// client's connection without an answer.
func (p *Proxy) roundTrip(req *http.Request, pctx *goproxy.ProxyCtx) (*http.Response, error) {
	rs := pctx.UserData.(*requestState)
	f := rs.flow
	var wrote atomic.Bool
	trace := &httptrace.ClientTrace{
		WroteHeaderField: func(string, []string) { wrote.Store(true) },
		WroteHeaders:     func() { wrote.Store(true) },
	}
	stripIdentity(req.Header)
	out := req.WithContext(httptrace.WithClientTrace(rs.ctx, trace))
	resp, err := p.transport.RoundTrip(out)
	if err != nil {
		defer p.flows.remove(f)
		defer closeBody(rs.body)
		outcome, reason := state.IntentNotSent, "upstream: "+err.Error()
		if wrote.Load() {
			outcome = state.IntentUnknown
		}
		var ce *cutError
		if errors.As(context.Cause(rs.ctx), &ce) {
			reason = ce.reason
			p.stats.Cut.Add(1)
		}
		p.finish(req.Context(), f, outcome, 0, reason)
		status, code := http.StatusBadGateway, "upstream_failed"
		if ce != nil {
			status, code = http.StatusConflict, "run_not_active"
		}
		return refusal(req, status, code, map[string]any{
			"run_id": f.id.run, "intent": f.intent.Key, "recorded": outcome,
			"message": reason,
		}, f.intent.Key), nil
	}
	closeBody(rs.body)
	p.stats.Forwarded.Add(1)
	if resp.StatusCode == http.StatusSwitchingProtocols || strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		f.streaming.Store(true)
	}
	f.answered.Store(true)
	if resp.ContentLength < 0 && resp.StatusCode != http.StatusSwitchingProtocols {
		// goproxy flushes to the client as bytes come only for SSE or a
		// chunked header, which Go's transport strips: without it, an
		// NDJSON stream would sit in the server's buffer.
		resp.Header.Set("Transfer-Encoding", "chunked")
	}
	p.finish(req.Context(), f, state.IntentResponded, resp.StatusCode, "")
	// Only stopgate speaks in its own headers: an upstream's would mislead the agent.
	resp.Header.Del(HeaderRefusal)
	resp.Header.Set(HeaderIntent, f.intent.Key)
	upstreamBody := resp.Body
	// A cut closes the body itself: an upgraded connection (WebSocket) no
	// longer listens to the request's context.
	stopCloser := context.AfterFunc(rs.ctx, func() { _ = upstreamBody.Close() })
	body := &flowBody{ReadCloser: upstreamBody, done: func() { stopCloser(); p.flows.remove(f); f.cut(nil) }}
	if rw, ok := upstreamBody.(io.ReadWriteCloser); ok && resp.StatusCode == http.StatusSwitchingProtocols {
		// goproxy writes the client's frames into an upgraded body.
		resp.Body = &flowUpgradedBody{flowBody: body, w: rw}
	} else {
		resp.Body = body
	}
	return resp, nil
}

// flowBody ends its flow when the response body is done.
type flowBody struct {
	io.ReadCloser
	once atomic.Bool
	done func()
}

func (b *flowBody) Close() error {
	err := b.ReadCloser.Close()
	if b.once.CompareAndSwap(false, true) {
		b.done()
	}
	return err
}

// flowUpgradedBody is the body of a 101 Switching Protocols answer: both
// directions of the upgraded connection.
type flowUpgradedBody struct {
	*flowBody
	w io.Writer
}

func (b *flowUpgradedBody) Write(p []byte) (int, error) { return b.w.Write(p) }

func closeBody(b *spooledBody) {
	if b != nil {
		_ = b.Close()
	}
}

// recordedTarget is the URL kept in the ledger: without credentials or
// query, which often carry secrets; the derived key still covers the query.
func recordedTarget(u *url.URL) string {
	c := *u
	c.User = nil
	c.RawQuery = ""
	c.Fragment = ""
	return truncate(c.String(), state.MaxTargetLen)
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

func (p *Proxy) identityError(req *http.Request, err error) *http.Response {
	var bad badCredentials
	if errors.Is(err, errNoIdentity) || errors.As(err, &bad) {
		resp := refusal(req, http.StatusProxyAuthRequired, "no_run_identity", map[string]any{"message": err.Error()})
		resp.Header.Set("Proxy-Authenticate", `Basic realm="stopgate: user = run id, password = cancel version"`)
		return resp
	}
	return refusal(req, http.StatusBadRequest, "bad_run_identity", map[string]any{"message": err.Error()})
}

func guardRefusal(req *http.Request, id identity, res state.GuardResult) *http.Response {
	body := map[string]any{
		"run_id":           id.run,
		"status":           res.Run.Status,
		"cancel_version":   res.Run.CancelVersion,
		"observed_version": id.version,
		"intent":           res.Intent.Key,
	}
	status := http.StatusConflict
	switch res.Refusal {
	case state.RefusalRunNotActive, state.RefusalStaleVersion:
		body["recorded"] = state.IntentCancelledBeforeDispatch
		body["message"] = fmt.Sprintf("run %s is %s at cancel_version %d (the request observed %d): nothing was sent", id.run, res.Run.Status, res.Run.CancelVersion, id.version)
	case state.RefusalRunNotAdmitted:
		body["status"] = nil
		body["message"] = fmt.Sprintf("run %s was never admitted and auto-admit is off: admit it first (stopgate admit %s)", id.run, id.run)
	case state.RefusalInProgress:
		body["intent_state"] = res.Intent.State
		body["message"] = fmt.Sprintf("Idempotency-Key %s is %s: no duplicate while the first attempt is unresolved", res.Intent.Key, res.Intent.State)
	case state.RefusalKeyReused:
		status = http.StatusUnprocessableEntity
		body["message"] = fmt.Sprintf("Idempotency-Key %s was used with a different request body", res.Intent.Key)
	}
	return refusal(req, status, res.Refusal, body, res.Intent.Key)
}

// refusal builds a JSON answer the proxy gives instead of forwarding.
func refusal(req *http.Request, status int, code string, fields map[string]any, intentKey ...string) *http.Response {
	fields["error"] = code
	b, _ := json.Marshal(fields)
	resp := &http.Response{
		StatusCode:    status,
		Status:        fmt.Sprintf("%d %s", status, http.StatusText(status)),
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        http.Header{"Content-Type": {"application/json"}},
		Body:          io.NopCloser(bytes.NewReader(b)),
		ContentLength: int64(len(b)),
		Request:       req,
	}
	if status != http.StatusOK {
		resp.Header.Set(HeaderRefusal, code)
	}
	if len(intentKey) > 0 && intentKey[0] != "" {
		resp.Header.Set(HeaderIntent, intentKey[0])
	}
	return resp
}

func writeJSON(w http.ResponseWriter, status int, intentKey string, body map[string]any) {
	w.Header().Set("Content-Type", "application/json")
	if code, ok := body["error"].(string); ok {
		w.Header().Set(HeaderRefusal, code)
	}
	if intentKey != "" {
		w.Header().Set(HeaderIntent, intentKey)
	}
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(body)
}

// slogPrintf lets goproxy's warnings reach the structured log.
type slogPrintf struct{ log *slog.Logger }

func (l slogPrintf) Printf(format string, v ...any) {
	l.log.Debug(fmt.Sprintf(format, v...), "component", "goproxy")
}
