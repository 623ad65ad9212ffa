package state

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Budget is a run's limits, fixed in its row when the run is admitted
// (from the policy, or given at admission) and never changed after: every
// instance that guards the run reads the same limits from the same row. A
// zero limit is no limit. Each is counted in the store's own atomic step
// (the guard's, or the outcome's), so that it holds exactly across a fleet
// sharing the store; the effect that would cross one is refused and the run
// is cancelled in that same step (docs/budgets.md).
type Budget struct {
	// MaxEffects bounds the effects the guard admits (every dispatch,
	// retries of a key included; refusals and scheduled retries are not
	// effects until dispatched).
	MaxEffects int64
	// MaxEffectsPerDestination bounds the effects to any one destination
	// (the host of an effect's target).
	MaxEffectsPerDestination int64
	// MaxRequestBytes bounds the request bodies the guard admits, summed.
	MaxRequestBytes int64
	// MaxResponseBytes bounds the answers' bodies, summed, counted at each
	// answer's end: the answer that crosses it is the last.
	MaxResponseBytes int64
	// MaxWallTime bounds the time since admission: no effect is admitted
	// after it, and the sweeper cancels a run that outlives it.
	MaxWallTime time.Duration
	// MaxInputTokens, MaxOutputTokens and MaxTokens (the two summed)
	// bound the LLM usage read from the answers.
	MaxInputTokens  int64
	MaxOutputTokens int64
	MaxTokens       int64
	// MaxSpend bounds the spend, in nano-USD (1e-9 USD), that the
	// operator's price table gives the LLM usage.
	MaxSpend int64
	// CancelOnUnknownUsage cancels the run at the first LLM answer whose
	// usage cannot be read (or, with MaxSpend, whose model has no price),
	// instead of counting it as unknown and going on.
	CancelOnUnknownUsage bool
	// DrainTimeout is how long a run its budget cancelled drains, as an
	// operator's cancel's drain_timeout.
	DrainTimeout time.Duration
}

// The limits a budget names, as they are spelt in the policy, the API and
// a cancel's reason (budget:<limit>).
const (
	LimitEffects               = "max_effects"
	LimitEffectsPerDestination = "max_effects_per_destination"
	LimitRequestBytes          = "max_request_bytes"
	LimitResponseBytes         = "max_response_bytes"
	LimitWallTime              = "max_wall_time"
	LimitInputTokens           = "max_input_tokens"
	LimitOutputTokens          = "max_output_tokens"
	LimitTokens                = "max_tokens"
	LimitSpend                 = "max_spend_usd"
	LimitUnknownUsage          = "unknown_usage"
)

// Refusals of the guard that cancel the run in the same step.
const (
	// RefusalBudgetExceeded: the effect would cross the run's budget.
	RefusalBudgetExceeded = "budget_exceeded"
	// RefusalTripwire: the effect matches a tripwire of the policy.
	RefusalTripwire = "tripwire"
)

// ActorStopgate is the actor of a cancel stopgate makes itself: a budget
// crossed, a tripwire met.
const ActorStopgate = "stopgate"

// BudgetReason and TripwireReason are the reasons of the cancels they make.
func BudgetReason(limit string) string  { return "budget:" + limit }
func TripwireReason(rule string) string { return "tripwire:" + rule }

// Limited reports whether b sets any limit.
func (b Budget) Limited() bool {
	c := b
	c.DrainTimeout = 0
	return c != Budget{}
}

// IsZero reports whether b sets no limit: the row shows no budget.
func (b Budget) IsZero() bool { return !b.Limited() }

