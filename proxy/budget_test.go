package proxy_test

import (
	"context"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/llmusage"
	"github.com/stopgate/stopgate/policy"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
)

func (e *env) admitBudget(run string, b state.Budget) {
	e.t.Helper()
	if _, err := e.store.Admit(context.Background(), state.AdmitRequest{RunID: run, Actor: "test", Budget: b}); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) row(run string) state.Run {
	e.t.Helper()
	r, err := e.store.Get(context.Background(), run)
	if err != nil {
		e.t.Fatal(err)
	}
	return r
}

// TestTheEffectPastTheBudgetIsRefusedAndTheRunCancelled: the third request
// of a run with max_effects 2 never reaches the upstream; it is refused
// 409 budget_exceeded naming the limit, and the run is CANCELLING for
// budget:max_effects, so that what comes next is refused as after any
// cancel.
func TestTheEffectPastTheBudgetIsRefusedAndTheRunCancelled(t *testing.T) {
	testkit.OnBothStores(t, func(t *testing.T, store state.Store) {
		up := newUpstream(t, false, nil)
		e := newEnv(t, envOptions{store: store})
		e.admitBudget("b", state.Budget{MaxEffects: 2, DrainTimeout: time.Second})
		c := e.client("b", 1)
		for i := range 2 {
			if resp, _ := do(t, c, "GET", up.URL+"/x", nil, nil); resp.StatusCode != 200 {
				t.Fatalf("request %d of 2: %d", i+1, resp.StatusCode)
			}
		}
		resp, body := do(t, c, "POST", up.URL+"/x", strings.NewReader("third"), nil)
		if resp.StatusCode != http.StatusConflict || resp.Header.Get(refusal.Header) != "budget_exceeded" || resp.Header.Get(refusal.ShouldRetryHeader) != "false" {
			t.Fatalf("the third request: %d %v %s", resp.StatusCode, resp.Header, body)
		}
		if !strings.Contains(string(body), `"limit":"max_effects"`) || !strings.Contains(string(body), `"status":"CANCELLING"`) {
			t.Fatalf("the refusal does not name the limit and the run's cancel: %s", body)
		}
		if up.Hits.Load() != 2 {
			t.Fatalf("the upstream got %d requests, want 2", up.Hits.Load())
		}
		row := e.row("b")
		if row.Status != state.StatusCancelling && row.Status != state.StatusCancelled || row.Reason != "budget:max_effects" {
			t.Fatalf("run %+v", row)
		}
		if resp, _ := do(t, c, "GET", up.URL+"/x", nil, nil); resp.Header.Get(refusal.Header) != "run_not_active" {
			t.Fatalf("after the budget's cancel: %d %s", resp.StatusCode, resp.Header.Get(refusal.Header))
		}
	})
}

// TestATripwireRefusesTheEffectAndCancelsTheRun: a DELETE under /repos/
// meets the policy's tripwire: refused 409 tripwire, recorded, the run
// cancelled for tripwire:<rule>, the upstream never reached; a GET of the
// same path before it went through.
func TestATripwireRefusesTheEffectAndCancelsTheRun(t *testing.T) {
	up := newUpstream(t, true, nil)
	host := strings.TrimPrefix(up.URL, "https://")
	pol := policy.Policy{Tripwires: []policy.Tripwire{
		{Name: "no-paste", Hosts: []string{"paste.example"}},
		{Name: "no-repo-deletion", Hosts: []string{host}, Methods: []string{"DELETE"}, Paths: []string{"/repos/*"}},
	}}
	e := newEnv(t, envOptions{policy: &pol})
	e.admit("tw")
	c := e.client("tw", 1)
	if resp, _ := do(t, c, "GET", up.URL+"/repos/a/b", nil, nil); resp.StatusCode != 200 {
		t.Fatalf("GET: %d", resp.StatusCode)
	}
	resp, body := do(t, c, "DELETE", up.URL+"/repos/a/b", nil, nil)
	if resp.StatusCode != http.StatusConflict || resp.Header.Get(refusal.Header) != "tripwire" || !strings.Contains(string(body), `"tripwire":"no-repo-deletion"`) {
		t.Fatalf("DELETE: %d %s", resp.StatusCode, body)
	}
	if up.Hits.Load() != 1 {
		t.Fatalf("the upstream got %d requests, want the GET alone", up.Hits.Load())
	}
	row := e.row("tw")
	if row.Reason != "tripwire:no-repo-deletion" || row.Status == state.StatusActive {
		t.Fatalf("run %+v", row)
	}
	key := resp.Header.Get(refusal.IntentHeader)
	if in := e.intent("tw", key); in.State != state.IntentCancelledBeforeDispatch || in.Method != "DELETE" || in.Reason != "tripwire:no-repo-deletion" {
		t.Fatalf("the tripped effect is recorded %+v", in)
	}
}

