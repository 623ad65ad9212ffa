package bench

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"
)

// headerIntent is on every answer stopgate forwards: the proof, checked on
// every request, that a measured request went through the guard.
const headerIntent = "X-Stopgate-Intent"

// target is one way of reaching the upstream.
type target struct {
	key, label string
	// baseline marks plain goproxy: the row every ratio divides by.
	baseline bool
	// proxy is the proxy URL with a run's credentials; nil goes direct.
	proxy func(run string) *url.URL
	// spec fills the roots, the required header and the watched processes
	// of a measurement.
	spec func(s *loadSpec)
	// redis, if set, is watched as the second process.
	hasRedis bool
}

// scenario is one kind of traffic at one connection count.
type scenario struct {
	key, label string
	tls        bool
	method     string
	conns      int
	// runPerConn gives each connection its own run, as a fleet with one
	// agent per run sends; otherwise every connection is on one run.
	runPerConn bool
}

func (e *env) targets(p *mainProcs) []target {
	direct := target{key: "direct", label: "direct (no proxy)", spec: func(s *loadSpec) {
		s.Roots = e.up.Roots
	}}
	base := target{key: "goproxy", label: "plain goproxy", baseline: true,
		// The same credentials as stopgate gets, so both parse the same bytes.
		proxy: func(run string) *url.URL {
			return &url.URL{Scheme: "http", User: url.UserPassword(run, "1"), Host: p.base.addr}
		},
		spec: func(s *loadSpec) {
			s.Roots = p.base.roots
			s.Watch = []int{p.base.PID()}
		}}
	sg := func(key, label string, g *stopgate, r *redisProc) target {
		return target{key: key, label: label, hasRedis: r != nil, proxy: g.proxyURL, spec: func(s *loadSpec) {
			s.Roots = g.roots
			s.RequireHeader = headerIntent
			s.Watch = []int{g.PID()}
			if r != nil {
				s.Watch = append(s.Watch, r.PID())
			}
		}}
	}
	return []target{
		direct, base,
		sg("embedded", "stopgate, embedded store", p.embedded, nil),
		sg("everysec", "stopgate, Redis everysec", p.sgEverysec, p.everysec),
		sg("always", "stopgate, Redis always", p.sgAlways, p.always),
	}
}

func (e *env) scenarios() []scenario {
	var out []scenario
	for _, n := range e.cfg.Conns {
		out = append(out, scenario{key: "http", label: "HTTP GET", method: http.MethodGet, conns: n})
	}
	if e.cfg.RunPerConn {
		out = append(out, scenario{key: "http-runs", label: "HTTP GET, a run per connection", method: http.MethodGet, conns: slices.Max(e.cfg.Conns), runPerConn: true})
	}
	for _, n := range e.cfg.Conns {
		out = append(out, scenario{key: "https", label: "HTTPS GET (MITM)", tls: true, method: http.MethodGet, conns: n})
	}
	if e.cfg.Post {
		out = append(out, scenario{key: "post", label: "HTTP POST 64 B", method: http.MethodPost, conns: slices.Max(e.cfg.Conns)})
	}
	return out
}

// postBodySize is the small POST's body size.
const postBodySize = 64

func (e *env) spec(sc scenario, t target, run string) loadSpec {
	s := loadSpec{Conns: sc.conns, Method: sc.method, URL: e.up.HTTPURL + "/small", Warmup: e.cfg.Warmup, Window: e.cfg.Window}
	if sc.tls {
		s.URL = e.up.HTTPSURL + "/small"
	}
	if sc.method == http.MethodPost {
		s.Body = []byte(strings.Repeat("x", postBodySize))
	}
	switch {
	case t.proxy == nil:
	case sc.runPerConn:
		s.ProxyFor = func(conn int) *url.URL { return t.proxy(connRun(run, conn)) }
	default:
		s.Proxy = t.proxy(run)
	}
	t.spec(&s)
	return s
}

// connRun is connection conn's own run in a measurement named run: letters,
// digits and dashes, as a run id must be.
func connRun(run string, conn int) string { return fmt.Sprintf("%s-c%d", run, conn) }

