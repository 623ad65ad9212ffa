package main

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/refusal"
)

// The tests of running stopgate for a fleet: an allow-list with report
// rules, policy reloads, the access log.

// proxyClient is an HTTP client of s's egress proxy under run at version
// 1, trusting s's CA and the extra roots (upstreams' own certificates).
func (s *server) proxyClient(t *testing.T, run string, extra ...*x509.Certificate) *http.Client {
	t.Helper()
	resp, err := http.Get(s.control + "/v1/ca")
	if err != nil {
		t.Fatal(err)
	}
	pem, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		t.Fatalf("GET /v1/ca: no certificate: %q", pem)
	}
	for _, c := range extra {
		roots.AddCert(c)
	}
	proxyURL := &url.URL{Scheme: "http", User: url.UserPassword(run, "1"), Host: s.proxyAddr()}
	return &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{
		Proxy: http.ProxyURL(proxyURL), TLSClientConfig: &tls.Config{RootCAs: roots}, DisableKeepAlives: true,
	}}
}

// metric reads one sample of s's /metrics by its name and labels as
// printed (`stopgate_decisions_total{boundary="http",result="would_deny"}`);
// -1 when it is not there.
func (s *server) metric(t *testing.T, series string) float64 {
	t.Helper()
	resp, err := http.Get(s.control + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), series+" "); ok {
			v, err := strconv.ParseFloat(rest, 64)
			if err != nil {
				t.Fatalf("%s: %v", sc.Text(), err)
			}
			return v
		}
	}
	return -1
}

func writePolicy(t *testing.T, path, text string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestAllowListRefusesUnlistedAndReportRuleForwardsAndCounts: under
// destinations.default deny, a destination no allow rule covers is
// refused (403 destination_denied, recorded, nothing reaches it); one a
// report rule covers is forwarded, with a would_deny line and count.
func TestAllowListRefusesUnlistedAndReportRuleForwardsAndCounts(t *testing.T) {
	listed := testkit.NewUpstream(t, false, nil)
	unlisted := testkit.NewUpstream(t, false, nil)
	reported := testkit.NewUpstream(t, false, nil)
	cfg := filepath.Join(t.TempDir(), "stopgate.yaml")
	writePolicy(t, cfg, fmt.Sprintf(`destinations:
  default: deny
  allow: [%q, %q]
  report: [%q]
`, listed.Listener.Addr(), reported.Listener.Addr(), reported.Listener.Addr()))
	s := startServeAsShipped(t, "--data-dir", t.TempDir(), "--config", cfg)
	c := s.proxyClient(t, "allow-list")

	get := func(u string) (*http.Response, string) {
		t.Helper()
		resp, err := c.Get(u + "/x")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}
	if resp, body := get(listed.URL); resp.StatusCode != 200 || listed.Hits.Load() != 1 {
		t.Fatalf("listed destination: %d %s", resp.StatusCode, body)
	}
	resp, body := get(unlisted.URL)
	t.Logf("unlisted: %d %s", resp.StatusCode, body)
	var r refusal.Refusal
	if err := json.Unmarshal([]byte(body), &r); err != nil || resp.StatusCode != http.StatusForbidden || r.Code != refusal.DestinationDenied ||
		!strings.Contains(r.Message, "destinations.default is deny") || r.Recorded != "CANCELLED_BEFORE_DISPATCH" || unlisted.Hits.Load() != 0 {
		t.Fatalf("unlisted destination: %d %s (%v), upstream hit %d times", resp.StatusCode, body, err, unlisted.Hits.Load())
	}
	if resp.Header.Get(refusal.ShouldRetryHeader) != "false" {
		t.Errorf("a destination refusal without %s: false", refusal.ShouldRetryHeader)
	}
	if resp, body := get(reported.URL); resp.StatusCode != 200 || reported.Hits.Load() != 1 {
		t.Fatalf("reported destination: %d %s", resp.StatusCode, body)
	}
	if n := s.metric(t, `stopgate_decisions_total{boundary="http",result="would_deny"}`); n != 1 {
		t.Errorf("would_deny counted %v times, want 1", n)
	}
	if n := s.metric(t, `stopgate_refusals_total{boundary="http",reason="destination_denied"}`); n != 1 {
		t.Errorf("destination_denied counted %v times, want 1", n)
	}
	testkit.Eventually(t, 2*time.Second, "the would_deny line", func() bool {
		return strings.Contains(s.Log(), "decision=would_deny") && strings.Contains(s.Log(), `rule="destinations.report (`+reported.Listener.Addr().String()+`)"`)
	})
	for _, line := range strings.Split(s.Log(), "\n") {
		if strings.Contains(line, "would_deny") || strings.Contains(line, "decision=refused") {
			t.Logf("serve: %s", line)
		}
	}
}

// sseStream answers an event every 50ms until the client goes.
var sseStream = testkit.Stream("text/event-stream", "data: %d\n\n", 50*time.Millisecond)

// readEvents reads n SSE data lines from r, failing the test on an error.
func readEvents(t *testing.T, r *bufio.Reader, n int) []string {
	t.Helper()
	var got []string
	for len(got) < n {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("the stream ended after %q: %v", got, err)
		}
		if strings.HasPrefix(line, "data: ") {
			got = append(got, strings.TrimSpace(line))
		}
	}
	return got
}

