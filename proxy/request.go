package proxy

import (
	"context"
	"errors"
	"io"
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
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/telemetry"
)

// exchange is everything decided about one proxied request or CONNECT,
// kept in goproxy's per-request UserData from the identity to the outcome.
// A CONNECT's exchange holds the identity the tunnel was opened with; each
// request inside the tunnel gets an exchange of its own that starts from it.
type exchange struct {
	id    identity
	hasID bool
	// rules are the policy's rules the exchange started under, which it
	// keeps to its end whatever a reload does meanwhile.
	rules *rules
	start time.Time
	flow  *flow
	body  *spooledBody
	// admitted, answer and intentHeader are what flow, the answer's body
	// and its intent header point to: kept here, an admitted request's
	// flow and answer cost no allocations of their own.
	admitted     flow
	answer       flowBody
	intentHeader [1]string
	// ctx is the request's context, cancelled with a cause when the flow is cut.
	ctx context.Context
	// store is how long the guard took.
	store time.Duration
	// slot is a tunnel's place under the caps on open exchanges.
	slot *slot
	// dest is the checked destination of a request or a pass-through
	// tunnel, which its dial reads.
	dest target
	// detail is for the operator, in the decision's line.
	detail string
	// wrote is set once a byte of the request may have left for the
	// upstream, by trace: its round trip's hooks, kept here so that they
	// cost no allocation of their own.
	wrote atomic.Bool
	trace httptrace.ClientTrace
	// queued is the outcome's decision line while its record is queued.
	queued queuedLine
	// status is the status the client got (the upstream's answer, a
	// refusal's, a tunnel's 200), upstream how long the upstream took to
	// answer, for the access line.
	status   int
	upstream time.Duration
	// meter is what the exchange reads of its answer for the run's usage.
	meter metering
}

// accessed writes the exchange's access line, at its end: how it ended
// (result, reason), what the ledger holds of it, and what went each way.
func (p *Proxy) accessed(ctx context.Context, ex *exchange, result telemetry.Result, reason string, recorded state.IntentState, responseBytes int64) {
	if !p.tel.AccessLogging() {
		return
	}
	var d telemetry.Decision
	if f := ex.flow; f != nil {
		d = ex.decision(f.boundary, f.method, f.host)
		d.Intent, d.Bytes = f.intent.Key, f.bytes
	} else {
		d = ex.decision(state.BoundaryHTTP, "", "")
	}
	d.Result, d.Reason, d.Recorded, d.StatusCode = result, reason, recorded, ex.status
	d.ResponseBytes, d.Upstream, d.Store = responseBytes, ex.upstream, 0
	p.tel.Accessed(ctx, d)
}

// queuedLine is the decision line of an outcome queued by finishLater,
// written once the ledger tells what became of the record. It lives in its
// exchange, so that neither the line nor what writes it costs an
// allocation.
type queuedLine struct {
	p *Proxy
	// ctx is the request's, whose values the line takes.
	ctx     context.Context
	line    telemetry.Decision
	started time.Time
}

func (q *queuedLine) Recorded(err error) {
	q.p.recorded(q.ctx, q.line, q.started, err)
}

// exchangeOf returns the exchange of a goproxy context, nil if it has none.
func exchangeOf(pctx *goproxy.ProxyCtx) *exchange {
	ex, _ := pctx.UserData.(*exchange)
	return ex
}

// decision is the start of the canonical line of an exchange.
func (ex *exchange) decision(boundary state.Boundary, method, host string) telemetry.Decision {
	d := telemetry.Decision{Boundary: boundary, Method: method, Host: host, Store: ex.store}
	if ex.hasID {
		d.Run, d.Version, d.Via = ex.id.run, ex.id.version, ex.id.via
	}
	if !ex.start.IsZero() {
		d.Duration = time.Since(ex.start)
	}
	return d
}

// refuse records a refusal of the exchange and renders it for req.
func (p *Proxy) refuse(req *http.Request, ex *exchange, boundary state.Boundary, r *refusal.Refusal) *http.Response {
	d := ex.decision(boundary, req.Method, hostOf(req))
	d.Result, d.Reason, d.Intent, d.Recorded = telemetry.Refused, string(r.Code), r.Intent, r.Recorded
	if r.Code == refusal.StoreUnavailable || r.Code == refusal.Internal {
		// The cause is for the operator, in the same line.
		d.Detail = r.Message
	}
	if ex.detail != "" {
		d.Detail = ex.detail
	}
	p.tel.Decided(req.Context(), d)
	if p.tel.AccessLogging() {
		d.StatusCode, d.Store = r.Status(), 0
		p.tel.Accessed(req.Context(), d)
	}
	return r.Response(req)
}