// Over is b with every limit over sets replaced by over's.
func (b Budget) Over(over Budget) Budget {
	set := func(dst *int64, v int64) {
		if v != 0 {
			*dst = v
		}
	}
	set(&b.MaxEffects, over.MaxEffects)
	set(&b.MaxEffectsPerDestination, over.MaxEffectsPerDestination)
	set(&b.MaxRequestBytes, over.MaxRequestBytes)
	set(&b.MaxResponseBytes, over.MaxResponseBytes)
	set(&b.MaxInputTokens, over.MaxInputTokens)
	set(&b.MaxOutputTokens, over.MaxOutputTokens)
	set(&b.MaxTokens, over.MaxTokens)
	set(&b.MaxSpend, over.MaxSpend)
	if over.MaxWallTime != 0 {
		b.MaxWallTime = over.MaxWallTime
	}
	if over.DrainTimeout != 0 {
		b.DrainTimeout = over.DrainTimeout
	}
	b.CancelOnUnknownUsage = b.CancelOnUnknownUsage || over.CancelOnUnknownUsage
	return b
}

// Of is the value of one of b's limits as an operator writes it ("5",
// "30m0s", "2.5" USD), "" for a name that is none.
func (b Budget) Of(limit string) string {
	n := func(v int64) string { return strconv.FormatInt(v, 10) }
	switch limit {
	case LimitEffects:
		return n(b.MaxEffects)
	case LimitEffectsPerDestination:
		return n(b.MaxEffectsPerDestination)
	case LimitRequestBytes:
		return n(b.MaxRequestBytes)
	case LimitResponseBytes:
		return n(b.MaxResponseBytes)
	case LimitWallTime:
		return b.MaxWallTime.String()
	case LimitInputTokens:
		return n(b.MaxInputTokens)
	case LimitOutputTokens:
		return n(b.MaxOutputTokens)
	case LimitTokens:
		return n(b.MaxTokens)
	case LimitSpend:
		return FormatUSD(b.MaxSpend) + " USD"
	case LimitUnknownUsage:
		return "cancel_on_unknown_usage"
	}
	return ""
}

// MaxBudgetTime bounds a budget's wall time and drain.
const MaxBudgetTime = 366 * 24 * time.Hour

// Validate says what is wrong with b, naming the limit.
func (b Budget) Validate() error {
	for _, l := range []struct {
		name string
		v    int64
	}{
		{LimitEffects, b.MaxEffects}, {LimitEffectsPerDestination, b.MaxEffectsPerDestination},
		{LimitRequestBytes, b.MaxRequestBytes}, {LimitResponseBytes, b.MaxResponseBytes},
		{LimitInputTokens, b.MaxInputTokens}, {LimitOutputTokens, b.MaxOutputTokens}, {LimitTokens, b.MaxTokens},
		{LimitSpend, b.MaxSpend},
	} {
		if l.v < 0 {
			return fmt.Errorf("%w: budget %s is negative", ErrInvalid, l.name)
		}
	}
	if b.MaxWallTime < 0 || b.MaxWallTime > MaxBudgetTime {
		return fmt.Errorf("%w: budget %s %s: want 0 (none) to %s", ErrInvalid, LimitWallTime, b.MaxWallTime, MaxBudgetTime)
	}
	if b.MaxWallTime%time.Millisecond != 0 {
		return fmt.Errorf("%w: budget %s %s: the stores keep whole milliseconds", ErrInvalid, LimitWallTime, b.MaxWallTime)
	}
	if b.DrainTimeout < 0 || b.DrainTimeout > 7*24*time.Hour || b.DrainTimeout%time.Millisecond != 0 {
		return fmt.Errorf("%w: budget drain_timeout %s: want whole milliseconds, 0 to 7 days", ErrInvalid, b.DrainTimeout)
	}
	return nil
}

// budgetFields are the budget's fields as its text form names them.
var budgetFields = []struct {
	name string
	get  func(*Budget) *int64
}{
	{"e", func(b *Budget) *int64 { return &b.MaxEffects }},
	{"pd", func(b *Budget) *int64 { return &b.MaxEffectsPerDestination }},
	{"rq", func(b *Budget) *int64 { return &b.MaxRequestBytes }},
	{"rs", func(b *Budget) *int64 { return &b.MaxResponseBytes }},
	{"w", func(b *Budget) *int64 { return (*int64)(&b.MaxWallTime) }},
	{"ti", func(b *Budget) *int64 { return &b.MaxInputTokens }},
	{"to", func(b *Budget) *int64 { return &b.MaxOutputTokens }},
	{"t", func(b *Budget) *int64 { return &b.MaxTokens }},
	{"s", func(b *Budget) *int64 { return &b.MaxSpend }},
	{"dr", func(b *Budget) *int64 { return (*int64)(&b.DrainTimeout) }},
}