// TestSIGHUPReloadChangesPassThroughWithoutCuttingAnOpenStream: a SIGHUP
// makes a running serve read its policy again. A host moved into
// pass_through is tunnelled unseen from the next CONNECT on (the client
// sees the upstream's own certificate), while a stream opened before, and
// intercepted under the old rules, goes on; a file that does not parse
// keeps the policy in force, and the log, the metrics and the API say so.
func TestSIGHUPReloadChangesPassThroughWithoutCuttingAnOpenStream(t *testing.T) {
	up := testkit.NewUpstream(t, true, sseStream)
	cfg := filepath.Join(t.TempDir(), "stopgate.yaml")
	writePolicy(t, cfg, "pass_through: []\n")
	// serve trusts the HTTPS provider as it would trust a public one.
	upstreamCA := filepath.Join(t.TempDir(), "upstream.pem")
	writePolicy(t, upstreamCA, string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: up.Certificate().Raw})))
	s := startServeWith(t, "", []string{"SSL_CERT_FILE=" + upstreamCA}, append(slices.Clone(allowTestUpstreams), "--data-dir", t.TempDir(), "--config", cfg)...)
	c := s.proxyClient(t, "reload", up.Certificate())
	c.Timeout = 0

	peer := func(resp *http.Response) string {
		return resp.TLS.PeerCertificates[0].Issuer.String()
	}
	stream, err := c.Get(up.URL + "/events")
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Body.Close()
	before := peer(stream)
	if leaf := stream.TLS.PeerCertificates[0].Subject.String(); !strings.Contains(before, "stopgate") || !strings.Contains(leaf, "O=stopgate") {
		t.Fatalf("before the reload the stream is intercepted by stopgate: its certificate is %q, issued by %q", leaf, before)
	}
	events := bufio.NewReader(stream.Body)
	readEvents(t, events, 2)

	host := up.Listener.Addr().String()
	writePolicy(t, cfg, fmt.Sprintf("pass_through: [%q]\n", strings.Split(host, ":")[0]))
	if err := syscall.Kill(s.Pid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 5*time.Second, "the reload in the log", func() bool { return strings.Contains(s.Log(), "policy reloaded") })
	after, err := c.Get(up.URL + "/events")
	if err != nil {
		t.Fatal(err)
	}
	if got := peer(after); got == before || strings.Contains(got, "stopgate") {
		t.Fatalf("after the reload a new CONNECT is still intercepted: issuer %q", got)
	}
	after.Body.Close()
	// The stream opened under the old rules is not cut by the reload.
	got := readEvents(t, events, 5)
	t.Logf("the stream opened before the reload goes on: %q", got)
	if s.metric(t, `stopgate_policy_reloads_total{result="ok"}`) != 1 || s.metric(t, "stopgate_policy_last_reload_successful") != 1 {
		t.Errorf("the reload is not counted")
	}

	// A file that does not parse: the policy in force stays.
	writePolicy(t, cfg, "pass_thru: [oops]\n")
	if err := syscall.Kill(s.Pid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 5*time.Second, "the failed reload in the log", func() bool { return strings.Contains(s.Log(), "policy reload failed") })
	if s.metric(t, `stopgate_policy_reloads_total{result="failed"}`) != 1 || s.metric(t, "stopgate_policy_last_reload_successful") != 0 {
		t.Errorf("the failed reload is not counted")
	}
	code, body := s.asOperator(t, http.MethodPost, "/v1/policy/reload", "")
	t.Logf("POST /v1/policy/reload: %d %s", code, body)
	if code != http.StatusUnprocessableEntity || !strings.Contains(string(body), `"error":"policy_invalid"`) ||
		!strings.Contains(string(body), "pass_thru") || !strings.Contains(string(body), "stays as it was") {
		t.Fatalf("the API does not say why the reload failed")
	}
	still, err := c.Get(up.URL + "/events")
	if err != nil {
		t.Fatal(err)
	}
	still.Body.Close()
	if got := peer(still); strings.Contains(got, "stopgate") {
		t.Fatalf("after a failed reload the rules in force changed: issuer %q", got)
	}
	readEvents(t, events, 2)
	for _, line := range strings.Split(s.Log(), "\n") {
		if strings.Contains(line, "policy reload") {
			t.Logf("serve: %s", line)
		}
	}
}

