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
	// store is a stopgate case's store (embedded, everysec, always); empty
	// for the others.
	store string
	// before marks the before binary's cases (Config.Before).
	before bool
	// httpOnly targets (the peers) are measured in the plain-HTTP rows
	// only: they do not intercept HTTPS.
	httpOnly bool
	// divisor marks smokescreen: the second ratio of every row divides by it.
	divisor bool
	// missing says why the target is not measured (a peer the machine
	// could not have); it is still a row of the table.
	missing string
}

// measured says whether t takes part in scenario sc.
func (t target) measured(sc scenario) bool {
	return t.missing == "" && !(t.httpOnly && sc.tls)
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
	sg := func(key, store string, before bool, label string, g *stopgate, r *redisProc) target {
		return target{key: key, label: label, store: store, before: before, hasRedis: r != nil, proxy: g.proxyURL, spec: func(s *loadSpec) {
			s.Roots = g.roots
			s.RequireHeader = headerIntent
			s.Watch = []int{g.PID()}
			if r != nil {
				s.Watch = append(s.Watch, r.PID())
			}
		}}
	}
	out := []target{direct, base}
	for _, pt := range p.peers {
		t := target{key: pt.key, label: pt.label, httpOnly: true, divisor: pt.key == "smokescreen", missing: pt.why}
		if pt.proc != nil {
			proc := pt.proc
			// The same credentials as stopgate gets, as plain goproxy: the
			// peers ignore them, but read the same bytes.
			t.proxy = func(run string) *url.URL {
				return &url.URL{Scheme: "http", User: url.UserPassword(run, "1"), Host: proc.addr}
			}
			t.spec = func(s *loadSpec) { s.Watch = []int{proc.PID()} }
		}
		out = append(out, t)
	}
	type stopgateCase struct {
		store, name string
		g           *stopgate
		r           *redisProc
	}
	after := []stopgateCase{
		{"embedded", "embedded store", p.embedded, nil},
		{"everysec", "Redis everysec", p.sgEverysec, p.everysec},
		{"always", "Redis always", p.sgAlways, p.always},
	}
	var before []stopgateCase
	if b := p.before; b != nil {
		before = []stopgateCase{
			{"embedded", "embedded store", b.embedded, nil},
			{"everysec", "Redis everysec", b.sgEverysec, b.everysec},
			{"always", "Redis always", b.sgAlways, b.always},
		}
	}
	// Each before case just ahead of its after case: the two a
	// before-and-after ratio divides are measured moments apart.
	for i, c := range after {
		if before != nil {
			b := before[i]
			out = append(out, sg("before-"+b.store, b.store, true, e.cfg.beforeName()+", "+b.name, b.g, b.r))
		}
		out = append(out, sg(c.store, c.store, false, "stopgate, "+c.name, c.g, c.r))
	}
	return out
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
func (e *env) matrixPhase(ctx context.Context, p *mainProcs) ([]*table, error) {
	targets, scenarios := e.targets(p), e.scenarios()
	results := make([][][]loadResult, len(scenarios))
	total := 0
	for i, sc := range scenarios {
		results[i] = make([][]loadResult, len(targets))
		for _, t := range targets {
			if t.measured(sc) {
				total += e.cfg.Repeats
			}
		}
	}
	done := 0
	for rep := range e.cfg.Repeats {
		for si, sc := range scenarios {
			for ti, t := range targets {
				if !t.measured(sc) {
					continue
				}
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
	rows := e.summarizeMatrix(targets, scenarios, results)
	tables := []*table{e.matrixTable(targets, scenarios, rows), peersTable(targets, scenarios, rows)}
	if p.before != nil {
		tables = append(tables, e.beforeAfterTable(targets, scenarios, results, rows))
	}
	return tables, nil
}

// cell is one target in one scenario, summarized.
type cell struct {
	summary
	// ratioSmokescreen divides by smokescreen in the same repeats; N is 0
	// when smokescreen was not measured.
	ratioSmokescreen spread
	// p50Added is the median latency over plain goproxy's.
	p50Added time.Duration
	// cpuRatio is the proxy CPU over plain goproxy's; 0 if not known.
	cpuRatio float64
	measured bool
}

// summarizeMatrix turns the repeats into one cell per scenario and target,
// and leaves the figures the targets table reads.
func (e *env) summarizeMatrix(targets []target, scenarios []scenario, results [][][]loadResult) [][]cell {
	bi := slices.IndexFunc(targets, func(t target) bool { return t.baseline })
	si := slices.IndexFunc(targets, func(t target) bool { return t.divisor })
	out := make([][]cell, len(scenarios))
	for sci, sc := range scenarios {
		out[sci] = make([]cell, len(targets))
		base := summarize(results[sci][bi], nil)
		var smokescreen []loadResult
		if si >= 0 {
			smokescreen = results[sci][si]
		}
		for ti, tg := range targets {
			rs := results[sci][ti]
			if len(rs) == 0 {
				continue
			}
			c := cell{summary: summarize(rs, results[sci][bi]), measured: true}
			c.p50Added = c.p50 - base.p50
			if len(smokescreen) > 0 {
				c.ratioSmokescreen = summarize(rs, smokescreen).ratio
			}
			if len(rs[0].CPU) > 0 && base.proxyCPU > 0 {
				c.cpuRatio = c.proxyCPU / base.proxyCPU
			}
			key := fmt.Sprintf("%s/%d/%s", sc.key, sc.conns, tg.key)
			if !tg.baseline {
				e.figures.set("ratio/"+key, c.ratio.Median)
				e.figures.set("p50-added/"+key, c.p50Added.Seconds())
				if c.cpuRatio > 0 {
					e.figures.set("cpu-ratio/"+key, c.cpuRatio)
				}
			}
			if !tg.divisor && c.ratioSmokescreen.N > 0 {
				e.figures.set("ratio-smokescreen/"+key, c.ratioSmokescreen.Median)
			}
			if tg.hasRedis {
				e.figures.set("redis-cpu/"+key, c.redisCPU)
			}
			out[sci][ti] = c
		}
	}
	return out
}

// notMeasured is the first cell of a row that was not measured.
func notMeasured(why string) string { return "not measured: " + why }

func (e *env) matrixTable(targets []target, scenarios []scenario, cells [][]cell) *table {
	t := &table{
		title: "Per-request cost, side by side",
		left:  2,
		header: []string{"traffic", "case", "conns", "req/s (min–max)", "× plain goproxy", "× smokescreen", "p50", "p50 − goproxy", "p99",
			"proxy CPU µs/req", "× goproxy CPU", "redis CPU µs/req", "others' CPU", "errors"},
	}
	for si, sc := range scenarios {
		for ti, tg := range targets {
			if tg.httpOnly && sc.tls {
				continue
			}
			label := tg.label
			if sc.tls && tg.baseline {
				label = "plain goproxy MITM"
			}
			c := cells[si][ti]
			if !c.measured {
				// Why is in the short table below and the notes at the end:
				// here it would widen a column of numbers.
				row := []string{sc.label, label, fmt.Sprint(sc.conns), "not measured"}
				for len(row) < len(t.header) {
					row = append(row, "—")
				}
				t.add(row...)
				continue
			}
			row := []string{sc.label, label, fmt.Sprint(sc.conns), rateCell(c.rate), "—", "—", dur(c.p50), "—", dur(c.p99), "—", "—", "—", fmt.Sprintf("%.2f cores", c.others), fmt.Sprint(c.errors)}
			if !tg.baseline {
				row[4] = ratioCell(c.ratio)
				row[7] = signedDur(c.p50Added)
			}
			if !tg.divisor && c.ratioSmokescreen.N > 0 {
				row[5] = ratioCell(c.ratioSmokescreen)
			}
			if tg.proxy != nil {
				row[9] = micros(c.proxyCPU)
				if !tg.baseline && c.cpuRatio > 0 {
					row[10] = fmt.Sprintf("%.2f", c.cpuRatio)
				}
			}
			if tg.hasRedis {
				row[11] = micros(c.redisCPU)
			}
			t.add(row...)
		}
	}
	t.notes = append(t.notes,
		"Ratios are the median of per-repeat ratios (each repeat divides by plain goproxy, or by smokescreen, measured moments before); HTTPS rows divide by plain goproxy MITM. "+
			"CPU is utime+stime from /proc/PID/stat over the window ÷ requests completed in it (10 ms ticks); "+
			"others' CPU is what the rest of the machine used meanwhile (a noisy machine shows here). "+
			"Every stopgate answer was checked for "+headerIntent+" (guarded, not bypassed).",
		"The peers (smokescreen, Squid) are in the plain-HTTP rows only: neither intercepts HTTPS (smokescreen, as run here, tunnels CONNECT unopened; Debian's Squid has no ssl-bump), "+
			"so the HTTPS rows have no × smokescreen.")
	if e.cfg.Before != "" {
		t.notes = append(t.notes, e.cfg.beforeName()+" is the before binary ("+e.cfg.Before+"), started as the others with the same flags, each store on a data directory and redis-server of its own; "+
			"its ratios divide by plain goproxy as every row's do.")
	}
	if e.cfg.RunPerConn {
		t.notes = append(t.notes, "Every row puts all the connections of a measurement on one run, except \"a run per connection\": "+
			"there connection i is its own run (…-c<i>, admitted by its first request, in the warm-up), as a fleet with one agent per run sends, "+
			"so no two connections' requests are steps of the same run.")
	}
	return t
}

// peersTable is the plain-HTTP GET rows of the main table in short: every
// case beside plain goproxy and beside smokescreen.
func peersTable(targets []target, scenarios []scenario, cells [][]cell) *table {
	t := &table{
		title:  "Beside the peers: plain-HTTP GETs",
		left:   2,
		header: []string{"conns", "case", "× plain goproxy", "× smokescreen", "p50", "proxy CPU µs/req", "Redis CPU µs/req"},
	}
	median := func(s spread) string {
		if s.N == 0 {
			return "—"
		}
		return fmt.Sprintf("%.2f", s.Median)
	}
	for si, sc := range scenarios {
		if sc.tls || sc.method != http.MethodGet {
			continue
		}
		conns := fmt.Sprint(sc.conns)
		if sc.runPerConn {
			conns += ", a run each"
		}
		for ti, tg := range targets {
			c := cells[si][ti]
			if !c.measured {
				t.add(conns, tg.label, notMeasured(tg.missing), "—", "—", "—", "—")
				continue
			}
			row := []string{conns, tg.label, median(c.ratio), median(c.ratioSmokescreen), dur(c.p50), "—", "—"}
			if tg.baseline {
				row[2] = "1.00"
			}
			if tg.divisor {
				row[3] = "1.00"
			}
			if tg.proxy != nil {
				row[5] = micros(c.proxyCPU)
			}
			if tg.hasRedis {
				row[6] = micros(c.redisCPU)
			}
			t.add(row...)
		}
	}
	t.notes = append(t.notes, "Medians of the rows above. smokescreen (--allow-range 127.0.0.0/8, no egress ACL file) resolves each request's host, checks the address against its ranges and its ACL, and logs a canonical line; "+
		"Squid forwards with nothing cached and no access log; plain goproxy forwards and nothing else; stopgate records and guards every request.")
	return t
}

// beforeAfterTable sets each stopgate case beside the before binary's on
// the same store and traffic: the ratio of their rates, repeat by repeat
// (the two were measured moments apart), and what each costs.
func (e *env) beforeAfterTable(targets []target, scenarios []scenario, results [][][]loadResult, cells [][]cell) *table {
	t := &table{
		title: "Before and after",
		left:  3,
		header: []string{"traffic", "conns", "store", "after ÷ before req/s (min–max)", "× plain goproxy, before → after",
			"p50, before → after", "proxy CPU µs/req, before → after", "Redis CPU µs/req, before → after"},
	}
	storeName := map[string]string{"embedded": "embedded", "everysec": "Redis everysec", "always": "Redis always"}
	pair := func(before, after string) string { return before + " → " + after }
	ratio := func(s spread) string {
		if s.N == 0 {
			return "—"
		}
		return fmt.Sprintf("%.2f", s.Median)
	}
	for si, sc := range scenarios {
		for ai, at := range targets {
			if at.store == "" || at.before {
				continue
			}
			bi := slices.IndexFunc(targets, func(t target) bool { return t.before && t.store == at.store })
			if bi < 0 {
				continue
			}
			b, a := cells[si][bi], cells[si][ai]
			if !a.measured || !b.measured {
				t.add(sc.label, fmt.Sprint(sc.conns), storeName[at.store], "not measured", "—", "—", "—", "—")
				continue
			}
			row := []string{sc.label, fmt.Sprint(sc.conns), storeName[at.store],
				ratioCell(summarize(results[si][ai], results[si][bi]).ratio),
				pair(ratio(b.ratio), ratio(a.ratio)), pair(dur(b.p50), dur(a.p50)),
				pair(micros(b.proxyCPU), micros(a.proxyCPU)), "—"}
			if at.hasRedis {
				row[7] = pair(micros(b.redisCPU), micros(a.redisCPU))
			}
			t.add(row...)
		}
	}
	t.notes = append(t.notes, fmt.Sprintf("After is the stopgate under test (%s, commit %s), before is %s (%s): the same flags, each store on a data directory and redis-server of its own, "+
		"each before case measured just ahead of its after case in every repeat. after ÷ before is the median of per-repeat ratios of req/s (above 1.00: the after is faster); "+
		"a spread that holds 1.00 is a difference this run cannot tell from noise. The other columns are medians of the main table's rows.",
		e.cfg.Stopgate, orUnknown(e.cfg.Commit), e.cfg.beforeName(), e.cfg.Before))
	return t
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