// hostOf is the destination's host:port as the request names it.
func hostOf(req *http.Request) string {
	if req.URL != nil && req.URL.Host != "" {
		return req.URL.Host
	}
	return req.Host
}

// handleRequest guards one request (plain, or inside a MITM tunnel). In
// order: who is asking (identity, then its run's share of the open
// exchanges), what it asks (its idempotency key), where it goes (the
// destination, before any guard), whether the guard can answer before the
// body is read, the body, then the guard.
func (p *Proxy) handleRequest(req *http.Request, pctx *goproxy.ProxyCtx) (*http.Request, *http.Response) {
	ex := &exchange{start: time.Now(), rules: p.current()}
	fallback := p.boundRun(req)
	s := slotOf(req.Context())
	if tunnel := tunnelOf(req.Context()); tunnel != nil && tunnel.hasID {
		fallback = &tunnel.id
	}
	pctx.UserData = ex
	id, err := identify(req.Header, fallback, p.tokens)
	if err != nil {
		return req, p.refuse(req, ex, state.BoundaryHTTP, identityRefusal(err))
	}
	ex.id, ex.hasID = id, true
	stripIdentity(req.Header)
	// A plain request counts against its run while it is proxied; a
	// tunnel against the run that first names itself in it.
	if s != nil && !s.name(id.run) {
		return req, p.refuse(req, ex, state.BoundaryHTTP, refusal.New(refusal.TooManyConnections,
			"run %s holds %d open exchanges through this proxy, its cap (--max-conns-per-run): try again when some have ended; nothing was sent", id.run, p.cfg.MaxConnsPerRun))
	}
	key, explicit, r := idempotencyKey(req.Header)
	if r != nil {
		return req, p.refuse(req, ex, state.BoundaryHTTP, r)
	}
	allow := ex.rules.Delivery.Match(req.URL.Host)
	boundary := state.BoundaryHTTP
	if allow {
		boundary = state.BoundaryDelivery
	}
	greq := state.GuardRequest{
		RunID: id.run, ObservedVersion: id.version, Key: key, ExplicitKey: explicit,
		Boundary: boundary, Method: req.Method,
		AutoAdmit: p.cfg.AutoAdmit, AllowCancelling: allow,
	}
	// A request without a key is named by its whole URL (with its body,
	// if any), written out once; the ledger's record of the target is
	// often the same string. One with a body is named by the URL alone
	// only if it is refused or guarded before its body is read: every
	// name costs a SHA-256.
	var rawURL string
	hasBody := req.Body != nil && req.Body != http.NoBody
	if !explicit {
		rawURL = req.URL.String()
		if !hasBody {
			greq.Key = intents.DerivedKey(id.run, req.Method, rawURL, "")
		}
	}
	greq.Target = intents.RecordedTarget(req.URL, rawURL)
	if greq.AutoAdmit {
		greq.Budget = ex.rules.autoBudget(id.run)
	}
	if tw := ex.rules.tripwireOf(req.Method, req.URL.Host, req.URL); tw != "" {
		// What the run must never do: refused, recorded and the run
		// cancelled in the guard's one step, before its body is read and
		// whatever its destination would have been.
		greq.Tripwire, greq.TripwireDrain = tw, ex.rules.CancelDrain
		r := p.guard(req, ex, withoutBody(greq, rawURL))
		if r == nil {
			// Never admitted: the guard refuses a tripwire whatever the
			// run's state.
			p.finish(req.Context(), ex, state.IntentNotSent, 0, "a tripwire's guard admitted the effect")
			r = refusal.New(refusal.Internal, "the guard admitted an effect that meets tripwire %s; nothing was sent", tw)
		}
		return req, p.refuse(req, ex, boundary, r)
	}
	if api, call := ex.rules.llmCall(req.Method, req.URL.Host, req.URL.Path); call {
		ex.meter.llm, ex.meter.api = true, api
		if api != "" {
			// Its usage is read from the answer as it passes: asked for
			// as it is, not compressed (docs/budgets.md).
			req.Header.Set("Accept-Encoding", "identity")
		}
	}
	if r := p.destination(req, ex, boundary, checkedAddr(req.Context(), canonicalAddr(req.URL))); r != nil {
		return req, p.refuse(req, ex, boundary, p.denied(req, ex, r, withoutBody(greq, rawURL)))
	}
	if p.guardFirst(req, id, allow) {
		// The run is known not to admit this: guarded before the body is
		// read, under the key the request has without it (its digest is
		// unknown: the body is never read).
		if r := p.guard(req, ex, withoutBody(greq, rawURL)); r != nil {
			return req, p.refuse(req, ex, boundary, r)
		}
		// The store admitted it after all (a row that was removed and
		// auto-admitted again): nothing was sent, and the request goes
		// on to be guarded with its body, as any other.
		p.finish(req.Context(), ex, state.IntentNotSent, 0, "admitted before its body was read; guarded again with its body")
		ex.flow = nil
	}

	if hasBody {
		body, err := spool(req.Body, p.cfg.SpoolDir, p.cfg.MaxBody)
		_ = req.Body.Close()
		if err != nil {
			return req, p.refuse(req, ex, boundary, p.bodyRefusal(req, err))
		}
		ex.body = body
		req.Body = body
		req.ContentLength = body.size
		req.TransferEncoding = nil
		req.Header.Set("Content-Length", strconv.FormatInt(body.size, 10))
	}
	if ex.body != nil {
		greq.BodyDigest, greq.RequestBytes = ex.body.digest, ex.body.size
	}
	if !explicit && greq.BodyDigest != "" {
		greq.Key = intents.DerivedKey(id.run, req.Method, rawURL, greq.BodyDigest)
	}
	if r := p.guard(req, ex, greq); r != nil {
		closeBody(ex.body)
		return req, p.refuse(req, ex, boundary, r)
	}
	// The round trip dials the addresses the destination check resolved.
	ctx, cut := context.WithCancelCause(withTarget(req.Context(), &ex.dest))
	ex.ctx, ex.flow.cut = ctx, cut
	p.flows.add(ex.flow)
	pctx.RoundTripper = p.upstream
	return req, nil
}

