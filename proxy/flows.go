package proxy

import (
	"context"
	"errors"
	"maps"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/telemetry"
)

// flow is one admitted effect this instance is carrying: a request on its
// way to the upstream or streaming back, or a pass-through tunnel. The
// registry of flows is how a cancel reaches connections that goproxy has
// already handed off.
type flow struct {
	id       identity
	intent   state.Intent
	boundary state.Boundary
	method   string
	// host is the destination's host, for the effect's log line.
	host string
	// bytes the request carried upstream (its body's size).
	bytes int64
	// allowCancelling: a delivery destination that a CANCELLING run may still reach.
	allowCancelling bool
	tunnel          bool
	// effects says what the request does outside, by the policy of its
	// destination: it decides what a cancel cuts at once, and what a cut
	// request is recorded as.
	effects effects
	// streaming is set when the upstream upgraded the connection (a
	// WebSocket), which a cancel cuts at once whatever the method: what
	// goes through it next are new requests. Any other answer to an unsafe
	// request, streamed or not, may finish reaching the client until the
	// drain deadline, since its effect has happened.
	streaming atomic.Bool
	// answered is set once the upstream's answer came back (RESPONDED).
	answered atomic.Bool
	cut      context.CancelCauseFunc
	// cutBy is the cut that ended the flow, if one did.
	cutBy atomic.Pointer[cutError]
	// open, prev and next are the flow's place among its run's open flows
	// (flowSet), under the set's lock.
	open       bool
	prev, next *flow
}

// stop cuts the flow for ce.
func (f *flow) stop(ce *cutError) {
	f.cutBy.CompareAndSwap(nil, ce)
	f.cut(ce)
}

// cutError is the cause a flow is cut with, so the round trip can record
// why; cancelledAt is when the cancel that cut it committed (zero for a
// shutdown).
type cutError struct {
	reason      string
	cancelledAt time.Time
}

func (e *cutError) Error() string { return "cut by stopgate: " + e.reason }

// cutOf is the cut that ended ctx: nil while ctx is alive, or when it
// ended otherwise. Every request's outcome and last read ask it, of a
// context that is nearly always alive: that answer comes without
// errors.As, whose target escapes to the heap.
func cutOf(ctx context.Context) *cutError {
	if ctx.Err() == nil {
		return nil
	}
	var ce *cutError
	if errors.As(context.Cause(ctx), &ce) {
		return ce
	}
	return nil
}

func safeMethod(m string) bool {
	switch m {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return false
}

// effects is a destination's policy: whether its requests change anything
// outside (docs/proxy.md, "What a cut records").
type effects int

const (
	// effectsWrites, the default: unsafe methods have effects, reads do not.
	effectsWrites effects = iota
	// effectsNone: nothing sent there has an external effect (an LLM API).
	effectsNone
	// effectsAll: reads have effects too.
	effectsAll
)

// withoutEffect reports whether f, cut after its bytes were sent, provably
// changed nothing outside, and by which rule: the destination's policy, or
// the method's safety. Tunnels are never known: the proxy cannot see in.
func (f *flow) withoutEffect() (source string, ok bool) {
	switch {
	case f.tunnel:
		return "", false
	case f.effects == effectsNone:
		return state.SourcePolicy, true
	case f.effects == effectsWrites && safeMethod(f.method):
		return state.SourceSafeMethod, true
	}
	return "", false
}

// drains reports whether f may go on until the run's drain deadline: an
// effect under way whose end the agent should see. A request without
// effect is cut at the cancel instead — reading goes nowhere once the run
// stops, and an inference stream stops spending.
func (f *flow) drains() bool {
	if f.tunnel || f.streaming.Load() {
		return false
	}
	_, noEffect := f.withoutEffect()
	return !noEffect
}

// flowSet is the registry of open flows, by run. It is the proxy's
// runwatch.Holder: the watcher hands it the rows of the runs it holds.
type flowSet struct {
	mu sync.Mutex
	// byRun is the first of each run's open flows, which link the others:
	// a run with one flow open at a time (an agent's requests one after
	// the other) costs no allocation a flow, as a set per run did.
	byRun   map[string]*flow
	metrics *telemetry.Metrics
	flows   prometheus.Gauge
	tunnels prometheus.Gauge
	// seen learns every row the watcher hands over.
	seen *seenRows
}

func newFlowSet(m *telemetry.Metrics) *flowSet {
	return &flowSet{
		byRun: map[string]*flow{}, metrics: m,
		flows: m.Open.WithLabelValues("flows"), tunnels: m.Open.WithLabelValues("tunnels"),
	}
}

func (s *flowSet) gauge(f *flow) prometheus.Gauge {
	if f.tunnel {
		return s.tunnels
	}
	return s.flows
}

func (s *flowSet) add(f *flow) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if f.open {
		return
	}
	first := s.byRun[f.id.run]
	f.open, f.prev, f.next = true, nil, first
	if first != nil {
		first.prev = f
	}
	s.byRun[f.id.run] = f
	s.gauge(f).Inc()
}