// matrixPhase is the main table: every scenario through every target,
// interleaved (repeat by repeat, scenario by scenario) so that each
// target meets the machine in the same moods as the baseline it is
// divided by.
func (e *env) matrixPhase(ctx context.Context, p *mainProcs) (*table, error) {
	targets, scenarios := e.targets(p), e.scenarios()
	results := make([][][]loadResult, len(scenarios))
	for i := range results {
		results[i] = make([][]loadResult, len(targets))
	}
	total, done := e.cfg.Repeats*len(scenarios)*len(targets), 0
	for rep := range e.cfg.Repeats {
		for si, sc := range scenarios {
			for ti, t := range targets {
				done++
				run := fmt.Sprintf("bench-%s-%d-%s-r%d", sc.key, sc.conns, t.key, rep)
				res, err := runLoad(ctx, e.spec(sc, t, run))
				if err != nil {
					return nil, fmt.Errorf("%s, %d conns, %s: %w", sc.label, sc.conns, t.label, err)
				}
				results[si][ti] = append(results[si][ti], res)
				e.cfg.logf("[%d/%d] %s ×%d %-26s %8.0f req/s  p50 %s  errors %d", done, total, sc.label, sc.conns, t.label, res.rate(), dur(percentile(res.Latencies, 50)), res.Errors)
				if res.Errors > 0 {
					e.cfg.logf("    first error: %s", res.FirstError)
				}
			}
		}
	}
	t := &table{
		title: "Per-request cost, side by side",
		left:  2,
		header: []string{"traffic", "case", "conns", "req/s (min–max)", "× plain goproxy", "p50", "p50 − goproxy", "p99",
			"proxy CPU µs/req", "× goproxy CPU", "redis CPU µs/req", "others' CPU", "errors"},
	}
	for si, sc := range scenarios {
		bi := slices.IndexFunc(targets, func(t target) bool { return t.baseline })
		base := summarize(results[si][bi], nil)
		for ti, tg := range targets {
			s := summarize(results[si][ti], results[si][bi])
			label := tg.label
			if sc.tls && tg.baseline {
				label = "plain goproxy MITM"
			}
			row := []string{sc.label, label, fmt.Sprint(sc.conns), rateCell(s.rate), "—", dur(s.p50), "—", dur(s.p99), "—", "—", "—", fmt.Sprintf("%.2f cores", s.others), fmt.Sprint(s.errors)}
			key := fmt.Sprintf("%s/%d/%s", sc.key, sc.conns, tg.key)
			if !tg.baseline {
				row[4] = ratioCell(s.ratio)
				row[6] = signedDur(s.p50 - base.p50)
				e.figures.set("ratio/"+key, s.ratio.Median)
				e.figures.set("p50-added/"+key, (s.p50 - base.p50).Seconds())
			}
			if len(results[si][ti][0].CPU) > 0 {
				row[8] = micros(s.proxyCPU)
				if !tg.baseline && base.proxyCPU > 0 {
					row[9] = fmt.Sprintf("%.2f", s.proxyCPU/base.proxyCPU)
					e.figures.set("cpu-ratio/"+key, s.proxyCPU/base.proxyCPU)
				}
			}
			if tg.hasRedis {
				row[10] = micros(s.redisCPU)
				e.figures.set("redis-cpu/"+key, s.redisCPU)
			}
			t.add(row...)
		}
	}
	t.notes = append(t.notes,
		"Ratios are the median of per-repeat ratios (each repeat divides by plain goproxy measured moments before); HTTPS rows divide by plain goproxy MITM. "+
			"CPU is utime+stime from /proc/PID/stat over the window ÷ requests completed in it (10 ms ticks); "+
			"others' CPU is what the rest of the machine used meanwhile (a noisy machine shows here). "+
			"Every stopgate answer was checked for "+headerIntent+" (guarded, not bypassed).")
	if e.cfg.RunPerConn {
		t.notes = append(t.notes, "Every row puts all the connections of a measurement on one run, except \"a run per connection\": "+
			"there connection i is its own run (…-c<i>, admitted by its first request, in the warm-up), as a fleet with one agent per run sends, "+
			"so no two connections' requests are steps of the same run.")
	}
	return t, nil
}

// summary is one row: medians over repeats.
type summary struct {
	rate, ratio        spread
	p50, p99           time.Duration
	proxyCPU, redisCPU float64
	others             float64
	errors             int
}

func summarize(rs, base []loadResult) summary {
	var s summary
	var rates, ratios, p50s, p99s, pcpu, rcpu, others []float64
	for i, r := range rs {
		rates = append(rates, r.rate())
		if base != nil && i < len(base) && base[i].rate() > 0 {
			ratios = append(ratios, r.rate()/base[i].rate())
		}
		p50s = append(p50s, float64(percentile(r.Latencies, 50)))
		p99s = append(p99s, float64(percentile(r.Latencies, 99)))
		if len(r.CPU) > 0 {
			pcpu = append(pcpu, r.perRequest(r.CPU[0]))
		}
		if len(r.CPU) > 1 {
			rcpu = append(rcpu, r.perRequest(r.CPU[1]))
		}
		others = append(others, r.Others.Seconds()/r.Elapsed.Seconds())
		s.errors += r.Errors
	}
	s.rate, s.ratio = spreadOf(rates), spreadOf(ratios)
	s.p50 = time.Duration(spreadOf(p50s).Median)
	s.p99 = time.Duration(spreadOf(p99s).Median)
	s.proxyCPU, s.redisCPU = spreadOf(pcpu).Median, spreadOf(rcpu).Median
	s.others = spreadOf(others).Median
	return s
}