// idempotencyKey reads the request's Idempotency-Key: ("", false) when
// there is none, a refusal when it cannot be the key of an effect.
func idempotencyKey(h http.Header) (string, bool, *refusal.Refusal) {
	values := h.Values("Idempotency-Key")
	switch {
	case len(values) == 0 || len(values) == 1 && values[0] == "":
		return "", false, nil
	case len(values) > 1:
		return "", false, refusal.New(refusal.InvalidRequest, "%d Idempotency-Key headers: one effect has one key; nothing was sent", len(values))
	}
	key := values[0]
	if err := state.ValidateKey(key); err != nil {
		return "", false, refusal.Wrap(err, refusal.InvalidRequest, "Idempotency-Key: %s; nothing was sent", state.Why(err))
	}
	if err := state.CheckUnreserved(key); err != nil {
		return "", false, refusal.Wrap(err, refusal.InvalidRequest, "Idempotency-Key: %s; nothing was sent", state.Why(err))
	}
	return key, true, nil
}

// withoutBody is greq named as it stands before its body is read: a
// request without an Idempotency-Key by its URL (rawURL) alone.
func withoutBody(greq state.GuardRequest, rawURL string) state.GuardRequest {
	if !greq.ExplicitKey {
		greq.Key = intents.DerivedKey(greq.RunID, greq.Method, rawURL, "")
	}
	return greq
}

// destination checks where the request (or tunnel) goes, before any
// guard, into the exchange's dest, which its dial reads. A name that does
// not resolve is not refused here: the dial resolves it again and the
// round trip records what it got (NOT_SENT). A destination only a report
// rule would refuse goes on, with its would_deny line.
func (p *Proxy) destination(req *http.Request, ex *exchange, boundary state.Boundary, hostport string) *refusal.Refusal {
	err := ex.rules.dests.check(req.Context(), hostport, &ex.dest)
	if ex.dest.wouldDeny != "" && (err == nil || errors.Is(err, errUnresolved)) {
		d := ex.decision(boundary, req.Method, hostOf(req))
		d.Result, d.Reason, d.Rule = telemetry.WouldDeny, string(refusal.DestinationDenied), ex.dest.wouldDeny
		p.tel.Decided(req.Context(), d)
	}
	if err == nil || errors.Is(err, errUnresolved) {
		return nil
	}
	return refusal.FromError(err)
}

