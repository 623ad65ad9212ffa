package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/state"
)

// prometheusRule is deploy/monitoring/prometheusrule.yaml, the fields the
// Prometheus Operator reads, decoded strictly.
type prometheusRule struct {
	testkit.ObjectHead `yaml:",inline"`

	Spec struct {
		Groups []struct {
			Name  string `yaml:"name"`
			Rules []struct {
				Alert       string            `yaml:"alert"`
				Expr        string            `yaml:"expr"`
				For         string            `yaml:"for"`
				Labels      map[string]string `yaml:"labels"`
				Annotations map[string]string `yaml:"annotations"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	} `yaml:"spec"`
}

// monitoringExprs are every PromQL expression shipped, by where it is.
func monitoringExprs(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	var rules prometheusRule
	testkit.DecodeStrict(t, "../../deploy/monitoring/prometheusrule.yaml", &rules)
	if rules.APIVersion != "monitoring.coreos.com/v1" || rules.Kind != "PrometheusRule" || rules.Metadata.Namespace != "stopgate" {
		t.Fatalf("prometheusrule.yaml: %s %s in %q", rules.APIVersion, rules.Kind, rules.Metadata.Namespace)
	}
	for _, g := range rules.Spec.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" || r.Labels["severity"] == "" || r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
				t.Errorf("rule %q: want an alert name, a severity, a summary and a description", r.Alert)
			}
			if r.For != "" {
				if _, err := time.ParseDuration(r.For); err != nil {
					t.Errorf("rule %s: for %q: %v", r.Alert, r.For, err)
				}
			}
			out["alert "+r.Alert] = r.Expr
		}
	}
	b, err := os.ReadFile("../../deploy/monitoring/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Title  string `json:"title"`
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(b, &dash); err != nil || dash.Title == "" || len(dash.Panels) == 0 {
		t.Fatalf("grafana-dashboard.json: %v (%d panels)", err, len(dash.Panels))
	}
	for _, p := range dash.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for i, tg := range p.Targets {
			out["panel "+p.Title+" #"+string(rune('A'+i))] = tg.Expr
		}
	}
	return out
}

var metricName = regexp.MustCompile(`\bstopgate_[a-z0-9_]+`)

// balanced reports whether expr's brackets pair up: the syntax error a
// hand-edited expression most often has.
func balanced(expr string) bool {
	var stack []rune
	pairs := map[rune]rune{')': '(', ']': '[', '}': '{'}
	inString := false
	for _, c := range expr {
		switch {
		case c == '"':
			inString = !inString
		case inString:
		case c == '(' || c == '[' || c == '{':
			stack = append(stack, c)
		case pairs[c] != 0:
			if len(stack) == 0 || stack[len(stack)-1] != pairs[c] {
				return false
			}
			stack = stack[:len(stack)-1]
		}
	}
	return len(stack) == 0 && !inString
}

// servedFamilies are the metric families a real serve's /metrics lists.
func servedFamilies(t *testing.T, s *server) map[string]string {
	t.Helper()
	resp, err := http.Get(s.control + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out := map[string]string{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) == 4 && f[0] == "#" && f[1] == "TYPE" {
			out[f[2]] = f[3]
		}
	}
	return out
}

// family is the metric family a name in an expression belongs to: a
// histogram's _bucket, _sum and _count are its own.
func family(name string, served map[string]string) string {
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, suffix); ok && served[base] == "histogram" {
			return base
		}
	}
	return name
}

// TestMonitoringNamesWhatMetricsServes: every expression of the shipped
// alerts and dashboard names at least one stopgate metric, each of which a
// real serve lists on /metrics once it has refused, cut and drained (the
// store's totals included), with its brackets paired. That the PodMonitor
// scrapes the pods' metrics port is deploy's TestDeployPodMonitor.
func TestMonitoringNamesWhatMetricsServes(t *testing.T) {
	held := testkit.NewUpstream(t, false, func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
	s := startServe(t, "--data-dir", t.TempDir(), "--sweep-interval", "100ms")
	c := s.proxyClient(t, "watched")
	inFlight := make(chan error, 1)
	go func() {
		resp, err := c.Post(held.URL+"/charge", "application/json", strings.NewReader("{}"))
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		inFlight <- err
	}()
	testkit.Eventually(t, 5*time.Second, "the request upstream", func() bool { return held.Hits.Load() == 1 })
	s.must(t, 0, "cancel", "watched", "--drain", "0")
	<-inFlight
	if resp, err := c.Get(held.URL + "/after"); err == nil {
		resp.Body.Close()
	}
	testkit.Eventually(t, 5*time.Second, "the cut and the drain counted", func() bool {
		served := servedFamilies(t, s)
		_, cut := served["stopgate_cancel_to_last_cut_seconds"]
		return cut && s.metric(t, `stopgate_drain_seconds_count{result="UNKNOWN"}`) == 1
	})
	served := servedFamilies(t, s)

	exprs := monitoringExprs(t)
	names := map[string]bool{}
	for where, expr := range exprs {
		found := metricName.FindAllString(expr, -1)
		if len(found) == 0 {
			t.Errorf("%s: %q names no stopgate metric", where, expr)
		}
		if !balanced(expr) {
			t.Errorf("%s: %q: unpaired brackets or quotes", where, expr)
		}
		for _, n := range found {
			f := family(n, served)
			names[f] = true
			if _, ok := served[f]; !ok {
				t.Errorf("%s: %s is not on /metrics", where, n)
			}
		}
	}
	t.Logf("%d expressions name %d metrics: %v", len(exprs), len(names), slices.Sorted(func(yield func(string) bool) {
		for n := range names {
			if !yield(n) {
				return
			}
		}
	}))

}

// TestTotalsOnMetricsFollowARunThroughUnknown: a run whose effect was in
// flight at the end of its drain goes UNKNOWN, then is reconciled, and the
// store's totals on /metrics move with it: on the embedded store, read
// from the one instance; on Redis, read from a second instance that had
// no part in it (the totals are the store's, not the instance's).
func TestTotalsOnMetricsFollowARunThroughUnknown(t *testing.T) {
	redis := redisserver.Start(t, redisserver.Options{})
	for _, tc := range []struct {
		store string
		args  []string
		// second: a reader other than the instance the run went through.
		second bool
	}{
		{"embedded", nil, false},
		{"redis", []string{"--store", redis.URL()}, true},
	} {
		t.Run(tc.store, func(t *testing.T) {
			args := append([]string{"--data-dir", t.TempDir(), "--sweep-interval", "100ms"}, tc.args...)
			s := startServe(t, args...)
			reader := s
			if tc.second {
				reader = startServe(t, append([]string{"--data-dir", t.TempDir(), "--sweep-interval", "100ms"}, tc.args...)...)
			}
			totals := func() string {
				t.Helper()
				var lines []string
				for _, series := range []string{`stopgate_runs{status="ACTIVE"}`, `stopgate_runs{status="UNKNOWN"}`, `stopgate_runs{status="CANCELLED"}`,
					`stopgate_intents_unknown`, `stopgate_resolutions_total{source="operator"}`} {
					lines = append(lines, fmt.Sprintf("%s %v", series, reader.metric(t, series)))
				}
				return strings.Join(lines, "\n")
			}
			want := func(when string, active, unknown, cancelled, intents, resolved float64) {
				t.Helper()
				wanted := fmt.Sprintf("stopgate_runs{status=\"ACTIVE\"} %v\nstopgate_runs{status=\"UNKNOWN\"} %v\nstopgate_runs{status=\"CANCELLED\"} %v\nstopgate_intents_unknown %v\nstopgate_resolutions_total{source=\"operator\"} %v",
					active, unknown, cancelled, intents, resolved)
				var got string
				testkit.Eventually(t, 5*time.Second, when, func() bool { got = totals(); return got == wanted })
				t.Logf("%s, /metrics of %s:\n%s", when, map[bool]string{false: "the instance", true: "the second instance"}[tc.second], got)
			}

			want("before", 0, 0, 0, 0, 0)
			held := testkit.NewUpstream(t, false, func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
			c := s.proxyClient(t, "totals-run")
			done := make(chan struct{})
			go func() {
				defer close(done)
				if resp, err := c.Post(held.URL+"/charge", "application/json", strings.NewReader("{}")); err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			}()
			testkit.Eventually(t, 5*time.Second, "the charge upstream", func() bool { return held.Hits.Load() == 1 })
			want("a charge in flight", 1, 0, 0, 0, 0)
			s.must(t, 0, "cancel", "totals-run", "--drain", "0")
			<-done
			want("the drain ended with the charge unanswered", 0, 1, 0, 1, 0)
			doc := s.audit(t, "totals-run")
			var key string
			for _, in := range doc.Intents {
				if in.State == state.IntentUnknown {
					key = in.Key
				}
			}
			if key == "" {
				t.Fatalf("no UNKNOWN intent in the audit: %+v", doc.Intents)
			}
			s.must(t, 0, "resolve", "totals-run", key, "--not-applied", "--note", "no charge at the provider")
			want("reconciled by the operator", 0, 0, 1, 0, 1)
		})
	}
}
