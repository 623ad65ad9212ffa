package main

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
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
func sseStream(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/event-stream")
	rc := http.NewResponseController(w)
	for i := 0; ; i++ {
		if _, err := fmt.Fprintf(w, "data: %d\n\n", i); err != nil || rc.Flush() != nil {
			return
		}
		select {
		case <-r.Context().Done():
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
}

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
	req, _ := http.NewRequest(http.MethodPost, s.control+"/v1/policy/reload", nil)
	req.Header.Set("Authorization", "Bearer "+s.operatorToken(t))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	t.Logf("POST /v1/policy/reload: %d %s", resp.StatusCode, body)
	if resp.StatusCode != http.StatusUnprocessableEntity || !strings.Contains(string(body), `"error":"policy_invalid"`) ||
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