// denied records a refused destination in the run's audit, in the guard's
// one step (GuardRequest.Refuse, under greq's key), when the request names
// a run; without one it is logged and counted only. It returns r, saying
// what was recorded.
func (p *Proxy) denied(req *http.Request, ex *exchange, r *refusal.Refusal, greq state.GuardRequest) *refusal.Refusal {
	if r.Code != refusal.DestinationDenied || !ex.hasID {
		return r
	}
	r.RunID, r.ObservedVersion = ex.id.run, ex.id.version
	greq.Refuse = string(refusal.DestinationDenied)
	started := time.Now()
	res, err := p.cfg.Ledger.Begin(req.Context(), greq)
	ex.store = time.Since(started)
	switch {
	case err != nil:
		ex.detail = "the refusal could not be recorded: " + err.Error()
	case res.Refusal == greq.Refuse:
		r.Intent, r.Recorded = res.Intent.Key, state.IntentCancelledBeforeDispatch
		r.Message += "; recorded " + string(state.IntentCancelledBeforeDispatch) + " under " + res.Intent.Key
		p.seen.learn(res.Run)
	}
	return r
}

// canonicalAddr is the host:port a request's URL dials, as Go's transport
// names it (the scheme's port when the URL has none).
func canonicalAddr(u *url.URL) string {
	host, port := u.Hostname(), u.Port()
	if port != "" && !strings.Contains(host, ":") && len(u.Host) == len(host)+1+len(port) {
		// Host is host:port as written, with no brackets to add or drop.
		return u.Host
	}
	if port == "" {
		port = "80"
		if u.Scheme == "https" || u.Scheme == "wss" {
			port = "443"
		}
	}
	return net.JoinHostPort(host, port)
}

// guard runs the one atomic guard for the exchange's effect. Admitted, the
// exchange gets its flow (not yet open) and its canonical line; refused,
// the refusal is returned for the caller to render.
func (p *Proxy) guard(req *http.Request, ex *exchange, greq state.GuardRequest) *refusal.Refusal {
	started := time.Now()
	res, err := p.cfg.Ledger.Begin(req.Context(), greq)
	ex.store = time.Since(started)
	if err == nil && !res.Admitted {
		// The row says the run moved on: whatever else of it is open here
		// learns now rather than at the next broadcast or re-check.
		p.seen.learn(res.Run)
		p.cfg.Watcher.Observe(context.WithoutCancel(req.Context()), res.Run)
		err = refusal.FromGuard(greq, res)
	}
	if err != nil {
		return refusal.FromError(err)
	}
	host := hostOf(req)
	// A request guarded before its body was read and admitted has been
	// recorded NOT_SENT by now: its flow was never registered, and the
	// guard with its body takes its place.
	ex.admitted = flow{
		id: ex.id, intent: res.Intent, boundary: greq.Boundary, method: greq.Method, host: host,
		allowCancelling: greq.AllowCancelling, tunnel: greq.Boundary == state.BoundaryTunnel,
		effects: ex.rules.effectsOf(host),
	}
	ex.flow = &ex.admitted
	if ex.body != nil {
		ex.flow.bytes = ex.body.size
	}
	// An answer is read to its end for the run's budget of response
	// bytes, and an LLM call's for its usage too.
	ex.meter.bytes = ex.meter.llm || res.Run.Budget.MaxResponseBytes > 0
	d := ex.decision(greq.Boundary, greq.Method, ex.flow.host)
	d.Result, d.Intent, d.Recorded, d.Bytes = telemetry.Admitted, res.Intent.Key, res.Intent.State, ex.flow.bytes
	p.tel.Decided(req.Context(), d)
	return nil
}

// identityRefusal is the refusal of a request whose run cannot be named.
func identityRefusal(err error) *refusal.Refusal {
	var bad badCredentials
	if errors.Is(err, errNoIdentity) || errors.As(err, &bad) {
		return refusal.Wrap(err, refusal.NoRunIdentity, "%v", err)
	}
	return refusal.Wrap(err, refusal.BadRunIdentity, "%v", err)
}

