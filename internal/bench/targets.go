package bench

import (
	"fmt"
	"time"
)

// The targets of issue 9, checked against this run's figures so that a
// change to the store steps can be judged at a glance. A target whose
// figure was not measured (a skipped phase) says so.

// figures are the numbers the phases leave for the targets, by key.
type figures map[string]float64

func (f figures) set(key string, v float64) { f[key] = v }

type targetCheck struct {
	name, want string
	keys       []string
	// met decides from the figures named by keys, in order.
	met  func(v ...float64) bool
	show func(v ...float64) string
}

func ratioShow(v ...float64) string { return fmt.Sprintf("%.2f×", v[0]) }

func (e *env) targetTable(conns int) *table {
	f := e.figures
	n := fmt.Sprint(conns)
	atLeast := func(x float64) func(v ...float64) bool { return func(v ...float64) bool { return v[0] >= x } }
	checks := []targetCheck{
		{"Redis everysec, HTTP GET ×" + n, "≥ 0.6× plain goproxy", []string{"ratio/http/" + n + "/everysec"}, atLeast(0.6), ratioShow},
		{"Redis always, HTTP GET ×" + n, "≥ 0.5× plain goproxy", []string{"ratio/http/" + n + "/always"}, atLeast(0.5), ratioShow},
		{"embedded store, HTTP GET ×" + n, "≥ 0.4× plain goproxy", []string{"ratio/http/" + n + "/embedded"}, atLeast(0.4), ratioShow},
		{"HTTPS MITM, Redis everysec ×" + n, "≥ 0.6× plain goproxy MITM", []string{"ratio/https/" + n + "/everysec"}, atLeast(0.6), ratioShow},
		{"stopgate CPU per request (Redis everysec, HTTP GET ×" + n + ")", "≤ 1.5× plain goproxy's", []string{"cpu-ratio/http/" + n + "/everysec"},
			func(v ...float64) bool { return v[0] <= 1.5 }, ratioShow},
		{"Redis CPU per request (everysec, HTTP GET ×" + n + ")", "≤ 25 µs", []string{"redis-cpu/http/" + n + "/everysec"},
			func(v ...float64) bool { return v[0] <= 25 }, func(v ...float64) string { return micros(v[0]) + " µs" }},
	}
	for _, store := range []string{"everysec", "always"} {
		checks = append(checks, targetCheck{"one connection, Redis " + store + ": p50 added to plain goproxy", "≤ 2 PING round trips + 100 µs",
			[]string{"p50-added/http/1/" + store, "ping"},
			func(v ...float64) bool { return v[0] <= 2*v[1]+100e-6 },
			func(v ...float64) string {
				return fmt.Sprintf("%s (limit %s)", dur(time.Duration(v[0]*1e9)), dur(time.Duration((2*v[1]+100e-6)*1e9)))
			}})
	}
	checks = append(checks,
		targetCheck{"cancel acknowledged → last cut connection, 3 instances", "p99 ≤ 100 ms", []string{"cancel-p99"},
			func(v ...float64) bool { return v[0] <= 0.1 }, func(v ...float64) string { return dur(time.Duration(v[0] * 1e9)) }},
		targetCheck{"Redis: " + thousands(float64(e.cfg.StoredLarge)) + " runs stored vs " + thousands(float64(e.cfg.StoredSmall)), "≥ 0.9× (at most 10 % slower)",
			[]string{"stored-ratio/Redis everysec"}, atLeast(0.9), ratioShow},
		targetCheck{"embedded: " + thousands(float64(e.cfg.StoredLargeEmbedded)) + " runs stored vs " + thousands(float64(e.cfg.StoredSmall)), "≥ 0.9× (at most 10 % slower)",
			[]string{"stored-ratio/embedded store"}, atLeast(0.9), ratioShow},
	)
	t := &table{title: "Issue 9 targets, against this run", header: []string{"target", "wanted", "measured", "met"}, left: 2}
	for _, c := range checks {
		var v []float64
		for _, k := range c.keys {
			x, ok := f[k]
			if !ok {
				break
			}
			v = append(v, x)
		}
		if len(v) < len(c.keys) {
			t.add(c.name, c.want, "not measured", "—")
			continue
		}
		met := "no"
		if c.met(v...) {
			met = "yes"
		}
		t.add(c.name, c.want, c.show(v...), met)
	}
	t.notes = append(t.notes, "Medians of this run (ratios: median of per-repeat ratios). On a machine busy with other work (see others' CPU) a target can be missed or met by noise: repeat before concluding.")
	return t
}
