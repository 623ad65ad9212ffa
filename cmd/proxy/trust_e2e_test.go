package main

import (
	"fmt"
	"os/exec"
	"strings"
	"testing"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
)

// agentCurl is a prompt-injected agent's request through the proxy as
// run:version: method to target, answering "<code>\n<body>" (for a
// CONNECT refused by the proxy, the CONNECT's code).
func agentCurl(t *testing.T, s *server, run, method, target string) (code, body string) {
	t.Helper()
	out, _ := exec.Command("curl", "-sS", "--noproxy", "", "-x", fmt.Sprintf("http://%s:1@%s", run, s.proxyAddr()),
		"-X", method, "-d", `{"reason":"injected"}`, "-w", "\n%{http_code} %{http_connect}", "--max-time", "20", target).Output()
	text := strings.TrimSpace(string(out))
	i := strings.LastIndex(text, "\n")
	codes := strings.Fields(text[i+1:])
	code = codes[0]
	if code == "000" && len(codes) > 1 {
		code = codes[1]
	}
	return code, strings.TrimSpace(text[:max(i, 0)])
}

// TestAgentCannotReachStopgateThroughItsProxy: with the flags stopgate
// ships with (on a Redis store), an agent behind the proxy tries to cancel
// another run through the control API, to talk to the store, and to reach a
// loopback port nobody allowed. Each is refused 403 destination_denied and
// recorded in the agent's run; nothing reached its target, and the run it
// tried to cancel is still ACTIVE. With loopback allowed for a provider,
// stopgate's own listeners and its store stay refused.
func TestAgentCannotReachStopgateThroughItsProxy(t *testing.T) {
	redis := redisserver.Start(t, redisserver.Options{})
	up, hits := upstreamCounter(t)
	for _, tc := range []struct {
		name  string
		start func(t *testing.T, args ...string) *server
		// provider is what a request to the loopback provider answers.
		provider string
	}{
		{"as shipped", startServeAsShipped, "403"},
		{"with loopback allowed", startServe, "200"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := tc.start(t, "--store", redis.URL(), "--data-dir", t.TempDir())
			victim, agent := "victim-"+strings.ReplaceAll(tc.name, " ", "-"), "agent-"+strings.ReplaceAll(tc.name, " ", "-")
			s.must(t, 0, "admit", victim)
			s.must(t, 0, "admit", agent)
			before := hits.Load()
			for _, try := range []struct {
				what, method, target, want string
			}{
				{"cancel another run through the control API", "POST", s.control + "/v1/runs/" + victim + "/cancel", "403"},
				{"complete another run through the control API", "POST", s.control + "/v1/runs/" + victim + "/complete", "403"},
				{"the control API over a CONNECT", "POST", strings.Replace(s.control, "http://", "https://", 1) + "/v1/runs/" + victim + "/cancel", "403"},
				{"the Redis store", "POST", "http://" + redis.Addr() + "/", "403"},
				{"the Redis store over a CONNECT", "POST", "https://" + redis.Addr() + "/", "403"},
				{"the browser guard", "GET", "http://" + s.Bound.Browser + "/json/version", "403"},
				{"a loopback provider", "POST", up.URL + "/charge", tc.provider},
			} {
				code, body := agentCurl(t, s, agent, try.method, try.target)
				if code != try.want {
					t.Errorf("%s: %s %s, want %s", try.what, code, body, try.want)
				}
				if try.want == "403" && body != "" && !strings.Contains(body, `"error":"destination_denied"`) {
					t.Errorf("%s: %s", try.what, body)
				}
			}
			if got := s.audit(t, victim); got.Run.Status != state.StatusActive || len(got.Intents) != 0 {
				t.Fatalf("the victim run was touched: %s with %+v", got.Run.Status, got.Intents)
			}
			doc := s.audit(t, agent)
			refused := 0
			for _, in := range doc.Intents {
				if in.State == state.IntentCancelledBeforeDispatch && in.Reason == "destination_denied" {
					refused++
				}
			}
			want := 6
			if tc.provider == "403" {
				want = 7
			}
			if refused != want {
				t.Fatalf("the agent's audit records %d destination refusals, want %d: %+v", refused, want, doc.Intents)
			}
			if got, wantHits := hits.Load()-before, map[string]int64{"403": 0, "200": 1}[tc.provider]; got != wantHits {
				t.Fatalf("the loopback provider saw %d requests, want %d", got, wantHits)
			}
			t.Logf("$ stopgate audit %s\n%s", agent, s.must(t, 0, "audit", agent))
		})
	}
}
