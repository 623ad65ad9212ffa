// Package telemetry is stopgate's own account of what it decided: one
// canonical log line for every decision at a boundary (admitted, refused,
// cut, finished), and the Prometheus metrics an operator watches. At info
// the log holds what was stopped or went wrong (refused, cut, an effect
// that ended unanswered, and any failure, as a warning); an effect admitted
// and answered is a debug line: the run's audit log and the counters
// already have it. Every
// edge reports a decision through Decided, so the log line and the counters
// never disagree and a field added here appears everywhere.
//
// It never logs a token, a secret, a request body or a query string, and its
// metric labels are bounded (no run ids, no hosts). It never decides
// anything: it records what the edges and the store decided.
package telemetry

import (
	"context"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
)

// Result is what became of a request or an effect at a boundary.
type Result string

// Results. A request is admitted or refused by the decision; an admitted
// effect later finishes, or is cut.
const (
	Admitted Result = "admitted"
	Refused  Result = "refused"
	Finished Result = "finished"
	Cut      Result = "cut"
	// WouldDeny: a destination that only a report rule refuses (policy
	// destinations.report, or destinations.default: report), forwarded
	// all the same; its request goes on to be admitted or refused.
	WouldDeny Result = "would_deny"
)

// Decision is one decision at a boundary, with what the canonical log line
// says about it. Zero fields are left out of the line.
type Decision struct {
	Boundary state.Boundary
	Result   Result
	// Reason is the refusal code (refused), or why the effect was cut.
	Reason string
	Run    string
	// Version is the cancel_version the caller observed.
	Version int64
	Method  string
	// Host is the destination's host (never its path or query).
	Host string
	// Intent is the key the effect is recorded under.
	Intent string
	// Recorded is the intent's state in the ledger after this decision.
	Recorded state.IntentState
	// StatusCode is the upstream's answer (finished).
	StatusCode int
	// Store is how long the store step of this decision took.
	Store time.Duration
	// Bytes the effect carried (request body, or tunnel bytes sent).
	Bytes int64
	// ResponseBytes is what came back to the client (the access line).
	ResponseBytes int64
	// Upstream is how long the upstream took to answer: from the request
	// sent to the answer's headers (the access line).
	Upstream time.Duration
	// Duration is the decision's whole time (the request's, the tunnel's).
	Duration time.Duration
	// Via says where the identity came from (header, credentials, token, ...).
	Via string
	// Rule is the policy rule that decided (a would_deny's report rule).
	Rule string
	// Detail is for the operator: the cause of a failure (a store that did
	// not answer, an outcome that could not be written). It raises the
	// line to a warning.
	Detail string
}

// Options configure a Telemetry.
type Options struct {
	// Registry receives the metrics; nil keeps them on a private registry.
	Registry prometheus.Registerer
	// Logger receives the canonical lines; nil discards them.
	Logger *slog.Logger
	// Store names the store kind in latency labels (file, redis).
	Store string
	// AccessLog writes one line per request at info (Accessed).
	AccessLog bool
}

// Telemetry records decisions. Its methods are safe for concurrent use.
type Telemetry struct {
	log     *slog.Logger
	store   string
	metrics *Metrics
	access  bool
}

// New returns a Telemetry; the zero Options give one that counts privately
// and logs nothing, for tests and for components built without one.
func New(opts Options) *Telemetry {
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	reg := opts.Registry
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	if opts.Store == "" {
		opts.Store = "unknown"
	}
	return &Telemetry{log: opts.Logger, store: opts.Store, metrics: newMetrics(reg), access: opts.AccessLog}
}

// Metrics is the telemetry's instruments, for the parts that measure
// something other than a decision (open connections, drains).
func (t *Telemetry) Metrics() *Metrics { return t.metrics }

