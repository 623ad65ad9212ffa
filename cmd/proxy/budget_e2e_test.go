package main

import (
	"bufio"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
)

// TestMaxEffectsFiveCancelsTheRunOnEveryInstance: two instances share a
// real redis-server. A run admitted with --max-effects 5 opens an SSE
// stream through instance B (its first effect) and makes four requests
// through instance A; the sixth effect is refused 409 budget_exceeded
// naming max_effects, the run is CANCELLING for budget:max_effects by
// stopgate, and B cuts the run's stream as for any cancel; the upstream
// got five requests. The audit is printed as an operator reads it.
func TestMaxEffectsFiveCancelsTheRunOnEveryInstance(t *testing.T) {
	redis := redisserver.Start(t, redisserver.Options{AppendFsyncAlways: true})
	common := []string{"--store", redis.URL(), "--sweep-interval", "200ms", "--drain-timeout", "10s"}
	a := startServe(t, append([]string{"--data-dir", t.TempDir()}, common...)...)
	b := startServe(t, append([]string{"--data-dir", t.TempDir()}, common...)...)
	up := testkit.NewUpstream(t, false, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/events" {
			sseStream(w, r)
			return
		}
		fmt.Fprint(w, "ok")
	})

	t.Logf("$ stopgate admit five --max-effects 5\n%s", a.must(t, 0, "admit", "five", "--max-effects", "5"))
	streamClient := b.proxyClient(t, "five")
	streamClient.Timeout = 0
	stream, err := streamClient.Get(up.URL + "/events")
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Body.Close()
	events := bufio.NewReader(stream.Body)
	readEvents(t, events, 2)

	c := a.proxyClient(t, "five")
	for i := 2; i <= 5; i++ {
		resp, err := c.Get(fmt.Sprintf("%s/step/%d", up.URL, i))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("effect %d of 5: %d", i, resp.StatusCode)
		}
	}
	resp, err := c.Post(up.URL+"/step/6", "application/json", strings.NewReader(`{"n":6}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	t.Logf("the 6th effect: %d %s: %s", resp.StatusCode, resp.Header.Get(refusal.Header), body)
	var r refusal.Refusal
	if err := json.Unmarshal(body, &r); err != nil || resp.StatusCode != http.StatusConflict || r.Code != refusal.BudgetExceeded ||
		r.Limit != state.LimitEffects || r.Run == nil || r.Run.Status != state.StatusCancelling || r.Recorded != state.IntentCancelledBeforeDispatch {
		t.Fatalf("the 6th effect: %d %s (%v)", resp.StatusCode, body, err)
	}
	if up.Hits.Load() != 5 {
		t.Fatalf("the upstream got %d requests, want 5", up.Hits.Load())
	}

	// Instance B heard the cancel and cut the run's stream: the client
	// reads an error, never a clean end.
	cut := make(chan error, 1)
	go func() {
		for {
			if _, err := events.ReadString('\n'); err != nil {
				cut <- err
				return
			}
		}
	}()
	select {
	case err := <-cut:
		if err == io.EOF {
			t.Fatalf("the stream on instance B ended cleanly, want an error")
		}
		t.Logf("the stream on instance B: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("instance B did not cut the run's stream within 10s of the budget's cancel")
	}

	var row state.Run
	testkit.Eventually(t, 10*time.Second, "the run CANCELLED once its stream's cut is recorded", func() bool {
		if err := json.Unmarshal([]byte(b.must(t, 0, "status", "five", "--json")), &row); err != nil {
			t.Fatal(err)
		}
		return row.Status == state.StatusCancelled
	})
	if row.Reason != "budget:max_effects" || row.CancelVersion != 2 || row.Usage[state.CounterEffects] != 5 {
		t.Fatalf("status --json: %+v", row)
	}
	t.Logf("$ stopgate status five\n%s", b.must(t, 0, "status", "five"))
	doc := a.audit(t, "five")
	var cancels, refusedForBudget, streamCut int
	for _, e := range doc.Events {
		switch {
		case e.Kind == state.EventRunCancelled:
			cancels++
			if e.Actor != state.ActorStopgate || e.Reason != "budget:max_effects" || e.To != "CANCELLING" {
				t.Fatalf("the cancel event %+v", e)
			}
		case e.Kind == state.EventIntentRefused && e.Reason == "budget:max_effects":
			refusedForBudget++
		case e.Kind == state.EventIntentCut:
			streamCut++
		}
	}
	if cancels != 1 || refusedForBudget != 1 || streamCut != 1 {
		t.Fatalf("audit: %d cancels, %d refused for the budget, %d cut streams; want 1 each:\n%+v", cancels, refusedForBudget, streamCut, doc.Events)
	}
	t.Logf("$ stopgate audit five\n%s", a.must(t, 0, "audit", "five"))
}

// llmPolicy lists the two fake providers and prices their models.
func llmPolicy(t *testing.T, openai, anthropic *testkit.LLM, extra string) string {
	t.Helper()
	hostOf := func(u string) string { p, _ := url.Parse(u); return p.Host }
	cfg := filepath.Join(t.TempDir(), "stopgate.yaml")
	writePolicy(t, cfg, fmt.Sprintf(`llm:
  providers:
    - api: openai
      hosts: [%q]
    - api: anthropic
      hosts: [%q]
  prices:
    "gpt-4o*": {input: 2.50, output: 10}
    claude-sonnet-4-5: {input: 3, output: 15}
%s`, hostOf(openai.URL), hostOf(anthropic.URL), extra))
	return cfg
}

// startLLMServe starts serve trusting the fake providers' certificates as
// it would a public provider's, with the policy at cfg.
func startLLMServe(t *testing.T, cfg string, providers ...*testkit.LLM) *server {
	t.Helper()
	var certs strings.Builder
	for _, p := range providers {
		certs.Write(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: p.Certificate().Raw}))
	}
	roots := filepath.Join(t.TempDir(), "providers.pem")
	writePolicy(t, roots, certs.String())
	return startServeWith(t, "", []string{"SSL_CERT_FILE=" + roots}, append(slices.Clone(allowTestUpstreams), "--data-dir", t.TempDir(), "--config", cfg)...)
}

func llmPost(t *testing.T, c *http.Client, target, body string) (int, string) {
	t.Helper()
	resp, err := c.Post(target, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestLLMTokensInStatusAreWhatTheProvidersReported: through the stopgate
// binary, an OpenAI-compatible and an Anthropic-shaped provider on
// loopback answer plain and streamed calls; `stopgate status --json`
// counts the run's input and output tokens, by model, as the sums the
// providers themselves reported, and prices them from the policy's table.
func TestLLMTokensInStatusAreWhatTheProvidersReported(t *testing.T) {
	openai := testkit.NewLLM(t, testkit.ShapeOpenAI, true)
	anthropic := testkit.NewLLM(t, testkit.ShapeAnthropic, true)
	s := startLLMServe(t, llmPolicy(t, openai, anthropic, ""), openai, anthropic)
	s.must(t, 0, "admit", "llm")
	c := s.proxyClient(t, "llm", openai.Certificate(), anthropic.Certificate())
	for _, call := range []struct{ target, body string }{
		{openai.URL + "/v1/chat/completions", `{"model":"gpt-4o","messages":[{"role":"user","content":"plan the run"}]}`},
		{openai.URL + "/v1/chat/completions", `{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"go"}]}`},
		{anthropic.URL + "/v1/messages", `{"model":"claude-sonnet-4-5","max_tokens":64,"messages":[{"role":"user","content":"check it"}]}`},
		{anthropic.URL + "/v1/messages", `{"model":"claude-sonnet-4-5","stream":true,"max_tokens":64,"messages":[{"role":"user","content":"stream it"}]}`},
	} {
		if code, body := llmPost(t, c, call.target, call.body); code != 200 || !strings.Contains(body, "stops") {
			t.Fatalf("%s: %d %s", call.target, code, body)
		}
	}
	var row state.Run
	testkit.Eventually(t, 5*time.Second, "the four answers' usage in the row", func() bool {
		if err := json.Unmarshal([]byte(s.must(t, 0, "status", "llm", "--json")), &row); err != nil {
			t.Fatal(err)
		}
		return row.Usage[state.CounterLLMCalls] == 4
	})
	t.Logf("$ stopgate status llm --json\n%s", s.must(t, 0, "status", "llm", "--json"))
	var in, out int64
	for _, p := range []*testkit.LLM{openai, anthropic} {
		for model, r := range p.Reported() {
			in, out = in+r[0], out+r[1]
			if m := row.Usage.Models()[model]; m.InputTokens != r[0] || m.OutputTokens != r[1] {
				t.Fatalf("model %s: status --json says %+v, the provider reported %d in, %d out", model, m, r[0], r[1])
			}
			t.Logf("provider reported %s: %d in, %d out", model, r[0], r[1])
		}
	}
	if row.Usage[state.CounterInputTokens] != in || row.Usage[state.CounterOutputTokens] != out || row.Usage[state.CounterUnknownUsage] != 0 {
		t.Fatalf("status --json: %d in, %d out, %d unknown; the providers reported %d in, %d out",
			row.Usage[state.CounterInputTokens], row.Usage[state.CounterOutputTokens], row.Usage[state.CounterUnknownUsage], in, out)
	}
	if row.Usage[state.CounterSpend] == 0 || row.Usage[state.CounterUnpriced] != 0 {
		t.Fatalf("spend %d nano-USD, %d unpriced", row.Usage[state.CounterSpend], row.Usage[state.CounterUnpriced])
	}
	t.Logf("$ stopgate status llm\n%s", s.must(t, 0, "status", "llm"))
}

// TestATokenBudgetCancelsTheRunThroughTheBinary: a run admitted with
// --max-tokens 40 makes streamed Anthropic calls of 25 tokens each: the
// second crosses the budget, reaches the agent whole, and cancels the run
// for budget:max_tokens in the step that records it; the third is refused
// before it leaves, and the provider never sees it.
func TestATokenBudgetCancelsTheRunThroughTheBinary(t *testing.T) {
	openai := testkit.NewLLM(t, testkit.ShapeOpenAI, true)
	anthropic := testkit.NewLLM(t, testkit.ShapeAnthropic, true)
	s := startLLMServe(t, llmPolicy(t, openai, anthropic, ""), openai, anthropic)
	s.must(t, 0, "admit", "tok", "--max-tokens", "40")
	c := s.proxyClient(t, "tok", openai.Certificate(), anthropic.Certificate())
	call := `{"model":"claude-sonnet-4-5","stream":true,"max_tokens":64,"messages":[]}`
	for i := range 2 {
		if code, body := llmPost(t, c, anthropic.URL+"/v1/messages", call); code != 200 || !strings.Contains(body, "message_stop") {
			t.Fatalf("call %d: %d %s", i+1, code, body)
		}
	}
	var row state.Run
	testkit.Eventually(t, 5*time.Second, "the run cancelled for budget:max_tokens", func() bool {
		if err := json.Unmarshal([]byte(s.must(t, 0, "status", "tok", "--json")), &row); err != nil {
			t.Fatal(err)
		}
		return row.Reason == "budget:max_tokens"
	})
	code, body := llmPost(t, c, anthropic.URL+"/v1/messages", call)
	if code != http.StatusConflict || !strings.Contains(body, "run_not_active") || anthropic.Hits.Load() != 2 {
		t.Fatalf("the call after the crossing: %d %s; the provider got %d calls", code, body, anthropic.Hits.Load())
	}
	r := anthropic.Reported()["claude-sonnet-4-5"]
	if row.Usage[state.CounterTokens] != r[0]+r[1] || row.Status == state.StatusActive {
		t.Fatalf("status --json: %+v; the provider reported %v", row, r)
	}
	t.Logf("$ stopgate status tok\n%s", s.must(t, 0, "status", "tok"))
	t.Logf("$ stopgate audit tok\n%s", s.must(t, 0, "audit", "tok"))
}