// Text is b as the stores keep it, one field of a row: "name=value"
// pairs, durations in ms; "" for a budget without limits.
func (b Budget) Text() string {
	if !b.Limited() {
		return ""
	}
	var out []string
	for _, f := range budgetFields {
		v := *f.get(&b)
		if f.name == "w" || f.name == "dr" {
			v /= int64(time.Millisecond)
		}
		if v != 0 {
			out = append(out, f.name+"="+strconv.FormatInt(v, 10))
		}
	}
	if b.CancelOnUnknownUsage {
		out = append(out, "u=1")
	}
	return strings.Join(out, " ")
}

// ParseBudgetText reads Budget.Text.
func ParseBudgetText(s string) (Budget, error) {
	var b Budget
	for _, part := range strings.Fields(s) {
		name, val, ok := strings.Cut(part, "=")
		n, err := strconv.ParseInt(val, 10, 64)
		if !ok || err != nil {
			return Budget{}, fmt.Errorf("budget %q: %q is not name=number", s, part)
		}
		if name == "u" {
			b.CancelOnUnknownUsage = n != 0
			continue
		}
		i := slices.IndexFunc(budgetFields, func(f struct {
			name string
			get  func(*Budget) *int64
		}) bool {
			return f.name == name
		})
		if i < 0 {
			return Budget{}, fmt.Errorf("budget %q: unknown field %q", s, name)
		}
		if name == "w" || name == "dr" {
			n *= int64(time.Millisecond)
		}
		*budgetFields[i].get(&b) = n
	}
	return b, nil
}

// BudgetWire is a budget on the wire, as the API takes it and the rows and
// the CLI show it: durations as Go durations ("30m"), the spend in USD.
type BudgetWire struct {
	MaxEffects               int64       `json:"max_effects,omitempty"`
	MaxEffectsPerDestination int64       `json:"max_effects_per_destination,omitempty"`
	MaxRequestBytes          int64       `json:"max_request_bytes,omitempty"`
	MaxResponseBytes         int64       `json:"max_response_bytes,omitempty"`
	MaxWallTime              string      `json:"max_wall_time,omitempty"`
	MaxInputTokens           int64       `json:"max_input_tokens,omitempty"`
	MaxOutputTokens          int64       `json:"max_output_tokens,omitempty"`
	MaxTokens                int64       `json:"max_tokens,omitempty"`
	MaxSpendUSD              json.Number `json:"max_spend_usd,omitempty"`
	CancelOnUnknownUsage     bool        `json:"cancel_on_unknown_usage,omitempty"`
	DrainTimeout             string      `json:"drain_timeout,omitempty"`
}

// Wire is b on the wire.
func (b Budget) Wire() BudgetWire {
	w := BudgetWire{
		MaxEffects: b.MaxEffects, MaxEffectsPerDestination: b.MaxEffectsPerDestination,
		MaxRequestBytes: b.MaxRequestBytes, MaxResponseBytes: b.MaxResponseBytes,
		MaxInputTokens: b.MaxInputTokens, MaxOutputTokens: b.MaxOutputTokens, MaxTokens: b.MaxTokens,
		CancelOnUnknownUsage: b.CancelOnUnknownUsage,
	}
	if b.MaxWallTime != 0 {
		w.MaxWallTime = b.MaxWallTime.String()
	}
	if b.DrainTimeout != 0 {
		w.DrainTimeout = b.DrainTimeout.String()
	}
	if b.MaxSpend != 0 {
		w.MaxSpendUSD = json.Number(FormatUSD(b.MaxSpend))
	}
	return w
}

