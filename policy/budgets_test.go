package policy_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/llmusage"
	"github.com/stopgate/stopgate/policy"
	"github.com/stopgate/stopgate/state"
)

const budgetsPolicy = `
budgets:
  default: {max_effects: 1000, max_wall_time: 2h}
  drain_timeout: 45s
  rules:
    - name: ci
      runs: ["ci-*", nightly]
      budget: {max_effects: 50, max_tokens: 200000, max_spend_usd: "5.25"}
    - name: research
      labels: {team: research}
      budget: {max_spend_usd: 20, cancel_on_unknown_usage: true}
llm:
  providers:
    - api: openai
      hosts: [llm.internal:8000, "*.openai.azure.com"]
  prices:
    gpt-4o: {input: 2.50, output: "10"}
    "claude-sonnet-4*": {input: 3, output: 15}
tripwires:
  - name: no-paste
    hosts: [pastebin.com, "*.paste.ee"]
  - name: no-repo-deletion
    hosts: [api.github.com]
    methods: [DELETE]
    paths: ["/repos/*"]
`

func TestBudgetsAreTheDefaultWithTheFirstMatchingRuleOnTop(t *testing.T) {
	p, err := policy.Parse([]byte(budgetsPolicy))
	if err != nil {
		t.Fatal(err)
	}
	drain := 30 * time.Second
	for _, tc := range []struct {
		run    string
		labels map[string]string
		want   state.Budget
	}{
		{"r1", nil, state.Budget{MaxEffects: 1000, MaxWallTime: 2 * time.Hour, DrainTimeout: 45 * time.Second}},
		{"ci-42", nil, state.Budget{MaxEffects: 50, MaxWallTime: 2 * time.Hour, MaxTokens: 200000, MaxSpend: 5_250_000_000, DrainTimeout: 45 * time.Second}},
		{"nightly", map[string]string{"team": "research"}, state.Budget{MaxEffects: 50, MaxWallTime: 2 * time.Hour, MaxTokens: 200000, MaxSpend: 5_250_000_000, DrainTimeout: 45 * time.Second}},
		{"r2", map[string]string{"team": "research"}, state.Budget{MaxEffects: 1000, MaxWallTime: 2 * time.Hour, MaxSpend: 20 * state.NanoUSD, CancelOnUnknownUsage: true, DrainTimeout: 45 * time.Second}},
	} {
		if got := p.Budgets.For(tc.run, tc.labels, drain); got != tc.want {
			t.Errorf("For(%s, %v) = %+v, want %+v", tc.run, tc.labels, got, tc.want)
		}
	}
	// What the admission gives goes on top.
	got := p.Budgets.Admitted("ci-1", nil, state.Budget{MaxEffects: 5, DrainTimeout: time.Second}, drain)
	if got.MaxEffects != 5 || got.MaxTokens != 200000 || got.DrainTimeout != time.Second {
		t.Fatalf("admitted: %+v", got)
	}
	// Without a policy budget, a budget's drain is the server's.
	if got := (policy.Budgets{}).Admitted("x", nil, state.Budget{MaxEffects: 5}, drain); got.DrainTimeout != drain {
		t.Fatalf("no policy: %+v", got)
	}
	if got := (policy.Budgets{}).For("x", nil, drain); got.Limited() || got.DrainTimeout != 0 {
		t.Fatalf("no policy, no budget: %+v", got)
	}
	prices, err := p.LLM.PriceTable()
	if err != nil {
		t.Fatal(err)
	}
	if n, ok := prices.Spend("claude-sonnet-4-5", 1_000_000, 0); !ok || n != 3*state.NanoUSD {
		t.Fatalf("a million input tokens of claude-sonnet-4-5: %d %v", n, ok)
	}
	if len(p.Tripwires) != 2 || p.LLM.Providers[0].API != llmusage.OpenAI {
		t.Fatalf("%+v %+v", p.Tripwires, p.LLM)
	}
}

func TestBadBudgetsTripwiresAndPricesAreRefusedByName(t *testing.T) {
	for _, tc := range []struct{ doc, says string }{
		{"budgets: {default: {max_effects: -1}}", "budgets.default"},
		{"budgets: {default: {max_wall_time: soon}}", "duration"},
		{"budgets: {default: {max_spend_usd: -2}}", "USD"},
		{"budgets: {default: {max_tokns: 5}}", "max_tokns"},
		{"budgets: {rules: [{budget: {max_effects: 1}}]}", "needs a name"},
		{"budgets: {rules: [{name: a, runs: ['a*b']}]}", "runs entry"},
		{"llm: {providers: [{api: gemini, hosts: [x]}]}", "want openai or anthropic"},
		{"llm: {providers: [{api: openai}]}", "hosts"},
		{"llm: {prices: {m: {input: cheap, output: 1}}}", "llm.prices.m.input"},
		{"tripwires: [{name: 'bad name', hosts: [x]}]", "tripwires[0]"},
		{"tripwires: [{name: t, methods: [DELETE]}]", "hosts or paths"},
		{"tripwires: [{name: t, hosts: [x], methods: [delete]}]", "capitals"},
		{"tripwires: [{name: t, paths: [repos]}]", "starting with /"},
		{"tripwires: [{name: t, hosts: [a]}, {name: t, hosts: [b]}]", "twice"},
	} {
		_, err := policy.Parse([]byte(tc.doc))
		if err == nil || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%s: %v, want an error saying %q", tc.doc, err, tc.says)
		}
	}
}

func TestMatchPath(t *testing.T) {
	for _, tc := range []struct {
		pattern, path string
		want          bool
	}{
		{"/repos/*", "/repos/a/b", true},
		{"/repos/*", "/repos", false},
		{"/repos/*/hooks", "/repos/a/b/hooks", true},
		{"/repos/*/hooks", "/repos/a/b/hooks/1", false},
		{"/x", "/x", true},
		{"*", "/anything", true},
	} {
		if got := policy.MatchPath(tc.pattern, tc.path); got != tc.want {
			t.Errorf("MatchPath(%q, %q) = %v", tc.pattern, tc.path, got)
		}
	}
}
