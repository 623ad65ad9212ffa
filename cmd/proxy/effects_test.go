package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
)

// These tests drive effects through the real binary's egress proxy with
// curl, as an unmodified agent would, and read the record back with the CLI.

func (s *server) proxyAddr() string { return s.Bound.Proxy }

// upstreamCounter is a provider on loopback that counts what reaches it;
// requests to /slow wait until the test ends.
func upstreamCounter(t *testing.T) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var hits atomic.Int64
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		if r.URL.Path == "/slow" {
			select {
			case <-release:
			case <-r.Context().Done():
			}
		}
		fmt.Fprintln(w, "done")
	}))
	t.Cleanup(func() { close(release); srv.Close() })
	return srv, &hits
}

// curl sends one POST through the proxy as run:version.
func curl(run string, version int, proxyAddr, target string) *exec.Cmd {
	return exec.Command("curl", "-sS", "--noproxy", "", "-x", fmt.Sprintf("http://%s:%d@%s", run, version, proxyAddr),
		"-X", "POST", "-d", "amount=1", "-w", "\n%{http_code}", "--max-time", "20", target)
}

func curlOK(t *testing.T, cmd *exec.Cmd) (code string, body string) {
	t.Helper()
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("curl: %v: %s", err, out)
	}
	text := strings.TrimSpace(string(out))
	i := strings.LastIndex(text, "\n")
	return text[i+1:], strings.TrimSpace(text[:max(i, 0)])
}

type auditDoc struct {
	Run     state.Run      `json:"run"`
	Intents []state.Intent `json:"intents"`
	Events  []state.Event  `json:"events"`
}

func (s *server) audit(t *testing.T, run string) auditDoc {
	t.Helper()
	var doc auditDoc
	if err := json.Unmarshal([]byte(s.must(t, 0, "audit", run, "--json")), &doc); err != nil {
		t.Fatalf("audit --json: %v", err)
	}
	return doc
}

func kinds(evs []state.Event) []string {
	var out []string
	for _, e := range evs {
		k := e.Kind
		if e.To != "" {
			k += ">" + e.To
		}
		out = append(out, k)
	}
	return out
}

func TestCurlThroughProxyThenCancelThenAudit(t *testing.T) {
	s := startServe(t, "--data-dir", t.TempDir())
	up, hits := upstreamCounter(t)
	s.must(t, 0, "admit", "w1")
	if code, body := curlOK(t, curl("w1", 1, s.proxyAddr(), up.URL+"/charge")); code != "200" || body != "done" {
		t.Fatalf("while ACTIVE: %s %s", code, body)
	}
	s.must(t, 0, "cancel", "w1", "--reason", "operator pressed stop")
	code, body := curlOK(t, curl("w1", 1, s.proxyAddr(), up.URL+"/charge"))
	if code != "409" || !strings.Contains(body, `"recorded":"CANCELLED_BEFORE_DISPATCH"`) {
		t.Fatalf("after cancel: %s %s", code, body)
	}
	if hits.Load() != 1 {
		t.Fatalf("upstream saw %d requests, want 1", hits.Load())
	}
	table := s.must(t, 0, "audit", "w1")
	for _, want := range []string{"RESPONDED", "CANCELLED_BEFORE_DISPATCH", "POST", "/charge", "run.cancel"} {
		if !strings.Contains(table, want) {
			t.Errorf("audit table lacks %q:\n%s", want, table)
		}
	}
	doc := s.audit(t, "w1")
	if len(doc.Intents) != 2 || doc.Intents[0].State != state.IntentResponded || doc.Intents[0].StatusCode != 200 || doc.Intents[1].State != state.IntentCancelledBeforeDispatch {
		t.Fatalf("audit intents %+v", doc.Intents)
	}
}