// accessLines are the msg=access lines of a JSON log, decoded.
func accessLines(t *testing.T, log string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(log, "\n") {
		if !strings.Contains(line, `"msg":"access"`) {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("an access line that is not JSON: %v\n%s", err, line)
		}
		out = append(out, m)
	}
	return out
}

// TestAccessLogIsOneLinePerRequest: with --access-log, every proxied
// request gets one line at info when it ends, answered or refused, with
// its run, version, method, host, intent, recorded state, status, bytes
// each way, upstream latency and duration; in JSON, durations are integer
// nanoseconds (slog's), as docs/metrics.md shows.
func TestAccessLogIsOneLinePerRequest(t *testing.T) {
	up := testkit.NewUpstream(t, false, nil)
	s := startServe(t, "--data-dir", t.TempDir(), "--access-log", "--log-format", "json")
	c := s.proxyClient(t, "access")
	const sent = `{"amount":42}`
	resp, err := c.Post(up.URL+"/charge", "application/json", strings.NewReader(sent))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	s.must(t, 0, "cancel", "access")
	refused, err := c.Post(up.URL+"/charge", "application/json", strings.NewReader(sent))
	if err != nil {
		t.Fatal(err)
	}
	refused.Body.Close()

	var lines []map[string]any
	testkit.Eventually(t, 5*time.Second, "two access lines", func() bool {
		lines = accessLines(t, s.Log())
		return len(lines) == 2
	})
	for _, line := range strings.Split(s.Log(), "\n") {
		if strings.Contains(line, `"msg":"access"`) {
			t.Logf("serve: %s", line)
		}
	}
	answered, denied := lines[0], lines[1]
	for k, want := range map[string]any{
		"level": "INFO", "boundary": "http", "decision": "finished", "run": "access", "version": 1.0, "method": "POST",
		"host": up.Listener.Addr().String(), "intent": resp.Header.Get(refusal.IntentHeader), "recorded": "RESPONDED",
		"status": 200.0, "request_bytes": float64(len(sent)), "response_bytes": float64(len(got)),
	} {
		if answered[k] != want {
			t.Errorf("answered: %s = %v, want %v", k, answered[k], want)
		}
	}
	for _, k := range []string{"upstream_latency", "duration"} {
		if v, ok := answered[k].(float64); !ok || v <= 0 || v != float64(int64(v)) {
			t.Errorf("answered: %s = %v, want integer nanoseconds", k, answered[k])
		}
	}
	for k, want := range map[string]any{
		"decision": "refused", "reason": "run_not_active", "recorded": "CANCELLED_BEFORE_DISPATCH", "status": 409.0, "response_bytes": 0.0,
	} {
		if denied[k] != want {
			t.Errorf("refused: %s = %v, want %v", k, denied[k], want)
		}
	}
}

