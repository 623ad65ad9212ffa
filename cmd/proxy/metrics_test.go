package main

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/testkit"
)

// scrape reads serve's /metrics (open, like the probes) as name{labels} →
// value; a histogram is read as its _count.
func (s *server) scrape(t *testing.T) map[string]float64 {
	t.Helper()
	resp, err := http.Get(s.control + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics: %s", resp.Status)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") || !strings.HasPrefix(line, "stopgate_") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			continue
		}
		out[line[:i]] = v
	}
	return out
}

// TestMetricsMoveWithTheirEvents drives a real stopgate serve through each
// event docs/metrics.md names, and reads each metric move on /metrics:
// decisions at every boundary but the browser's (browserguard tests those),
// refusals, cuts, the store's calls, what is open, the cancel's reach and
// the drain.
func TestMetricsMoveWithTheirEvents(t *testing.T) {
	tlsUp := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "tls ok") }))
	t.Cleanup(tlsUp.Close)
	up, _ := upstreamCounter(t)
	tunnelHost := strings.TrimPrefix(tlsUp.URL, "https://")
	policy := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(policy, []byte("pass_through:\n  - \""+tunnelHost+"\"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	s := startServe(t, "--data-dir", t.TempDir(), "--config", policy, "--sweep-interval", "100ms", "--recheck-interval", "100ms")
	t.Cleanup(func() {
		if t.Failed() {
			log := s.Log()
			t.Logf("serve log (last 8 KiB):\n%s", log[max(0, len(log)-8<<10):])
		}
	})
	before := s.scrape(t)
	s.must(t, 0, "admit", "m1")

	// http: admitted and finished.
	if code, _ := curlOK(t, curl("m1", 1, s.proxyAddr(), up.URL+"/m")); code != "200" {
		t.Fatalf("request through the proxy: %s", code)
	}
	// claim, retry, custom, delivery: through the control API.
	s.must(t, 0, "claim", "m1", "step-1", "--worker", "w")
	s.must(t, 0, "retry", "m1", "step-2", "1", "--at", time.Now().Add(time.Hour).UTC().Format(time.RFC3339))
	api := func(method, path, body string) {
		t.Helper()
		if code, b := s.asOperator(t, method, path, body); code/100 != 2 {
			t.Fatalf("%s %s: %d %s", method, path, code, b)
		}
	}
	api(http.MethodPost, "/v1/runs/m1/intents", `{"key":"mail-1","method":"SMTP"}`)
	api(http.MethodPatch, "/v1/runs/m1/intents/mail-1", `{"outcome":"responded"}`)
	api(http.MethodPost, "/v1/runs/m1/intents", `{"key":"hook-1","boundary":"delivery","allow_cancelling":true}`)
	api(http.MethodPatch, "/v1/runs/m1/intents/hook-1", `{"outcome":"responded"}`)

	// tunnel: a pass-through CONNECT held open by a kept-alive client.
	pool := x509.NewCertPool()
	pool.AddCert(tlsUp.Certificate())
	proxyURL := &url.URL{Scheme: "http", Host: s.proxyAddr(), User: url.UserPassword("m1", "1")}
	tc := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(proxyURL), TLSClientConfig: &tls.Config{RootCAs: pool}}, Timeout: 10 * time.Second}
	resp, err := tc.Get(tlsUp.URL + "/t")
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	testkit.Eventually(t, 5*time.Second, "the tunnel counted open", func() bool {
		return s.scrape(t)[`stopgate_open{kind="tunnels"}`] == 1
	})

	// The cancel cuts the tunnel; a claim is still in flight, so the run
	// drains only when its worker reports.
	s.must(t, 0, "cancel", "m1", "--reason", "metrics test")
	testkit.Eventually(t, 5*time.Second, "the tunnel cut", func() bool {
		return s.scrape(t)[`stopgate_open{kind="tunnels"}`] == 0
	})
	if code, _ := curlOK(t, curl("m1", 1, s.proxyAddr(), up.URL+"/after")); code != "409" {
		t.Fatalf("request after the cancel: %s, want 409", code)
	}
	api(http.MethodPatch, "/v1/runs/m1/intents/claim:step-1", `{"outcome":"not_sent"}`)
	// The tunnel was cut after its bytes left, which no one can see into:
	// the run ends UNKNOWN, its drain observed as such. The bound covers a
	// tunnel whose own report was lost on a loaded machine: its lease (15s)
	// then expires into the same UNKNOWN.
	testkit.Eventually(t, 30*time.Second, "the drain observed", func() bool {
		return s.scrape(t)[`stopgate_drain_seconds_count{result="UNKNOWN"}`] == 1
	})

	after := s.scrape(t)
	for _, series := range []string{
		`stopgate_decisions_total{boundary="http",result="admitted"}`,
		`stopgate_decisions_total{boundary="http",result="finished"}`,
		`stopgate_decisions_total{boundary="http",result="refused"}`,
		`stopgate_decisions_total{boundary="tunnel",result="admitted"}`,
		`stopgate_decisions_total{boundary="tunnel",result="cut"}`,
		`stopgate_decisions_total{boundary="claim",result="admitted"}`,
		`stopgate_decisions_total{boundary="claim",result="finished"}`,
		`stopgate_decisions_total{boundary="retry",result="admitted"}`,
		`stopgate_decisions_total{boundary="custom",result="admitted"}`,
		`stopgate_decisions_total{boundary="custom",result="finished"}`,
		`stopgate_decisions_total{boundary="delivery",result="admitted"}`,
		`stopgate_refusals_total{boundary="http",reason="run_not_active"}`,
		`stopgate_cuts_total{boundary="tunnel",cause="run_cancelled"}`,
		`stopgate_store_seconds_count{op="guard",store="file"}`,
		`stopgate_store_seconds_count{op="outcome",store="file"}`,
		`stopgate_store_seconds_count{op="cancel",store="file"}`,
		`stopgate_store_seconds_count{op="tick",store="file"}`,
		`stopgate_cancel_to_last_cut_seconds_count{edge="proxy"}`,
		`stopgate_drain_seconds_count{result="UNKNOWN"}`,
	} {
		if after[series] <= before[series] {
			t.Errorf("%s did not move: %v before, %v after", series, before[series], after[series])
		}
	}
	if t.Failed() {
		var names []string
		for k := range after {
			names = append(names, fmt.Sprintf("%s %v", k, after[k]))
		}
		t.Logf("all stopgate series:\n%s", strings.Join(names, "\n"))
	}
}