// Budget is the budget w gives, or which field does not parse. It does not
// Validate the limits: a row read back was validated when it was written.
func (w BudgetWire) Budget() (Budget, error) {
	b := Budget{
		MaxEffects: w.MaxEffects, MaxEffectsPerDestination: w.MaxEffectsPerDestination,
		MaxRequestBytes: w.MaxRequestBytes, MaxResponseBytes: w.MaxResponseBytes,
		MaxInputTokens: w.MaxInputTokens, MaxOutputTokens: w.MaxOutputTokens, MaxTokens: w.MaxTokens,
		CancelOnUnknownUsage: w.CancelOnUnknownUsage,
	}
	for _, d := range []struct {
		field, v, example string
		into              *time.Duration
	}{
		{LimitWallTime, w.MaxWallTime, "30m", &b.MaxWallTime},
		{"drain_timeout", w.DrainTimeout, "30s", &b.DrainTimeout},
	} {
		if d.v == "" {
			continue
		}
		v, err := time.ParseDuration(d.v)
		if err != nil {
			return Budget{}, fmt.Errorf("budget.%s %q is not a duration like %s", d.field, d.v, d.example)
		}
		*d.into = v
	}
	if w.MaxSpendUSD != "" {
		n, err := ParseUSD(string(w.MaxSpendUSD))
		if err != nil {
			return Budget{}, fmt.Errorf("budget.%s: %w", LimitSpend, err)
		}
		b.MaxSpend = n
	}
	return b, nil
}

// MarshalJSON writes the budget as the API and the CLI show it.
func (b Budget) MarshalJSON() ([]byte, error) {
	return json.Marshal(b.Wire())
}

// UnmarshalJSON reads what MarshalJSON writes, refusing fields it does not
// know so that a misspelt limit is never silently no limit.
func (b *Budget) UnmarshalJSON(data []byte) error {
	var w BudgetWire
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	dec.UseNumber()
	if err := dec.Decode(&w); err != nil {
		return fmt.Errorf("budget: %w", err)
	}
	out, err := w.Budget()
	if err != nil {
		return err
	}
	*b = out
	return nil
}

// NanoUSD is one US dollar in the unit spends are counted in.
const NanoUSD = 1_000_000_000

// ParseUSD reads a decimal amount of US dollars ("5", "0.25", at most nine
// decimals) as nano-USD, exactly.
func ParseUSD(s string) (int64, error) {
	s = strings.TrimSpace(s)
	whole, frac, _ := strings.Cut(s, ".")
	if whole == "" && frac == "" || strings.HasPrefix(s, "-") || strings.HasPrefix(s, "+") || len(frac) > 9 {
		return 0, fmt.Errorf("%q is not an amount of USD like 5 or 0.25 (at most nine decimals, not negative)", s)
	}
	if whole == "" {
		whole = "0"
	}
	w, err := strconv.ParseInt(whole, 10, 64)
	if err != nil || w > math.MaxInt64/NanoUSD-1 {
		return 0, fmt.Errorf("%q is not an amount of USD like 5 or 0.25", s)
	}
	var f int64
	if frac != "" {
		if f, err = strconv.ParseInt(frac+strings.Repeat("0", 9-len(frac)), 10, 64); err != nil || f < 0 {
			return 0, fmt.Errorf("%q is not an amount of USD like 5 or 0.25", s)
		}
	}
	return w*NanoUSD + f, nil
}

// FormatUSD writes nano-USD as a decimal amount of US dollars, without
// trailing zeros.
func FormatUSD(n int64) string {
	sign := ""
	if n < 0 {
		sign, n = "-", -n
	}
	s := strconv.FormatInt(n/NanoUSD, 10)
	if frac := n % NanoUSD; frac != 0 {
		s += "." + strings.TrimRight(fmt.Sprintf("%09d", frac), "0")
	}
	return sign + s
}