// llmEnv is a proxy whose policy lists two fake providers on loopback.
func llmEnv(t *testing.T, store state.Store, openai, anthropic *testkit.LLM, prices map[string]policy.ModelPrice) *env {
	t.Helper()
	hostOf := func(u string) string { p, _ := url.Parse(u); return p.Host }
	pol := policy.Policy{LLM: policy.LLM{
		Providers: []policy.Provider{
			{API: llmusage.OpenAI, Hosts: []string{hostOf(openai.URL)}},
			{API: llmusage.Anthropic, Hosts: []string{hostOf(anthropic.URL)}},
		},
		Prices: prices,
	}}
	return newEnv(t, envOptions{store: store, policy: &pol})
}

func llmCall(t *testing.T, c *http.Client, target, body string, header http.Header) (*http.Response, string) {
	t.Helper()
	if header == nil {
		header = http.Header{}
	}
	header.Set("Content-Type", "application/json")
	resp, b := do(t, c, "POST", target, strings.NewReader(body), header)
	return resp, string(b)
}

// TestLLMUsageIsReadFromTheAnswersAsTheyPass: an OpenAI-compatible and an
// Anthropic-shaped provider, each answering plain and streamed: the run's
// tokens, by model, are the sum the providers reported; each was asked
// for an answer it could read; the spend is priced from the table.
func TestLLMUsageIsReadFromTheAnswersAsTheyPass(t *testing.T) {
	testkit.OnBothStores(t, func(t *testing.T, store state.Store) {
		openai := testkit.NewLLM(t, testkit.ShapeOpenAI, true)
		anthropic := testkit.NewLLM(t, testkit.ShapeAnthropic, true)
		e := llmEnv(t, store, openai, anthropic, map[string]policy.ModelPrice{"gpt-4o*": {Input: "2.50", Output: "10"}, "claude-x": {Input: "3", Output: "15"}})
		e.admit("llm")
		c := e.client("llm", 1)
		for _, call := range []struct{ target, body string }{
			{openai.URL + "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}`},
			{openai.URL + "/v1/chat/completions", `{"model":"gpt-4o-mini","stream":true,"stream_options":{"include_usage":true},"messages":[]}`},
			{anthropic.URL + "/v1/messages", `{"model":"claude-x","max_tokens":10,"messages":[{"role":"user","content":"hello"}]}`},
			{anthropic.URL + "/v1/messages", `{"model":"claude-x","stream":true,"max_tokens":10,"messages":[]}`},
		} {
			resp, body := llmCall(t, c, call.target, call.body, nil)
			if resp.StatusCode != 200 || !strings.Contains(body, "stops") {
				t.Fatalf("%s: %d %s", call.target, resp.StatusCode, body)
			}
		}
		var row state.Run
		testkit.Eventually(t, 5*time.Second, "the last answer's usage recorded", func() bool {
			row = e.row("llm")
			return row.Usage[state.CounterLLMCalls] == 4
		})
		var in, out int64
		for _, l := range []*testkit.LLM{openai, anthropic} {
			for model, r := range l.Reported() {
				in, out = in+r[0], out+r[1]
				if m := row.Usage.Models()[model]; m.InputTokens != r[0] || m.OutputTokens != r[1] || m.Calls != 2 {
					t.Errorf("model %s: stopgate counted %+v, the provider reported %v in 2 calls", model, m, r)
				}
			}
			for _, enc := range l.AcceptEncodings() {
				if enc != "identity" {
					t.Errorf("a metered call asked for %q, not an answer it can read", enc)
				}
			}
		}
		if row.Usage[state.CounterInputTokens] != in || row.Usage[state.CounterOutputTokens] != out || row.Usage[state.CounterUnknownUsage] != 0 {
			t.Fatalf("usage %v, the providers reported %d in, %d out", row.Usage, in, out)
		}
		want := int64(0)
		for model, r := range openai.Reported() {
			_ = model
			want += (r[0]*2_500_000 + r[1]*10_000_000 + 999) / 1000
		}
		for _, r := range anthropic.Reported() {
			want += (r[0]*3_000_000 + r[1]*15_000_000 + 999) / 1000
		}
		// Each answer's spend is rounded up on its own: at most one nano a call over.
		if got := row.Usage[state.CounterSpend]; got < want-4 || got > want+4 {
			t.Fatalf("spend %d nano-USD, want about %d", got, want)
		}
		if row.Usage[state.CounterResponseBytes] == 0 || row.Status != state.StatusActive {
			t.Fatalf("run %+v", row)
		}
		for _, in := range e.intents("llm") {
			if in.State != state.IntentResponded {
				t.Fatalf("an LLM call is %s once its answer is over", in.State)
			}
		}
	})
}

// TestUsageThatCannotBeReadIsUnknownNeverZero: a stream cut before its
// usage, a stream that was never asked for its usage, and a provider no
// entry lists each count as an unknown usage, with no tokens.
func TestUsageThatCannotBeReadIsUnknownNeverZero(t *testing.T) {
	openai := testkit.NewLLM(t, testkit.ShapeOpenAI, true)
	anthropic := testkit.NewLLM(t, testkit.ShapeAnthropic, true)
	unlisted := testkit.NewLLM(t, testkit.ShapeOpenAI, false)
	e := llmEnv(t, nil, openai, anthropic, nil)
	e.admit("u")
	c := e.client("u", 1)
	cut := http.Header{testkit.HeaderCut: {"1"}}
	llmCall(t, c, anthropic.URL+"/v1/messages", `{"model":"claude-x","stream":true}`, cut)
	llmCall(t, c, openai.URL+"/v1/chat/completions", `{"model":"gpt-4o","stream":true}`, nil)
	if resp, _ := llmCall(t, c, unlisted.URL+"/v1/chat/completions", `{"model":"gpt-4o"}`, nil); resp.StatusCode != 200 {
		t.Fatalf("the unlisted provider: %d", resp.StatusCode)
	}
	testkit.Eventually(t, 5*time.Second, "three unknown usages", func() bool {
		return e.row("u").Usage[state.CounterUnknownUsage] == 3
	})
	if u := e.row("u").Usage; u[state.CounterTokens] != 0 || u[state.CounterLLMCalls] != 0 {
		t.Fatalf("unknown usage counted as tokens: %v", u)
	}
}

// TestATokenBudgetCancelsTheRunAtTheAnswerThatCrossesIt: with max_tokens
// of 40 and answers of 25 tokens, the second answer reaches the
// agent whole (it has happened) and cancels the run in the step that
// records it; the third call is refused before it leaves.
func TestATokenBudgetCancelsTheRunAtTheAnswerThatCrossesIt(t *testing.T) {
	testkit.OnBothStores(t, func(t *testing.T, store state.Store) {
		openai := testkit.NewLLM(t, testkit.ShapeOpenAI, true)
		anthropic := testkit.NewLLM(t, testkit.ShapeAnthropic, true)
		e := llmEnv(t, store, openai, anthropic, nil)
		e.admitBudget("tok", state.Budget{MaxTokens: 40, DrainTimeout: time.Second})
		c := e.client("tok", 1)
		for i := range 2 {
			resp, body := llmCall(t, c, anthropic.URL+"/v1/messages", `{"model":"claude-x","stream":true}`, nil)
			if resp.StatusCode != 200 || !strings.Contains(body, "message_stop") {
				t.Fatalf("call %d: %d %s", i+1, resp.StatusCode, body)
			}
		}
		testkit.Eventually(t, 5*time.Second, "the run cancelled by its token budget", func() bool {
			return e.row("tok").Reason == "budget:max_tokens"
		})
		resp, body := llmCall(t, c, anthropic.URL+"/v1/messages", `{"model":"claude-x","stream":true}`, nil)
		if resp.StatusCode != http.StatusConflict || resp.Header.Get(refusal.Header) != "run_not_active" {
			t.Fatalf("the call after the crossing: %d %s", resp.StatusCode, body)
		}
		if anthropic.Hits.Load() != 2 {
			t.Fatalf("the provider got %d calls, want 2", anthropic.Hits.Load())
		}
		row := e.row("tok")
		reported := anthropic.Reported()["claude-x"]
		if row.Usage[state.CounterTokens] != reported[0]+reported[1] || row.Usage[state.CounterTokens] <= 40 {
			t.Fatalf("tokens %d, the provider reported %v", row.Usage[state.CounterTokens], reported)
		}
	})
}

// TestAResponseBytesBudgetCountsEveryAnswer: a run with max_response_bytes
// has every answer read to its end and counted; the answer that crosses
// the limit is the last.
func TestAResponseBytesBudgetCountsEveryAnswer(t *testing.T) {
	up := newUpstream(t, false, func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte(strings.Repeat("x", 400))) })
	e := newEnv(t, envOptions{})
	e.admitBudget("rb", state.Budget{MaxResponseBytes: 1000})
	c := e.client("rb", 1)
	for i := range 3 {
		if resp, body := do(t, c, "GET", up.URL+"/", nil, nil); resp.StatusCode != 200 || len(body) != 400 {
			t.Fatalf("answer %d: %d, %d bytes", i+1, resp.StatusCode, len(body))
		}
	}
	testkit.Eventually(t, 5*time.Second, "the run cancelled by its bytes", func() bool {
		return e.row("rb").Reason == "budget:max_response_bytes"
	})
	if u := e.row("rb").Usage; u[state.CounterResponseBytes] != 1200 {
		t.Fatalf("response bytes %d", u[state.CounterResponseBytes])
	}
}
