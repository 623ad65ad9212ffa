package policy

import (
	"fmt"
	"net/http"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/stopgate/stopgate/llmusage"
	"github.com/stopgate/stopgate/state"
)

// Budgets are the limits runs are admitted with (docs/budgets.md): Default
// for every run, and the first rule that matches a run on top of it (a
// rule's limits replace the default's, the others stay). A budget given at
// admission goes on top of both. The budget is fixed in the run's row when
// it is admitted: a reload changes the budgets of runs admitted after it.
type Budgets struct {
	Default BudgetLimits `yaml:"default"`
	Rules   []BudgetRule `yaml:"rules"`
	// DrainTimeout is how long a run its budget cancels drains; zero
	// takes the server's --drain-timeout.
	DrainTimeout Duration `yaml:"drain_timeout"`
}

// BudgetRule gives the runs it matches their budget: a run whose id
// matches one of Runs (an id, or an id's start followed by *) and that
// was admitted with every one of Labels. A rule with neither matches
// every run.
type BudgetRule struct {
	Name   string            `yaml:"name"`
	Runs   []string          `yaml:"runs"`
	Labels map[string]string `yaml:"labels"`
	Budget BudgetLimits      `yaml:"budget"`
}

// BudgetLimits is a budget as the policy writes it; a limit not written is
// none. The spend is USD as a decimal ("5", "0.25"), durations are Go
// durations.
type BudgetLimits struct {
	MaxEffects               int64    `yaml:"max_effects"`
	MaxEffectsPerDestination int64    `yaml:"max_effects_per_destination"`
	MaxRequestBytes          int64    `yaml:"max_request_bytes"`
	MaxResponseBytes         int64    `yaml:"max_response_bytes"`
	MaxWallTime              Duration `yaml:"max_wall_time"`
	MaxInputTokens           int64    `yaml:"max_input_tokens"`
	MaxOutputTokens          int64    `yaml:"max_output_tokens"`
	MaxTokens                int64    `yaml:"max_tokens"`
	MaxSpendUSD              USD      `yaml:"max_spend_usd"`
	CancelOnUnknownUsage     bool     `yaml:"cancel_on_unknown_usage"`
}

// USD reads an amount of US dollars, kept in nano-USD.
type USD struct{ Nano int64 }

// UnmarshalYAML reads a decimal amount, written as a number or a string.
func (u *USD) UnmarshalYAML(n *yaml.Node) error {
	var s string
	if err := n.Decode(&s); err != nil {
		return fmt.Errorf("line %d: want an amount of USD like 5 or 0.25: %w", n.Line, err)
	}
	v, err := state.ParseUSD(s)
	if err != nil {
		return fmt.Errorf("line %d: %w", n.Line, err)
	}
	u.Nano = v
	return nil
}

// Budget is the limits as the store keeps them.
func (l BudgetLimits) Budget() state.Budget {
	return state.Budget{
		MaxEffects: l.MaxEffects, MaxEffectsPerDestination: l.MaxEffectsPerDestination,
		MaxRequestBytes: l.MaxRequestBytes, MaxResponseBytes: l.MaxResponseBytes, MaxWallTime: l.MaxWallTime.Duration,
		MaxInputTokens: l.MaxInputTokens, MaxOutputTokens: l.MaxOutputTokens, MaxTokens: l.MaxTokens,
		MaxSpend: l.MaxSpendUSD.Nano, CancelOnUnknownUsage: l.CancelOnUnknownUsage,
	}
}

// For is the budget a run is admitted with by the policy: the default,
// with the first rule that matches the run on top; drain is the server's
// --drain-timeout, the drain of a budget's cancel unless the policy sets
// one. A budget without a limit is none.
func (b Budgets) For(runID string, labels map[string]string, drain time.Duration) state.Budget {
	out := b.Default.Budget()
	for _, r := range b.Rules {
		if r.matches(runID, labels) {
			out = out.Over(r.Budget.Budget())
			break
		}
	}
	return b.withDrain(out, drain)
}

