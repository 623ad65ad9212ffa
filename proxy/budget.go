package proxy

import (
	"fmt"
	"net/http"
	"net/url"
	"time"

	"github.com/stopgate/stopgate/llmusage"
	"github.com/stopgate/stopgate/policy"
	"github.com/stopgate/stopgate/state"
)

// What of the policy's budgets, LLM APIs and tripwires the proxy applies
// (docs/budgets.md). The limits themselves are kept and counted by the
// store, in the guard's and the outcome's own steps: the proxy only
// names what the guard needs (the body's size, a tripwire met, the budget
// of a run it admits) and reads what an answer used.

// tripwire is one of the policy's tripwires, ready to match.
type tripwire struct {
	name    string
	hosts   policy.HostSet
	methods []string
	paths   []string
}

// llmProvider is one API shape's hosts.
type llmProvider struct {
	api   llmusage.API
	hosts policy.HostSet
}

// budgetRules are the parts of Rules that budgets and tripwires take.
type budgetRules struct {
	// Budgets are the policy's budgets, given to the runs the proxy
	// admits itself (auto-admit).
	Budgets policy.Budgets
	// CancelDrain is the drain of a cancel the proxy's guard makes
	// (a tripwire), and of a budget's when the policy sets none: serve's
	// --drain-timeout.
	CancelDrain time.Duration
	tripwires   []tripwire
	providers   []llmProvider
	prices      llmusage.Prices
}

func compileBudgetRules(pol policy.Policy) (budgetRules, error) {
	b := budgetRules{Budgets: pol.Budgets}
	for _, tw := range pol.Tripwires {
		hosts, err := policy.NewHostSet(tw.Hosts)
		if err != nil {
			return budgetRules{}, fmt.Errorf("tripwires (%s): %w", tw.Name, err)
		}
		b.tripwires = append(b.tripwires, tripwire{name: tw.Name, hosts: hosts, methods: tw.Methods, paths: tw.Paths})
	}
	// The policy's providers first, so that a host it lists under
	// another shape is read as it says.
	for _, p := range append(append([]policy.Provider(nil), pol.LLM.Providers...), policy.DefaultProviders...) {
		hosts, err := policy.NewHostSet(p.Hosts)
		if err != nil {
			return budgetRules{}, fmt.Errorf("llm.providers: %w", err)
		}
		b.providers = append(b.providers, llmProvider{api: p.API, hosts: hosts})
	}
	prices, err := pol.LLM.PriceTable()
	if err != nil {
		return budgetRules{}, err
	}
	b.prices = prices
	return b, nil
}

// tripwireOf is the name of the first tripwire a request (or, with u nil,
// a pass-through tunnel to host, which only a tripwire of hosts alone can
// match) meets, "" for none.
func (b *budgetRules) tripwireOf(method, host string, u *url.URL) string {
	for i := range b.tripwires {
		tw := &b.tripwires[i]
		if tw.hosts.Len() > 0 {
			if !tw.hosts.Match(host) {
				continue
			}
		}
		if u == nil {
			if len(tw.methods) == 0 && len(tw.paths) == 0 {
				return tw.name
			}
			continue
		}
		if len(tw.methods) > 0 && !contains(tw.methods, method) {
			continue
		}
		if len(tw.paths) > 0 && !matchAny(tw.paths, u.EscapedPath()) {
			continue
		}
		return tw.name
	}
	return ""
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

func matchAny(patterns []string, path string) bool {
	if path == "" {
		path = "/"
	}
	for _, p := range patterns {
		if policy.MatchPath(p, path) {
			return true
		}
	}
	return false
}

// llmCall says whether a request is an LLM call, and of which API: a
// listed provider's generation endpoint (read: api set), or a request to a
// host no provider lists whose path is one the common APIs share (not
// read: unknown, never zero).
func (b *budgetRules) llmCall(method, host, path string) (api llmusage.API, call bool) {
	if method != http.MethodPost {
		return "", false
	}
	providers := b.providers
	if providers == nil {
		providers = defaultProviders
	}
	for _, p := range providers {
		if p.hosts.Match(host) {
			return p.api, llmusage.Endpoint(p.api, method, path)
		}
	}
	return "", llmusage.LooksLikeLLM(method, path)
}

// defaultProviders are policy.DefaultProviders, for rules made without a
// policy.
var defaultProviders = func() []llmProvider {
	b, err := compileBudgetRules(policy.Policy{})
	if err != nil {
		panic(err)
	}
	return b.providers
}()

// autoBudget is the budget of a run the proxy admits itself.
func (b *budgetRules) autoBudget(runID string) state.Budget {
	if !b.Budgets.Default.Budget().Limited() && len(b.Budgets.Rules) == 0 {
		return state.Budget{}
	}
	return b.Budgets.For(runID, nil, b.CancelDrain)
}

// metering is what the proxy reads of one answer for the run's usage: an
// LLM call's usage (api set: read; llm without api: unknown), and its
// bytes. An exchange that meters records its outcome when its answer is
// over, with what it read, rather than when the answer's headers come.
type metering struct {
	llm   bool
	api   llmusage.API
	meter *llmusage.Meter
	// bytes: the run has a budget of response bytes, or the answer is an
	// LLM call's.
	bytes bool
}

func (m *metering) on() bool { return m.llm || m.bytes }

// start readies the meter for the answer resp.
func (m *metering) start(resp *http.Response) {
	if m.llm && m.api != "" && resp.StatusCode/100 == 2 {
		m.meter = llmusage.New(m.api, resp.Header.Get("Content-Type"), resp.Header.Get("Content-Encoding"))
	}
}

// usage is what the answer used once it is over, priced by prices. An
// answer that was not a success is no LLM usage (the APIs do not bill a
// refusal); one whose usage could not be read is unknown.
func (m *metering) usage(status int, prices llmusage.Prices) *state.LLMUsage {
	if !m.llm || status/100 != 2 && status != 0 {
		return nil
	}
	u := state.LLMUsage{}
	if m.meter != nil {
		u = m.meter.Usage()
	}
	if u.Known {
		u.Spend, u.Priced = prices.Spend(u.Model, u.InputTokens, u.OutputTokens)
	}
	return &u
}
