package telemetry

import (
	"context"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/stopgate/stopgate/state"
)

// totalsTimeout bounds the store read of one scrape: a store that does not
// answer in time leaves the totals out of that scrape rather than holding
// the scrape up.
const totalsTimeout = 2 * time.Second

// Totals serves the store's totals (state.Totals) on every scrape, read
// from the store then: the runs by status and the intents UNKNOWN as
// gauges, the reconciliations by source as a counter. They are the whole
// store's, every instance's runs, so any one instance answers for the
// fleet. A scrape whose read fails leaves them out (and counts the failure
// in stopgate_store_errors_total, op totals): a missing series, not a
// wrong value.
func (t *Telemetry) Totals(reg prometheus.Registerer, s state.Store) {
	reg.MustRegister(&totalsCollector{store: s, log: t.log})
}

var (
	runsDesc = prometheus.NewDesc("stopgate_runs",
		"Runs in the store by status, every instance's (the store keeps the count in each transition's own step).",
		[]string{"status"}, nil)
	unknownDesc = prometheus.NewDesc("stopgate_intents_unknown",
		"Effects UNKNOWN in the store, awaiting reconciliation, every instance's.", nil, nil)
	resolutionsDesc = prometheus.NewDesc("stopgate_resolutions_total",
		"UNKNOWN effects reconciled, by source (operator, webhook, lookup, late_response, other), every instance's, since the store began keeping totals.",
		[]string{"source"}, nil)
)

type totalsCollector struct {
	store state.Store
	log   *slog.Logger
}

func (c *totalsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- runsDesc
	ch <- unknownDesc
	ch <- resolutionsDesc
}

func (c *totalsCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), totalsTimeout)
	defer cancel()
	totals, err := c.store.Totals(ctx)
	if err != nil {
		c.log.Debug("the store's totals are left out of this scrape", "err", err)
		return
	}
	for _, st := range state.Statuses {
		ch <- prometheus.MustNewConstMetric(runsDesc, prometheus.GaugeValue, float64(totals.Runs[st]), string(st))
	}
	ch <- prometheus.MustNewConstMetric(unknownDesc, prometheus.GaugeValue, float64(totals.UnknownIntents))
	for _, src := range state.ResolutionSources {
		ch <- prometheus.MustNewConstMetric(resolutionsDesc, prometheus.CounterValue, float64(totals.Resolutions[src]), src)
	}
}