// bodyRefusal is the refusal of a request whose body could not be taken.
func (p *Proxy) bodyRefusal(req *http.Request, err error) *refusal.Refusal {
	switch {
	case errors.Is(err, errBodyTooLarge):
		return refusal.Wrap(err, refusal.BodyTooLarge, "request body is larger than %d bytes (the proxy's --max-body); nothing was sent", p.cfg.MaxBody)
	case timedOut(err):
		return refusal.Wrap(err, refusal.BadRequestBody, "the client sent no byte of its request body for %s (the proxy's --client-idle-timeout); nothing was sent", p.cfg.IdleTimeout)
	case errors.Is(err, errBodyIncomplete):
		// Before the context: a client that ends its side mid-body also
		// ends the request's context, but what it did is send a short
		// body, and it may still be reading the answer.
		return refusal.Wrap(err, refusal.BadRequestBody, "%v; nothing was sent", err)
	case req.Context().Err() != nil:
		return refusal.Wrap(err, refusal.ClientGone, "the client went away while sending the request body; nothing was sent")
	}
	return refusal.Wrap(err, refusal.BadRequestBody, "%v; nothing was sent", err)
}

// roundTrip sends an admitted request upstream and records its outcome. It
// never returns an error: inside a MITM tunnel goproxy would close the
// client's connection without an answer.
func (p *Proxy) roundTrip(req *http.Request, pctx *goproxy.ProxyCtx) (*http.Response, error) {
	ex := exchangeOf(pctx)
	f := ex.flow
	// The transport writes the request line, then the Host field, then the
	// others: the first field's hook comes before any later byte, and
	// before WroteHeaders, which would only cost a closure more.
	ex.trace.WroteHeaderField = func(string, []string) { ex.wrote.Store(true) }
	sent := time.Now()
	resp, err := p.transport.RoundTrip(req.WithContext(httptrace.WithClientTrace(ex.ctx, &ex.trace)))
	ex.upstream = time.Since(sent)
	if err != nil {
		defer p.flows.remove(f)
		defer closeBody(ex.body)
		outcome, reason, source := state.IntentNotSent, "upstream: "+err.Error(), ""
		if ex.wrote.Load() {
			outcome = state.IntentUnknown
		}
		code := refusal.UpstreamFailed
		if ce := cutOf(ex.ctx); ce != nil {
			reason, code = ce.reason, refusal.RunNotActive
			// Cut after its bytes left: a request without effect is known
			// not to have applied, so the run need not wait on an operator.
			if s, ok := f.withoutEffect(); ok && outcome == state.IntentUnknown {
				outcome, source = state.IntentNotApplied, s
			}
		}
		p.finishWith(req.Context(), ex, outcome, 0, reason, source)
		r := refusal.Wrap(err, code, "%s; recorded %s", reason, outcome)
		r.RunID, r.ObservedVersion, r.Intent, r.Recorded = f.id.run, f.id.version, f.intent.Key, outcome
		result := telemetry.Finished
		if cutOf(ex.ctx) != nil {
			result = telemetry.Cut
		}
		ex.status = r.Status()
		p.accessed(req.Context(), ex, result, reason, outcome, 0)
		return r.Response(req), nil
	}
	ex.status = resp.StatusCode
	closeBody(ex.body)
	// An upgraded connection carries new requests both ways: it is cut at
	// the cancel whatever its method. An answer that streams (SSE, NDJSON)
	// is the answer of its request like any other: whether it is cut at
	// once or drains is the request's (its method, its destination's
	// effects), never the answer's format.
	if resp.StatusCode == http.StatusSwitchingProtocols {
		f.streaming.Store(true)
	}
	f.answered.Store(true)
	if resp.StatusCode == http.StatusSwitchingProtocols {
		ex.meter = metering{}
	}
	ex.meter.start(resp)
	if resp.ContentLength < 0 && resp.StatusCode != http.StatusSwitchingProtocols {
		// goproxy flushes to the client as bytes come only for SSE or a
		// chunked header, which Go's transport strips: without it, an
		// NDJSON stream would sit in the server's buffer.
		resp.Header.Set("Transfer-Encoding", "chunked")
	}
	// The provider has answered: the agent need not wait for the record
	// of it, which rides with this instance's next store step. An answer
	// read for the run's usage is recorded at its end, with what it used.
	if !ex.meter.on() {
		p.finishLater(req.Context(), ex, state.IntentResponded, resp.StatusCode)
	}
	// Only stopgate speaks in its own headers: an upstream's would mislead the agent.
	resp.Header.Del(refusal.Header)
	// Set by its key as net/http stores it, which it is spelled as
	// (TestIntentHeaderIsKeyedAsNetHTTPStoresIt), replacing whatever the
	// upstream sent under it.
	ex.intentHeader[0] = f.intent.Key
	resp.Header[refusal.IntentHeader] = ex.intentHeader[:]
	upstreamBody := resp.Body
	ex.answer = flowBody{ReadCloser: upstreamBody, p: p, ex: ex, reqCtx: req.Context(), abort: true}
	body := &ex.answer
	if resp.StatusCode != http.StatusSwitchingProtocols {
		// A cut ends the body through the transport, which watches the
		// request's context until the body is read.
		resp.Body = body
		return resp, nil
	}
	// An upgraded connection (WebSocket) no longer listens to the
	// request's context: a cut closes it itself.
	body.stopCloser = context.AfterFunc(ex.ctx, func() { _ = upstreamBody.Close() })
	if rw, ok := upstreamBody.(io.ReadWriteCloser); ok {
		// goproxy writes the client's frames into an upgraded body, and
		// reads it outside any handler: a cut closes both sides instead.
		body.abort = false
		resp.Body = &flowUpgradedBody{flowBody: body, w: rw}
	} else {
		resp.Body = body
	}
	return resp, nil
}