// withDrain gives a budget with limits its drain: the policy's, else drain.
func (b Budgets) withDrain(out state.Budget, drain time.Duration) state.Budget {
	if !out.Limited() {
		return state.Budget{}
	}
	if out.DrainTimeout == 0 {
		out.DrainTimeout = drain
		if b.DrainTimeout.Duration > 0 {
			out.DrainTimeout = b.DrainTimeout.Duration
		}
	}
	return out
}

// Admitted is the budget of a run admitted with given on top of what the
// policy gives it (For).
func (b Budgets) Admitted(runID string, labels map[string]string, given state.Budget, drain time.Duration) state.Budget {
	base := b.For(runID, labels, drain)
	if !given.Limited() && given.DrainTimeout == 0 {
		return base
	}
	return b.withDrain(base.Over(given), drain)
}

func (r BudgetRule) matches(runID string, labels map[string]string) bool {
	if len(r.Runs) > 0 {
		hit := false
		for _, p := range r.Runs {
			if prefix, ok := strings.CutSuffix(p, "*"); ok && strings.HasPrefix(runID, prefix) || p == runID {
				hit = true
				break
			}
		}
		if !hit {
			return false
		}
	}
	for k, v := range r.Labels {
		if labels[k] != v {
			return false
		}
	}
	return true
}

func (b Budgets) validate() error {
	if err := b.Default.Budget().Validate(); err != nil {
		return fmt.Errorf("budgets.default: %w", err)
	}
	names := map[string]bool{}
	for i, r := range b.Rules {
		where := fmt.Sprintf("budgets.rules[%d]", i)
		if r.Name == "" {
			return fmt.Errorf("%s: a rule needs a name", where)
		}
		if names[r.Name] {
			return fmt.Errorf("%s: name %q is given twice", where, r.Name)
		}
		names[r.Name] = true
		for _, p := range r.Runs {
			id := strings.TrimSuffix(p, "*")
			if strings.Contains(id, "*") || id != "" && state.ValidateRunID(id) != nil {
				return fmt.Errorf("%s (%s): runs entry %q: a run id, or a run id's start followed by one *", where, r.Name, p)
			}
		}
		if err := r.Budget.Budget().Validate(); err != nil {
			return fmt.Errorf("%s (%s): %w", where, r.Name, err)
		}
	}
	return nil
}

// LLM says which hosts are LLM APIs whose answers' usage the proxy reads,
// and what their models cost.
type LLM struct {
	// Providers list the hosts of each API shape. The public OpenAI and
	// Anthropic APIs are known without a listing (DefaultProviders).
	Providers []Provider `yaml:"providers"`
	// Prices are by model name (or a name's start followed by *): USD per
	// million input and output tokens.
	Prices map[string]ModelPrice `yaml:"prices"`
}

// Provider is one API shape's hosts (host, host:port or *.domain).
type Provider struct {
	API   llmusage.API `yaml:"api"`
	Hosts []string     `yaml:"hosts"`
}

// DefaultProviders are the providers known without a policy.
var DefaultProviders = []Provider{
	{API: llmusage.OpenAI, Hosts: []string{"api.openai.com"}},
	{API: llmusage.Anthropic, Hosts: []string{"api.anthropic.com"}},
}

// ModelPrice is a model's price in USD per million tokens, as decimals
// (numbers or strings), at most six decimals.
type ModelPrice struct {
	Input  string `yaml:"input"`
	Output string `yaml:"output"`
}