// TestKill9WhileCarryingSlowPOST: a sidecar dies with -9 in the middle of a
// POST. Its lease expires; the run, once cancelled, ends UNKNOWN, never
// CANCELLED, until an operator says what happened.
func TestKill9WhileCarryingSlowPOST(t *testing.T) {
	redis := redisserver.Start(t, redisserver.Options{AppendFsyncAlways: true})
	common := []string{"--store", redis.URL(), "--store-timeout", "300ms", "--lease-ttl", "1s", "--sweep-interval", "200ms"}
	a := startServe(t, append([]string{"--data-dir", t.TempDir()}, common...)...)
	b := startServe(t, append([]string{"--data-dir", t.TempDir()}, common...)...)
	up, hits := upstreamCounter(t)

	a.must(t, 0, "admit", "k1")
	inFlight := curl("k1", 1, a.proxyAddr(), up.URL+"/slow")
	if err := inFlight.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = inFlight.Process.Kill(); _ = inFlight.Wait() }()
	deadline := time.Now().Add(10 * time.Second)
	for hits.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if hits.Load() != 1 {
		t.Fatal("the slow POST never reached the upstream")
	}
	a.Kill9()

	code, out, errOut := b.stopgate(t, "cancel", "k1", "--reason", "operator stop", "--wait")
	if code != 3 || !strings.Contains(out, "UNKNOWN") || !strings.Contains(out, "lease_expired") {
		t.Logf("stderr: %s", errOut)
		t.Fatalf("cancel --wait summary: %s", out)
	}
	doc := b.audit(t, "k1")
	if doc.Run.Status != state.StatusUnknown || len(doc.Intents) != 1 {
		t.Fatalf("after the carrier died: %+v", doc)
	}
	in := doc.Intents[0]
	if in.State != state.IntentUnknown || in.Reason != state.ReasonLeaseExpired {
		t.Fatalf("the dead carrier's intent: %+v", in)
	}
	b.must(t, 0, "resolve", "k1", in.Key, "--not-applied", "--note", "provider shows no charge")
	doc = b.audit(t, "k1")
	if doc.Run.Status != state.StatusCancelled || doc.Intents[0].State != state.IntentNotApplied {
		t.Fatalf("after the resolution: run %s, intent %s", doc.Run.Status, doc.Intents[0].State)
	}
	want := []string{
		"run.admitted>ACTIVE", "intent.admitted>IN_FLIGHT", "run.cancel>CANCELLING", "intent.lease_expired>UNKNOWN",
		"run.transition>UNKNOWN", "intent.resolved>NOT_APPLIED", "run.transition>CANCELLED",
	}
	if got := kinds(doc.Events); strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("audit events\n got %v\nwant %v", got, want)
	}
	t.Logf("$ stopgate audit k1\n%s", b.must(t, 0, "audit", "k1"))
}

func TestDrainDeadlinePassesWithRequestInFlight(t *testing.T) {
	s := startServe(t, "--data-dir", t.TempDir(), "--sweep-interval", "100ms")
	up, hits := upstreamCounter(t)
	s.must(t, 0, "admit", "d1")
	inFlight := curl("d1", 1, s.proxyAddr(), up.URL+"/slow")
	var curlOut strings.Builder
	inFlight.Stdout = &curlOut
	if err := inFlight.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for hits.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	code, out, _ := s.stopgate(t, "cancel", "d1", "--drain", "500ms", "--wait")
	if code != 3 || !strings.Contains(out, "UNKNOWN (drain_timeout)") {
		t.Fatalf("cancel --wait summary does not say drain_timeout:\n%s", out)
	}
	_ = inFlight.Wait()
	if !strings.Contains(curlOut.String(), `"recorded":"UNKNOWN"`) {
		t.Fatalf("the client was not told its request was cut: %s", curlOut.String())
	}
	doc := s.audit(t, "d1")
	if doc.Run.Status != state.StatusUnknown || doc.Run.StatusReason != state.ReasonDrainTimeout {
		t.Fatalf("run %s (%s), want UNKNOWN (drain_timeout)", doc.Run.Status, doc.Run.StatusReason)
	}
	if in := doc.Intents[0]; in.State != state.IntentUnknown || in.Reason != state.ReasonDrainTimeout {
		t.Fatalf("intent %+v", in)
	}
}

// TestRequiredRunTokenThroughTheBinary: with --require-run-token a worker
// names its run only with the token stopgate issued; a bare version is 407.
func TestRequiredRunTokenThroughTheBinary(t *testing.T) {
	s := startServe(t, "--data-dir", t.TempDir(), "--run-token-secret", strings.Repeat("s", 32), "--require-run-token")
	up, hits := upstreamCounter(t)
	s.must(t, 0, "admit", "tk1")
	token := strings.TrimSpace(s.must(t, 0, "token", "tk1", "--ttl", "1h"))
	withToken := func() *exec.Cmd {
		return exec.Command("curl", "-sS", "--noproxy", "", "-x", "http://tk1:"+token+"@"+s.proxyAddr(),
			"-X", "POST", "-d", "amount=1", "-w", "\n%{http_code}", "--max-time", "20", up.URL+"/charge")
	}
	if code, body := curlOK(t, withToken()); code != "200" || body != "done" {
		t.Fatalf("with the token: %s %s", code, body)
	}
	if code, body := curlOK(t, curl("tk1", 1, s.proxyAddr(), up.URL+"/charge")); code != "407" || !strings.Contains(body, "a signed run token is required") {
		t.Fatalf("with a bare version: %s %s", code, body)
	}
	s.must(t, 0, "cancel", "tk1")
	if code, body := curlOK(t, withToken()); code != "409" || !strings.Contains(body, `"recorded":"CANCELLED_BEFORE_DISPATCH"`) {
		t.Fatalf("the token after the cancel: %s %s", code, body)
	}
	if hits.Load() != 1 {
		t.Fatalf("upstream saw %d requests, want 1", hits.Load())
	}
	if msg := s.must(t, 1, "token", "tk1"); !strings.Contains(msg, "run_not_active") {
		t.Fatalf("a token for the cancelled run: %q", msg)
	}
}