// Usage counters: what a run has used, kept in its row and changed in the
// same step as the guard or the outcome that used it. A destination's and
// a model's counters are named by prefix (DestinationCounter,
// ModelCounter).
const (
	CounterEffects       = "effects"
	CounterRequestBytes  = "request_bytes"
	CounterResponseBytes = "response_bytes"
	CounterInputTokens   = "input_tokens"
	CounterOutputTokens  = "output_tokens"
	CounterTokens        = "tokens"
	// CounterSpend is in nano-USD.
	CounterSpend = "spend"
	// CounterLLMCalls counts the LLM answers whose usage was read.
	CounterLLMCalls = "llm_calls"
	// CounterUnknownUsage counts the LLM answers whose usage could not be
	// read (a provider not listed, a stream cut before its usage): never
	// counted as zero tokens.
	CounterUnknownUsage = "unknown_usage"
	// CounterUnpriced counts the LLM answers read whose model the price
	// table does not list: their spend is unknown.
	CounterUnpriced = "unpriced"

	prefixDestination = "dest:"
	prefixModelIn     = "in:"
	prefixModelOut    = "out:"
	prefixModelCalls  = "calls:"
)

// DestinationCounter names the counter of effects to host.
func DestinationCounter(host string) string { return prefixDestination + host }

// ModelCounters name the counters of a model's input tokens, output
// tokens and answers.
func ModelCounters(model string) (in, out, calls string) {
	return prefixModelIn + model, prefixModelOut + model, prefixModelCalls + model
}

// Named reports whether a counter is one of a destination or a model,
// whose names a run cannot know in advance (a store lists them).
func Named(counter string) bool { return strings.Contains(counter, ":") }

// MaxCounterNameLen bounds a counter's name (a destination's host, a
// model's name and its prefix).
const MaxCounterNameLen = 200

// Usage is a run's usage counters by name; counters never used are absent.
// Only a store's Get and List fill it (a step's answer carries the row
// without it).
type Usage map[string]int64

// Destinations are the effects by destination.
func (u Usage) Destinations() map[string]int64 {
	out := map[string]int64{}
	for name, n := range u {
		if host, ok := strings.CutPrefix(name, prefixDestination); ok {
			out[host] = n
		}
	}
	return out
}

// ModelUsage is one model's share of a run's LLM usage.
type ModelUsage struct {
	InputTokens  int64 `json:"input_tokens"`
	OutputTokens int64 `json:"output_tokens"`
	Calls        int64 `json:"calls"`
}

// Models are the LLM usage by model.
func (u Usage) Models() map[string]ModelUsage {
	out := map[string]ModelUsage{}
	for name, n := range u {
		for _, p := range []struct {
			prefix string
			set    func(*ModelUsage)
		}{
			{prefixModelIn, func(m *ModelUsage) { m.InputTokens = n }},
			{prefixModelOut, func(m *ModelUsage) { m.OutputTokens = n }},
			{prefixModelCalls, func(m *ModelUsage) { m.Calls = n }},
		} {
			if model, ok := strings.CutPrefix(name, p.prefix); ok {
				m := out[model]
				p.set(&m)
				out[model] = m
			}
		}
	}
	return out
}

type usageJSON struct {
	Effects       int64                 `json:"effects"`
	RequestBytes  int64                 `json:"request_bytes"`
	ResponseBytes int64                 `json:"response_bytes"`
	InputTokens   int64                 `json:"input_tokens"`
	OutputTokens  int64                 `json:"output_tokens"`
	Tokens        int64                 `json:"tokens"`
	SpendUSD      json.Number           `json:"spend_usd"`
	LLMCalls      int64                 `json:"llm_calls"`
	UnknownUsage  int64                 `json:"unknown_usage"`
	Unpriced      int64                 `json:"unpriced"`
	Destinations  map[string]int64      `json:"destinations,omitempty"`
	Models        map[string]ModelUsage `json:"models,omitempty"`
}

