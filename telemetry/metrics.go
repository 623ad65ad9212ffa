package telemetry

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/stopgate/stopgate/state"
)

// Metrics are stopgate's own instruments. docs/metrics.md lists each with
// the event that moves it; labels are bounded (no run ids, no hosts).
type Metrics struct {
	decisions   *prometheus.CounterVec
	refusals    *prometheus.CounterVec
	cuts        *prometheus.CounterVec
	storeCalls  *prometheus.HistogramVec
	storeErrors *prometheus.CounterVec
	lastCut     *prometheus.HistogramVec
	drains      *prometheus.HistogramVec
	reloads     *prometheus.CounterVec
	reloadOK    prometheus.Gauge

	// Open counts what is open now, by kind: flows (requests in flight and
	// their answers), tunnels (pass-through CONNECTs), cdp (browser guard
	// connections), browsers.
	Open *prometheus.GaugeVec
}

// latencyBuckets span a loopback Redis round trip to a slow fsync.
var latencyBuckets = []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5}

func newMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "stopgate_decisions_total",
			Help: "Decisions at a boundary (http, tunnel, browser, claim, retry, custom, delivery) by result (admitted, refused, finished, cut, would_deny).",
		}, []string{"boundary", "result"}),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "stopgate_refusals_total",
			Help: "Refusals by boundary and reason code (docs/refusals.md).",
		}, []string{"boundary", "reason"}),
		cuts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "stopgate_cuts_total",
			Help: "Admitted effects cut before their end, by boundary and cause.",
		}, []string{"boundary", "cause"}),
		storeCalls: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "stopgate_store_seconds",
			Help:    "Time of store calls by store kind (file, redis) and operation (guard, outcome, cancel, get, tick, ...).",
			Buckets: latencyBuckets,
		}, []string{"store", "op"}),
		storeErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "stopgate_store_errors_total",
			Help: "Store calls that failed (unreachable, too slow, broken), by operation; refusals and conflicts are answers, not errors.",
		}, []string{"op"}),
		lastCut: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "stopgate_cancel_to_last_cut_seconds",
			Help:    "From a cancel's commit to the cut of the last connection of its run this instance held, by edge (proxy, browser).",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		}, []string{"edge"}),
		drains: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "stopgate_drain_seconds",
			Help:    "From a cancel's commit to the run leaving CANCELLING, by result (CANCELLED, UNKNOWN); its count is the drains.",
			Buckets: []float64{.01, .1, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600},
		}, []string{"result"}),
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "stopgate_policy_reloads_total",
			Help: "Reloads of the policy file (SIGHUP, POST /v1/policy/reload) by result: ok, or failed (the file did not parse or validate; the policy in force stayed).",
		}, []string{"result"}),
		reloadOK: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "stopgate_policy_last_reload_successful",
			Help: "1 if the last reload of the policy file succeeded (or none was tried), 0 if it failed: the file on disk is not the policy in force.",
		}),
		Open: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "stopgate_open",
			Help: "What this instance holds open now, by kind: flows, tunnels, cdp, browsers.",
		}, []string{"kind"}),
	}
	reg.MustRegister(m.decisions, m.refusals, m.cuts, m.storeCalls, m.storeErrors, m.lastCut, m.drains, m.reloads, m.reloadOK, m.Open)
	// Series an alert reads exist from the start, at 0: an increase() over
	// a counter that appears at its first event misses that event.
	for _, result := range []string{"ok", "failed"} {
		m.reloads.WithLabelValues(result)
	}
	m.reloadOK.Set(1)
	for _, op := range storeOps {
		m.storeErrors.WithLabelValues(op)
	}
	for _, result := range []string{string(state.StatusCancelled), string(state.StatusUnknown)} {
		m.drains.WithLabelValues(result)
	}
	return m
}

// storeOps are the operations the measured store counts (store.go).
var storeOps = []string{"admit", "cancel", "complete", "get", "guard", "outcome", "resolve", "note", "renew", "tick", "prune", "ping"}

// PolicyReloaded records a reload of the policy file: ok, or it failed and
// the policy in force stayed.
func (m *Metrics) PolicyReloaded(ok bool) {
	result, v := "ok", 1.0
	if !ok {
		result, v = "failed", 0
	}
	m.reloads.WithLabelValues(result).Inc()
	m.reloadOK.Set(v)
}

// LastCut records that the last connection of a run this instance held for
// edge was cut, cancelledAt being when the cancel committed.
func (m *Metrics) LastCut(edge string, cancelledAt time.Time) {
	if cancelledAt.IsZero() {
		return
	}
	m.lastCut.WithLabelValues(edge).Observe(time.Since(cancelledAt).Seconds())
}

// Drained records a run that left CANCELLING for result after took.
func (m *Metrics) Drained(result string, took time.Duration) {
	m.drains.WithLabelValues(result).Observe(took.Seconds())
}