// finish records the outcome of the exchange's effect and its canonical line.
func (p *Proxy) finish(ctx context.Context, ex *exchange, outcome state.IntentState, code int, reason string) {
	p.finishWith(ctx, ex, outcome, code, reason, "")
}

// finishWith is finish with the source of a NOT_APPLIED outcome.
func (p *Proxy) finishWith(ctx context.Context, ex *exchange, outcome state.IntentState, code int, reason, source string) {
	started := time.Now()
	d := finished(ex, outcome, code)
	freq := state.FinishRequest{
		RunID: ex.flow.intent.RunID, Key: ex.flow.intent.Key, Attempt: ex.flow.intent.Attempts, Outcome: outcome,
		StatusCode: code, Reason: state.Clip(reason, 512), Source: source,
	}
	if outcome != state.IntentNotSent {
		// Sent and not answered: what an LLM call used is unknown.
		freq.LLM = ex.meter.usage(0, ex.rules.prices)
	}
	_, err := p.cfg.Ledger.Finish(ctx, freq)
	p.recorded(ctx, d, started, err)
	if ex.flow.tunnel {
		// A pass-through tunnel's outcome is its end.
		p.accessed(ctx, ex, d.Result, reason, outcome, 0)
	}
}

// finishLater is finish without waiting for the record: the outcome is
// queued in the store, before any later step of this instance, and its
// line is written once it is recorded.
func (p *Proxy) finishLater(ctx context.Context, ex *exchange, outcome state.IntentState, code int) {
	// The ledger records it whatever becomes of ctx; the line, written
	// later, only takes ctx's values.
	ex.queued = queuedLine{p: p, ctx: ctx, line: finished(ex, outcome, code), started: time.Now()}
	p.cfg.Ledger.FinishLater(ctx, state.FinishRequest{
		RunID: ex.flow.intent.RunID, Key: ex.flow.intent.Key, Attempt: ex.flow.intent.Attempts, Outcome: outcome, StatusCode: code,
	}, &ex.queued)
}

// finishMetered records the outcome of an answer read for the run's
// usage, once it is over (ended, or cut): what it used goes with it, in
// the same step, which cancels the run if that crosses its budget.
func (p *Proxy) finishMetered(ctx context.Context, ex *exchange, bytes int64) {
	ex.queued = queuedLine{p: p, ctx: ctx, line: finished(ex, state.IntentResponded, ex.status), started: time.Now()}
	p.cfg.Ledger.FinishLater(ctx, state.FinishRequest{
		RunID: ex.flow.intent.RunID, Key: ex.flow.intent.Key, Attempt: ex.flow.intent.Attempts,
		Outcome: state.IntentResponded, StatusCode: ex.status,
		ResponseBytes: bytes, LLM: ex.meter.usage(ex.status, ex.rules.prices),
	}, &ex.queued)
}