func (s *flowSet) remove(f *flow) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !f.open {
		return
	}
	if f.next != nil {
		f.next.prev = f.prev
	}
	switch {
	case f.prev != nil:
		f.prev.next = f.next
	case f.next != nil:
		s.byRun[f.id.run] = f.next
	default:
		delete(s.byRun, f.id.run)
		// The run's last connection here is gone: if a cancel cut it, that
		// is how long the cancel took to reach all of this instance.
		if ce := f.cutBy.Load(); ce != nil {
			s.metrics.LastCut("proxy", ce.cancelledAt)
		}
	}
	f.open, f.prev, f.next = false, nil, nil
	s.gauge(f).Dec()
}

// Holds reports whether a flow of run is open.
func (s *flowSet) Holds(run string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.byRun[run] != nil
}

// Runs lists the runs with open flows.
func (s *flowSet) Runs() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Collect(maps.Keys(s.byRun))
}

// Enforce applies the run's row to its open flows: nothing while ACTIVE;
// while CANCELLING, tunnels, streams and safe requests are cut at once and
// unsafe requests may finish until the drain deadline (delivery
// destinations until the run leaves CANCELLING); once the run is over,
// everything left is cut, but for answers to unsafe requests still on
// their way back, which keep their drain. The watcher reads the row again
// at the drain deadline.
func (s *flowSet) Enforce(run state.Run) {
	if s.seen != nil {
		s.seen.learn(run)
	}
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	for f := s.byRun[run.ID]; f != nil; f = f.next {
		if reason := cutReason(f, run, now); reason != "" {
			f.stop(&cutError{reason: reason, cancelledAt: run.CancelledAt})
		}
	}
}

// cutReason says why f must be cut now ("" if not).
func cutReason(f *flow, run state.Run, now time.Time) string {
	if run.Status == state.StatusActive {
		return ""
	}
	draining := now.Before(run.DrainDeadline)
	// The effect has happened: its answer may reach the agent, whatever the
	// run became meanwhile (drained runs are CANCELLED at once).
	if f.drains() && f.answered.Load() && draining {
		return ""
	}
	if run.Over() {
		return state.ReasonRunOver(run.Status)
	}
	_, noEffect := f.withoutEffect()
	switch {
	case f.allowCancelling:
		return ""
	case f.tunnel:
		return state.ReasonRunCancelled + ": pass-through tunnel"
	case f.streaming.Load():
		return state.ReasonRunCancelled + ": upgraded connection"
	case noEffect && f.effects == effectsNone:
		return state.ReasonRunCancelled + ": destination without effects"
	case noEffect:
		return state.ReasonRunCancelled + ": safe request"
	case !draining:
		return state.ReasonDrainTimeout
	}
	return ""
}

func (s *flowSet) cutAll(reason string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, first := range s.byRun {
		for f := first; f != nil; f = f.next {
			f.stop(&cutError{reason: reason})
		}
	}
}