// TestMetricsListenerServesMetricsAlone: --metrics-addr serves /metrics
// and nothing of the control API, and the egress proxy never reaches it.
func TestMetricsListenerServesMetricsAlone(t *testing.T) {
	s := startServe(t, "--data-dir", t.TempDir(), "--metrics-addr", anyPort)
	addr := s.Bound.Metrics
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), "stopgate_policy_last_reload_successful") {
		t.Fatalf("GET /metrics on --metrics-addr: %d\n%.300s", resp.StatusCode, body)
	}
	for _, path := range []string{"/v1/runs", "/", "/v1/ca"} {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNotFound {
			t.Errorf("GET %s on --metrics-addr: %d, want 404", path, resp.StatusCode)
		}
	}
	through, err := s.proxyClient(t, "scrape").Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	through.Body.Close()
	if through.StatusCode != http.StatusForbidden || through.Header.Get(refusal.Header) != string(refusal.DestinationDenied) {
		t.Fatalf("the proxy reached the metrics listener: %d", through.StatusCode)
	}
}

// TestServeOnATakenPortWritesNothing: a listener that cannot be taken
// stops serve before it opens the store or writes a CA or a token, so the
// data directory is as it was.
func TestServeOnATakenPortWritesNothing(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	dir := filepath.Join(t.TempDir(), "data")
	code, _, errOut := runBinary(t, nil, "serve", "--data-dir", dir, "--proxy-addr", anyPort, "--browser-addr", anyPort,
		"--control-addr", taken.Addr().String())
	if code == 0 || !strings.Contains(errOut, "--control-addr") {
		t.Fatalf("serve on a taken port: exit %d\n%s", code, errOut)
	}
	if entries, err := os.ReadDir(dir); err == nil && len(entries) > 0 {
		t.Fatalf("serve wrote %v before failing on the taken port", entries)
	}
}

// TestRedisDownIsSaidOnceAWindow: while Redis is down the loops that retry
// it every second (the sweeper, the reconciler, the watch) and go-redis's
// own client say so in serve's format, once each per window, not several
// lines a second; a run admitted before keeps a draining loop busy.
func TestRedisDownIsSaidOnceAWindow(t *testing.T) {
	redis := redisserver.Start(t, redisserver.Options{})
	s := startServe(t, "--data-dir", t.TempDir(), "--store", redis.URL(), "--log-format", "json")
	s.must(t, 0, "admit", "busy")
	redis.Kill()
	time.Sleep(4 * time.Second)
	var warns []string
	for _, line := range strings.Split(s.Log(), "\n") {
		if strings.Contains(line, `"level":"WARN"`) || strings.Contains(line, `"level":"ERROR"`) {
			warns = append(warns, line)
		}
		if line != "" && !strings.HasPrefix(line, "{") {
			t.Errorf("a line not in serve's format: %s", line)
		}
	}
	t.Logf("%d warnings in 4 s with Redis down:\n%s", len(warns), strings.Join(warns, "\n"))
	kinds := map[string]int{}
	for _, w := range warns {
		var m map[string]any
		if err := json.Unmarshal([]byte(w), &m); err != nil {
			t.Fatal(err)
		}
		kinds[fmt.Sprint(m["component"], ": ", m["msg"])]++
	}
	for kind, n := range kinds {
		if n > 1 {
			t.Errorf("%q said %d times in 4 s; once a window is enough", kind, n)
		}
	}
}
