package telemetry

import "github.com/prometheus/client_golang/prometheus"

// Metrics are stopgate's own instruments. docs/metrics.md lists each with
// the event that moves it.
type Metrics struct {
	decisions    *prometheus.CounterVec
	refusals     *prometheus.CounterVec
	cuts         *prometheus.CounterVec
	storeLatency *prometheus.HistogramVec
	storeErrors  *prometheus.CounterVec

	// Open counts what is open now, by kind: flows (requests in flight and
	// streams), tunnels, cdp (browser guard connections), browsers.
	Open *prometheus.GaugeVec
}

func newMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "stopgate_decisions_total",
			Help: "Decisions at a boundary (http, tunnel, browser, claim, retry, custom, delivery) by result (admitted, refused, finished, cut).",
		}, []string{"boundary", "result"}),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "stopgate_refusals_total",
			Help: "Refusals by boundary and reason code.",
		}, []string{"boundary", "reason"}),
		cuts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "stopgate_cuts_total",
			Help: "Admitted effects cut before their end, by boundary and cause.",
		}, []string{"boundary", "cause"}),
		storeLatency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "stopgate_store_step_seconds",
			Help:    "Time of the store steps on a request's path: the guard and the outcome, by store kind.",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5},
		}, []string{"store", "step"}),
		storeErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "stopgate_store_errors_total",
			Help: "Store steps that failed (unreachable, too slow), by step.",
		}, []string{"step"}),
		Open: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "stopgate_open",
			Help: "What this instance holds open now, by kind: flows, tunnels, cdp, browsers.",
		}, []string{"kind"}),
	}
	reg.MustRegister(m.decisions, m.refusals, m.cuts, m.storeLatency, m.storeErrors, m.Open)
	return m
}

// StoreError counts a failed store step outside a decision (an outcome or
// a renewal that could not be written).
func (m *Metrics) StoreError(step string) { m.storeErrors.WithLabelValues(step).Inc() }