// Decided records one decision: its canonical log line and its counters.
func (t *Telemetry) Decided(ctx context.Context, d Decision) {
	m := t.metrics
	m.decisions.WithLabelValues(string(d.Boundary), string(d.Result)).Inc()
	switch d.Result {
	case Refused:
		m.refusals.WithLabelValues(string(d.Boundary), d.Reason).Inc()
	case Cut:
		m.cuts.WithLabelValues(string(d.Boundary), cutCause(d.Reason)).Inc()
	}
	level := slog.LevelInfo
	if d.Result == Admitted || d.Result == Finished && d.Recorded == state.IntentResponded {
		// The ordinary path of an effect (admitted, answered) is in the
		// run's audit log and the counters; a line for each at info cost
		// CPU on every request (docs/bench.md, "Figures behind code kept
		// for speed") and told an operator nothing to act on. An effect
		// that ended otherwise (not sent, UNKNOWN) keeps its line.
		level = slog.LevelDebug
	}
	if d.Detail != "" || d.Reason == string(refusal.StoreUnavailable) || d.Reason == string(refusal.Internal) {
		level = slog.LevelWarn
	}
	if !t.log.Enabled(ctx, level) {
		return
	}
	attrs := d.attrs()
	str := func(k, v string) {
		if v != "" {
			attrs = append(attrs, slog.String(k, v))
		}
	}
	str("rule", d.Rule)
	if d.StatusCode != 0 {
		attrs = append(attrs, slog.Int("status", d.StatusCode))
	}
	if d.Store > 0 {
		attrs = append(attrs, slog.Duration("store_latency", d.Store))
	}
	if d.Bytes > 0 {
		attrs = append(attrs, slog.Int64("bytes", d.Bytes))
	}
	if d.Duration > 0 {
		attrs = append(attrs, slog.Duration("duration", d.Duration))
	}
	str("detail", d.Detail)
	t.log.LogAttrs(ctx, level, "decision", attrs...)
}

// AccessLogging reports whether Accessed writes anything, so that an edge
// gathers an access line's figures only when it is asked for.
func (t *Telemetry) AccessLogging() bool { return t.access }

// Accessed writes the access line of one request at its end, whatever
// became of it (refused, answered, failed, cut): smokescreen's canonical
// line, one per request, at info, when the access log is on. d.StatusCode
// is the status the client got (the refusal's, or the upstream's), d.Result
// how the request ended. It counts nothing: Decided did.
func (t *Telemetry) Accessed(ctx context.Context, d Decision) {
	if !t.access || !t.log.Enabled(ctx, slog.LevelInfo) {
		return
	}
	attrs := d.attrs()
	attrs = append(attrs, slog.Int("status", d.StatusCode),
		slog.Int64("request_bytes", d.Bytes), slog.Int64("response_bytes", d.ResponseBytes),
		slog.Duration("upstream_latency", d.Upstream), slog.Duration("duration", d.Duration))
	if d.Detail != "" {
		attrs = append(attrs, slog.String("detail", d.Detail))
	}
	t.log.LogAttrs(ctx, slog.LevelInfo, "access", attrs...)
}

// attrs are the fields a decision line and an access line both begin
// with: what the request was and what became of it, the empty ones left out.
func (d Decision) attrs() []slog.Attr {
	attrs := make([]slog.Attr, 0, 16)
	attrs = append(attrs, slog.String("boundary", string(d.Boundary)), slog.String("decision", string(d.Result)))
	str := func(k, v string) {
		if v != "" {
			attrs = append(attrs, slog.String(k, v))
		}
	}
	str("reason", d.Reason)
	str("run", d.Run)
	if d.Version != 0 {
		attrs = append(attrs, slog.Int64("version", d.Version))
	}
	str("via", d.Via)
	str("method", d.Method)
	str("host", d.Host)
	str("intent", d.Intent)
	str("recorded", string(d.Recorded))
	return attrs
}

// cutCause folds a cut's reason (which may carry detail after a colon) to
// a bounded label.
func cutCause(reason string) string {
	for i := 0; i < len(reason); i++ {
		if reason[i] == ':' {
			return reason[:i]
		}
	}
	if reason == "" {
		return "unknown"
	}
	return reason
}