// finished is the decision line of the exchange's outcome, as things
// stand when it is reported.
func finished(ex *exchange, outcome state.IntentState, code int) telemetry.Decision {
	f := ex.flow
	d := ex.decision(f.boundary, f.method, f.host)
	d.Result, d.Intent, d.Recorded, d.StatusCode = telemetry.Finished, f.intent.Key, outcome, code
	d.Bytes = f.bytes
	if ex.ctx != nil {
		if ce := cutOf(ex.ctx); ce != nil {
			d.Result, d.Reason = telemetry.Cut, ce.reason
		}
	}
	return d
}

// recorded writes an outcome's decision line once the store has answered.
func (p *Proxy) recorded(ctx context.Context, d telemetry.Decision, started time.Time, err error) {
	d.Store = time.Since(started)
	if err != nil {
		d.Detail = "outcome not recorded; the lease will expire into UNKNOWN: " + err.Error()
	}
	p.tel.Decided(ctx, d)
}

// cutAnswer records that an answer already recorded RESPONDED was cut on
// its way back: the provider answered, the agent did not get all of it.
func (p *Proxy) cutAnswer(ctx context.Context, ex *exchange, ce *cutError) {
	f := ex.flow
	d := ex.decision(f.boundary, f.method, f.host)
	d.Result, d.Reason, d.Intent, d.Recorded = telemetry.Cut, ce.reason, f.intent.Key, state.IntentResponded
	// The record says what the provider did (it answered); the audit log
	// also says the agent did not get all of the answer, and why.
	if err := p.cfg.Ledger.Note(ctx, f.intent, state.EventIntentCut, ce.reason); err != nil {
		d.Detail = "the cut is not in the audit log: " + err.Error()
	}
	p.tel.Decided(ctx, d)
}

// flowBody ends its flow when the response body is done, and makes a cut
// an error the client sees.
type flowBody struct {
	io.ReadCloser
	p *Proxy
	// ex is the exchange whose answer this is: its ctx is cancelled, with
	// a *cutError cause, when its flow is cut.
	ex *exchange
	// reqCtx is the request's context, for the line of a cut answer.
	reqCtx context.Context
	// abort: the answer goes back through net/http's server (every
	// request, inside a tunnel too), which ends a body that stops early
	// with a clean last chunk; only aborting the handler makes the cut
	// visible there. An upgraded connection is closed instead.
	abort bool
	// stopCloser, for an upgraded connection, stops a cut from closing
	// the body once it is done.
	stopCloser func() bool
	seen       atomic.Bool
	once       atomic.Bool
	// n counts the bytes passed on to the client, for the access line.
	n atomic.Int64
}

// Read passes the body on; once the flow is cut, whatever the upstream's
// body says (a clean EOF included), the read fails with the cut.
func (b *flowBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	if m := b.ex.meter.meter; m != nil && n > 0 {
		_, _ = m.Write(p[:n])
	}
	if err == nil {
		return n, nil
	}
	ce := cutOf(b.ex.ctx)
	if ce == nil {
		return n, err
	}
	if b.seen.CompareAndSwap(false, true) {
		// Told once, when a read first meets the cut.
		b.p.cutAnswer(b.reqCtx, b.ex, ce)
	}
	if b.abort {
		// net/http's server recovers this one and drops the connection
		// without finishing the response.
		panic(http.ErrAbortHandler)
	}
	return n, ce
}

func (b *flowBody) Close() error {
	err := b.ReadCloser.Close()
	if b.once.CompareAndSwap(false, true) {
		if b.stopCloser != nil {
			b.stopCloser()
		}
		f := b.ex.flow
		b.p.flows.remove(f)
		result, reason := telemetry.Finished, ""
		if ce := cutOf(b.ex.ctx); ce != nil {
			result, reason = telemetry.Cut, ce.reason
		}
		f.cut(nil)
		if b.ex.meter.on() {
			b.p.finishMetered(b.reqCtx, b.ex, b.n.Load())
		}
		b.p.accessed(b.reqCtx, b.ex, result, reason, state.IntentResponded, b.n.Load())
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