// MarshalJSON writes the usage as the API and `stopgate status --json`
// show it.
func (u Usage) MarshalJSON() ([]byte, error) {
	w := usageJSON{
		Effects: u[CounterEffects], RequestBytes: u[CounterRequestBytes], ResponseBytes: u[CounterResponseBytes],
		InputTokens: u[CounterInputTokens], OutputTokens: u[CounterOutputTokens], Tokens: u[CounterTokens],
		SpendUSD: json.Number(FormatUSD(u[CounterSpend])), LLMCalls: u[CounterLLMCalls],
		UnknownUsage: u[CounterUnknownUsage], Unpriced: u[CounterUnpriced],
	}
	if d := u.Destinations(); len(d) > 0 {
		w.Destinations = d
	}
	if m := u.Models(); len(m) > 0 {
		w.Models = m
	}
	return json.Marshal(w)
}

// UnmarshalJSON reads what MarshalJSON writes.
func (u *Usage) UnmarshalJSON(data []byte) error {
	var w usageJSON
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if err := dec.Decode(&w); err != nil {
		return fmt.Errorf("usage: %w", err)
	}
	out := Usage{}
	put := func(name string, n int64) {
		if n != 0 {
			out[name] = n
		}
	}
	put(CounterEffects, w.Effects)
	put(CounterRequestBytes, w.RequestBytes)
	put(CounterResponseBytes, w.ResponseBytes)
	put(CounterInputTokens, w.InputTokens)
	put(CounterOutputTokens, w.OutputTokens)
	put(CounterTokens, w.Tokens)
	put(CounterLLMCalls, w.LLMCalls)
	put(CounterUnknownUsage, w.UnknownUsage)
	put(CounterUnpriced, w.Unpriced)
	if w.SpendUSD != "" {
		n, err := ParseUSD(string(w.SpendUSD))
		if err != nil {
			return fmt.Errorf("usage spend_usd: %w", err)
		}
		put(CounterSpend, n)
	}
	for host, n := range w.Destinations {
		put(DestinationCounter(host), n)
	}
	for model, m := range w.Models {
		in, o, calls := ModelCounters(model)
		put(in, m.InputTokens)
		put(o, m.OutputTokens)
		put(calls, m.Calls)
	}
	*u = out
	return nil
}

// LLMUsage is what one LLM answer says it used, as the carrier read it on
// its way back.
type LLMUsage struct {
	// Model is the model the answer names (ValidateModel); "" when it
	// names none.
	Model string
	// Known: the usage was read. False for an answer whose usage could not
	// be read (its provider is not listed, its stream was cut before the
	// usage came, its body is not what the API sends): it counts as
	// unknown, never as zero tokens.
	Known        bool
	InputTokens  int64
	OutputTokens int64
	// Priced: the price table lists the model; Spend is then the usage's
	// price in nano-USD.
	Priced bool
	Spend  int64
}

// ValidateModel rejects a model name that cannot name a counter.
func ValidateModel(model string) error {
	if len(prefixModelCalls)+len(model) > MaxCounterNameLen {
		return fmt.Errorf("%w: model name is %d bytes, longer than %d", ErrInvalid, len(model), MaxCounterNameLen-len(prefixModelCalls))
	}
	for i := 0; i < len(model); i++ {
		if c := model[i]; c < 0x21 || c > 0x7e {
			return fmt.Errorf("%w: model name %q has a byte outside printable ASCII", ErrInvalid, model)
		}
	}
	return nil
}

// Validate checks what an answer says it used.
func (u *LLMUsage) Validate() error {
	if u == nil {
		return nil
	}
	if err := ValidateModel(u.Model); err != nil {
		return err
	}
	if u.InputTokens < 0 || u.OutputTokens < 0 || u.Spend < 0 {
		return fmt.Errorf("%w: LLM usage is negative", ErrInvalid)
	}
	if !u.Known && (u.InputTokens != 0 || u.OutputTokens != 0 || u.Spend != 0) {
		return fmt.Errorf("%w: LLM usage not read carries no tokens and no spend", ErrInvalid)
	}
	if !u.Priced && u.Spend != 0 {
		return fmt.Errorf("%w: an unpriced LLM usage carries no spend", ErrInvalid)
	}
	return nil
}

