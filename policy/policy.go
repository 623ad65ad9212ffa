// Package policy reads the operator's YAML policy file: which hosts are
// tunnelled unseen, which destinations a CANCELLING run may still reach,
// which destinations the proxy may connect to at all, which destinations'
// requests have effects outside, which webhook sources may reconcile
// UNKNOWN intents, how to look an intent up at its provider, the budgets
// runs are admitted with, the LLM APIs whose usage is read and their
// prices, and the tripwires that cancel a run. It owns
// the syntax of a destination rule, which --allow-dest shares. It only
// parses and validates; it never acts.
package policy

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// Policy is the parsed file. The zero Policy is valid: nothing passes
// through unseen, no destination outlives ACTIVE, nothing reconciles by itself.
type Policy struct {
	// PassThrough hosts are tunnelled unseen: guarded at CONNECT, one intent per tunnel.
	PassThrough []string `yaml:"pass_through"`
	// Delivery hosts may still be reached while the run is CANCELLING.
	Delivery []string `yaml:"delivery"`
	// Destinations allow (loopback and private addresses are refused
	// unless allowed), deny and report where the proxy connects, and say
	// what becomes of a destination no rule covers.
	Destinations Destinations `yaml:"destinations"`
	// Webhooks name the sources that may resolve UNKNOWN intents by a signed POST.
	Webhooks map[string]Webhook `yaml:"webhooks"`
	// Lookups ask providers what happened to an UNKNOWN intent.
	Lookups []Lookup `yaml:"lookups"`
	// Effects says, per destination (a HostPattern), which
	// requests have an effect outside: EffectsNone, EffectsWrites (the
	// default for any destination not listed) or EffectsAll.
	Effects map[string]Effects `yaml:"effects"`
	// Budgets are the limits runs are admitted with.
	Budgets Budgets `yaml:"budgets"`
	// LLM lists the LLM APIs whose usage is read, and their prices.
	LLM LLM `yaml:"llm"`
	// Tripwires are effects that cancel the run that makes them.
	Tripwires []Tripwire `yaml:"tripwires"`
}

// Effects is what requests to a destination do outside stopgate.
type Effects string

const (
	// EffectsNone: no request has an external effect (an LLM inference
	// API): at a cancel, even a request in flight is cut at once, the
	// spending stops, and what was cut is NOT_APPLIED (source policy).
	EffectsNone Effects = "none"
	// EffectsWrites: the default. Unsafe methods have effects and drain;
	// a safe-method request (GET, HEAD, OPTIONS) cut at the cancel is
	// NOT_APPLIED (source safe_method).
	EffectsWrites Effects = "writes"
	// EffectsAll: reads have effects too (a GET that triggers something):
	// safe methods drain and a cut one is UNKNOWN like any other.
	EffectsAll Effects = "all"
)

// HostsWith lists the destinations whose effects are e.
func (p Policy) HostsWith(e Effects) []string {
	var out []string
	for host, v := range p.Effects {
		if v == e {
			out = append(out, host)
		}
	}
	return out
}

// RuleKinds are the kinds of rule a policy holds, in the order a start
// line and a reload name how many of each it has (RuleCounts).
var RuleKinds = []string{"pass_through", "delivery", "effects", "lookups", "webhooks", "allow_dest", "deny_dest", "report_dest",
	"budget_rules", "tripwires", "llm_providers", "llm_prices"}

// RuleCounts says how many rules of each kind (RuleKinds) p has.
func (p Policy) RuleCounts() map[string]int {
	d := p.Destinations
	return map[string]int{
		"pass_through": len(p.PassThrough), "delivery": len(p.Delivery), "effects": len(p.Effects),
		"lookups": len(p.Lookups), "webhooks": len(p.Webhooks),
		"allow_dest": len(d.Allow), "deny_dest": len(d.Deny), "report_dest": len(d.Report),
		"budget_rules": len(p.Budgets.Rules), "tripwires": len(p.Tripwires), "llm_providers": len(p.LLM.Providers), "llm_prices": len(p.LLM.Prices),
	}
}

// Webhook is one source's shared secret for HMAC-SHA256 signatures.
type Webhook struct {
	// Secret, or SecretEnv naming the environment variable that holds it.
	Secret    string `yaml:"secret"`
	SecretEnv string `yaml:"secret_env"`
}

// Lookup reconciles UNKNOWN intents whose target host matches Host.
type Lookup struct {
	// Host is a HostPattern.
	Host string `yaml:"host"`
	// URL is a template: {key} and {run} are replaced, path-escaped.
	URL string `yaml:"url"`
	// Headers are sent with the lookup; ${VAR} is read from the environment.
	Headers    map[string]string `yaml:"headers"`
	Applied    []int             `yaml:"applied"`
	NotApplied []int             `yaml:"not_applied"`
	// Interval is the first wait between tries, doubling up to MaxInterval.
	Interval    Duration `yaml:"interval"`
	MaxInterval Duration `yaml:"max_interval"`
}

