package proxy

import "github.com/prometheus/client_golang/prometheus"

// Collector exposes the proxy's counters to Prometheus.
func (p *Proxy) Collector() prometheus.Collector { return collector{p} }

type collector struct{ p *Proxy }

var (
	descRequests = prometheus.NewDesc("stopgate_proxy_requests_total",
		"Requests and tunnels by what the proxy did with them.", []string{"result"}, nil)
	descOpen = prometheus.NewDesc("stopgate_proxy_open_flows",
		"Effects this instance carries now (requests in flight, streams, tunnels).", nil, nil)
)

func (c collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descRequests
	ch <- descOpen
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	s := &c.p.stats
	for result, v := range map[string]int64{
		"forwarded":         s.Forwarded.Load(),
		"refused":           s.Refused.Load(),
		"store_unavailable": s.Unavailable.Load(),
		"cut":               s.Cut.Load(),
	} {
		ch <- prometheus.MustNewConstMetric(descRequests, prometheus.CounterValue, float64(v), result)
	}
	ch <- prometheus.MustNewConstMetric(descOpen, prometheus.GaugeValue, float64(c.p.flows.count()))
}