// Destination is the destination an effect is counted against: the host
// of its target (lower case, without its port or a trailing dot), "" for a
// target without one (a queue claim's step, say). It reads the host out of
// the target without parsing the whole URL: it is on every guard's path.
func Destination(b Boundary, target string) string {
	host := target
	if i := strings.Index(target, "://"); i >= 0 {
		host = target[i+3:]
		if j := strings.IndexAny(host, "/?#"); j >= 0 {
			host = host[:j]
		}
		if j := strings.LastIndexByte(host, '@'); j >= 0 {
			host = host[j+1:]
		}
	} else if b != BoundaryTunnel {
		return ""
	}
	if strings.HasPrefix(host, "[") {
		if j := strings.IndexByte(host, ']'); j > 0 {
			host = host[1:j]
		}
	} else if j := strings.LastIndexByte(host, ':'); j >= 0 && strings.IndexByte(host, ':') == j {
		host = host[:j]
	}
	host = strings.TrimSuffix(host, ".")
	if host == "" || len(prefixDestination)+len(host) > MaxCounterNameLen {
		return ""
	}
	for i := 0; i < len(host); i++ {
		c := host[i]
		if c <= ' ' || c == 0x7f {
			return ""
		}
		if c >= 'A' && c <= 'Z' {
			return strings.ToLower(host)
		}
	}
	return host
}

// LimitUse is one limit of a budget beside what the run has used of it,
// as the CLI and the console show them.
type LimitUse struct {
	Limit string
	// Used and Max are in the limit's unit: a count, bytes, tokens,
	// nano-USD, milliseconds (max_wall_time); for max_effects_per_destination
	// Used is the busiest destination's (Of names it).
	Used, Max int64
	Of        string
}

// Uses lists the limits b sets, in a fixed order, with what usage holds of
// each; elapsed is the run's time since admission.
func (b Budget) Uses(u Usage, elapsed time.Duration) []LimitUse {
	var out []LimitUse
	add := func(limit string, used, max int64) {
		if max > 0 {
			out = append(out, LimitUse{Limit: limit, Used: used, Max: max})
		}
	}
	add(LimitEffects, u[CounterEffects], b.MaxEffects)
	if b.MaxEffectsPerDestination > 0 {
		busiest := LimitUse{Limit: LimitEffectsPerDestination, Max: b.MaxEffectsPerDestination}
		for host, n := range u.Destinations() {
			if n > busiest.Used || n == busiest.Used && host < busiest.Of {
				busiest.Used, busiest.Of = n, host
			}
		}
		out = append(out, busiest)
	}
	add(LimitRequestBytes, u[CounterRequestBytes], b.MaxRequestBytes)
	add(LimitResponseBytes, u[CounterResponseBytes], b.MaxResponseBytes)
	add(LimitWallTime, elapsed.Milliseconds(), b.MaxWallTime.Milliseconds())
	add(LimitInputTokens, u[CounterInputTokens], b.MaxInputTokens)
	add(LimitOutputTokens, u[CounterOutputTokens], b.MaxOutputTokens)
	add(LimitTokens, u[CounterTokens], b.MaxTokens)
	add(LimitSpend, u[CounterSpend], b.MaxSpend)
	return out
}

// String is the use as "used / max" in the limit's unit.
func (l LimitUse) String() string {
	f := func(n int64) string { return strconv.FormatInt(n, 10) }
	switch l.Limit {
	case LimitWallTime:
		f = func(n int64) string { return (time.Duration(n) * time.Millisecond).Round(time.Second).String() }
	case LimitSpend:
		f = func(n int64) string { return "$" + FormatUSD(n) }
	}
	s := f(l.Used) + " / " + f(l.Max)
	if l.Of != "" {
		s += " (" + l.Of + ")"
	}
	return s
}