// Duration reads "30s"-style durations.
type Duration struct{ time.Duration }

// UnmarshalYAML parses a Go duration string.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	var s string
	if err := n.Decode(&s); err != nil {
		return fmt.Errorf("line %d: want a duration like 30s: %w", n.Line, err)
	}
	v, err := time.ParseDuration(s)
	if err != nil || v <= 0 {
		return fmt.Errorf("line %d: %q is not a positive duration like 30s", n.Line, s)
	}
	d.Duration = v
	return nil
}

// Load reads and validates the policy at path; "" is the zero policy.
func Load(path string) (Policy, error) {
	if path == "" {
		return Policy{}, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return Policy{}, fmt.Errorf("policy: %w", err)
	}
	p, err := Parse(b)
	if err != nil {
		return Policy{}, fmt.Errorf("policy %s: %w", path, err)
	}
	return p, nil
}

// Parse reads a policy document; unknown keys are errors, so a typo never
// silently turns a rule off.
func Parse(b []byte) (Policy, error) {
	var p Policy
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&p); err != nil && !errors.Is(err, io.EOF) {
		return Policy{}, err
	}
	return p, p.validate()
}

func (p *Policy) validate() error {
	for field, hosts := range map[string][]string{"pass_through": p.PassThrough, "delivery": p.Delivery} {
		if _, err := NewHostSet(hosts); err != nil {
			return fmt.Errorf("%s: %w", field, err)
		}
	}
	for host, e := range p.Effects {
		if _, err := ParseHostPattern(host); err != nil {
			return fmt.Errorf("effects: %w", err)
		}
		switch e {
		case EffectsNone, EffectsWrites, EffectsAll:
		default:
			return fmt.Errorf("effects.%s: %q: want none, writes or all", host, e)
		}
	}
	if err := p.Destinations.Check(); err != nil {
		return err
	}
	if err := p.Budgets.validate(); err != nil {
		return err
	}
	if err := p.LLM.validate(); err != nil {
		return err
	}
	if err := validateTripwires(p.Tripwires); err != nil {
		return err
	}
	for name, w := range p.Webhooks {
		if name == "" {
			return errors.New("webhooks: a source needs a name")
		}
		if (w.Secret == "") == (w.SecretEnv == "") {
			return fmt.Errorf("webhooks.%s: give exactly one of secret and secret_env", name)
		}
		if w.SecretEnv != "" && os.Getenv(w.SecretEnv) == "" {
			return fmt.Errorf("webhooks.%s: environment variable %s is empty", name, w.SecretEnv)
		}
	}
	for i, l := range p.Lookups {
		where := fmt.Sprintf("lookups[%d]", i)
		if l.Host == "" {
			return fmt.Errorf("%s: host is required", where)
		}
		if _, err := ParseHostPattern(l.Host); err != nil {
			return fmt.Errorf("%s: host: %w", where, err)
		}
		u, err := url.Parse(strings.NewReplacer("{key}", "k", "{run}", "r").Replace(l.URL))
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("%s: url %q is not an http(s) URL template", where, l.URL)
		}
		if !strings.Contains(l.URL, "{key}") {
			return fmt.Errorf("%s: url %q must contain {key}, the intent's idempotency key", where, l.URL)
		}
		if len(l.Applied) == 0 || len(l.NotApplied) == 0 {
			return fmt.Errorf("%s: list the status codes that mean applied and not_applied", where)
		}
		for _, a := range l.Applied {
			for _, n := range l.NotApplied {
				if a == n {
					return fmt.Errorf("%s: status %d cannot mean both applied and not applied", where, a)
				}
			}
		}
	}
	return nil
}

// Secret returns the webhook source's secret, or false if there is no such source.
func (p Policy) Secret(source string) ([]byte, bool) {
	w, ok := p.Webhooks[source]
	if !ok {
		return nil, false
	}
	if w.SecretEnv != "" {
		return []byte(os.Getenv(w.SecretEnv)), true
	}
	return []byte(w.Secret), true
}

// Covers reports whether the lookup is for hostport, the host (and port)
// of an intent's target.
func (l Lookup) Covers(hostport string) bool {
	set, err := NewHostSet([]string{l.Host})
	return err == nil && set.Match(hostport)
}

// HeaderValues expands ${VAR} in a lookup's headers from the environment.
func (l Lookup) HeaderValues() map[string]string {
	out := make(map[string]string, len(l.Headers))
	for k, v := range l.Headers {
		out[k] = os.Expand(v, os.Getenv)
	}
	return out
}

// LookupURL fills the template for one intent.
func (l Lookup) LookupURL(run, key string) string {
	return strings.NewReplacer("{key}", url.PathEscape(key), "{run}", url.PathEscape(run)).Replace(l.URL)
}