// PriceTable is the prices as llmusage reads them.
func (l LLM) PriceTable() (llmusage.Prices, error) {
	table := make(map[string]llmusage.Price, len(l.Prices))
	for model, p := range l.Prices {
		in, err := llmusage.ParsePerMillion(p.Input)
		if err != nil {
			return llmusage.Prices{}, fmt.Errorf("llm.prices.%s.input: %w", model, err)
		}
		out, err := llmusage.ParsePerMillion(p.Output)
		if err != nil {
			return llmusage.Prices{}, fmt.Errorf("llm.prices.%s.output: %w", model, err)
		}
		table[model] = llmusage.Price{Input: in, Output: out}
	}
	prices, err := llmusage.NewPrices(table)
	if err != nil {
		return llmusage.Prices{}, fmt.Errorf("llm.prices: %w", err)
	}
	return prices, nil
}

func (l LLM) validate() error {
	for i, p := range l.Providers {
		where := fmt.Sprintf("llm.providers[%d]", i)
		known := false
		for _, a := range llmusage.APIs {
			known = known || p.API == a
		}
		if !known {
			return fmt.Errorf("%s: api %q: want openai or anthropic", where, p.API)
		}
		if len(p.Hosts) == 0 {
			return fmt.Errorf("%s: list the provider's hosts", where)
		}
		for _, h := range p.Hosts {
			if _, err := ParseHostPattern(h); err != nil {
				return fmt.Errorf("%s: %w", where, err)
			}
		}
	}
	_, err := l.PriceTable()
	return err
}

// Tripwire is an effect a run must never make: the first effect that
// matches it is refused and recorded, and the run cancelled in the same
// step (reason tripwire:<name>). It matches an effect when each of its
// lists that is set has an entry that matches: Hosts (host, host:port or
// *.domain), Methods, Paths (the URL's path; * matches any run of
// characters, / included).
type Tripwire struct {
	Name    string   `yaml:"name"`
	Hosts   []string `yaml:"hosts"`
	Methods []string `yaml:"methods"`
	Paths   []string `yaml:"paths"`
}

func validateTripwires(ts []Tripwire) error {
	names := map[string]bool{}
	for i, tw := range ts {
		where := fmt.Sprintf("tripwires[%d]", i)
		if err := state.ValidateRuleName(tw.Name); err != nil {
			return fmt.Errorf("%s: %w", where, err)
		}
		if names[tw.Name] {
			return fmt.Errorf("%s: name %q is given twice", where, tw.Name)
		}
		names[tw.Name] = true
		if len(tw.Hosts) == 0 && len(tw.Paths) == 0 {
			return fmt.Errorf("%s (%s): give hosts or paths (methods alone would match every host)", where, tw.Name)
		}
		for _, h := range tw.Hosts {
			if _, err := ParseHostPattern(h); err != nil {
				return fmt.Errorf("%s (%s): %w", where, tw.Name, err)
			}
		}
		for _, m := range tw.Methods {
			if m == "" || strings.ToUpper(m) != m || strings.ContainsAny(m, " /") {
				return fmt.Errorf("%s (%s): method %q: want an HTTP method in capitals, like DELETE", where, tw.Name, m)
			}
			if m == http.MethodConnect {
				return fmt.Errorf("%s (%s): method CONNECT: a tunnel is matched by its host alone", where, tw.Name)
			}
		}
		for _, p := range tw.Paths {
			if !strings.HasPrefix(p, "/") || strings.Count(p, "*") > 4 {
				return fmt.Errorf("%s (%s): path %q: want a path starting with /, * (at most four) for any characters", where, tw.Name, p)
			}
		}
	}
	return nil
}

// MatchPath reports whether path matches pattern, where * matches any run
// of characters (/ included) and everything else itself.
func MatchPath(pattern, path string) bool {
	star := strings.IndexByte(pattern, '*')
	if star < 0 {
		return pattern == path
	}
	if !strings.HasPrefix(path, pattern[:star]) {
		return false
	}
	rest := pattern[star+1:]
	path = path[star:]
	for i := 0; i <= len(path); i++ {
		if MatchPath(rest, path[i:]) {
			return true
		}
	}
	return false
}
