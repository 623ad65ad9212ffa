package proxy

import (
	"context"
	"fmt"

	"github.com/stopgate/stopgate/policy"
)

// Rules are the parts of the operator's policy the proxy applies: which
// hosts pass through unseen, which a CANCELLING run may still reach, what
// requests to a destination do outside, and where the proxy may connect.
// A reload replaces them whole (SetRules); an exchange keeps the rules it
// started under to its end, so a reload never changes what an open flow was
// admitted as, nor cuts it.
type Rules struct {
	// PassThrough hosts are tunnelled unseen: one intent per tunnel.
	PassThrough policy.HostSet
	// Delivery hosts may still be reached by a CANCELLING run.
	Delivery policy.HostSet
	// NoEffects are destinations whose requests have no external effect
	// (an LLM inference API): at the cancel, their requests in flight are
	// cut at once, streams included, and recorded NOT_APPLIED (policy).
	NoEffects policy.HostSet
	// ReadEffects are destinations whose reads have effects too: a safe
	// method there drains like a write, and a cut one is UNKNOWN.
	ReadEffects policy.HostSet

	// AllowDest, DenyDest and ReportDest are the operator's destination
	// rules (policy.ParseDestinationRule): --allow-dest and the policy's
	// destinations. Loopback and private addresses are refused unless
	// allowed; deny wins over allow; a report rule is a deny that is only
	// logged and counted (would_deny). DefaultDest decides what no allow
	// rule covers (empty: allow).
	AllowDest, DenyDest, ReportDest []string
	DefaultDest                     policy.DestinationDefault

	// The policy's budgets, LLM APIs and prices, and tripwires.
	budgetRules
}

// RulesOf are the proxy's rules of pol, with allow (--allow-dest) added to
// its allowed destinations. The error names the policy's field.
func RulesOf(pol policy.Policy, allow []string) (Rules, error) {
	var r Rules
	var err error
	for _, s := range []struct {
		field string
		hosts []string
		into  *policy.HostSet
	}{
		{"pass_through", pol.PassThrough, &r.PassThrough},
		{"delivery", pol.Delivery, &r.Delivery},
		{"effects", pol.HostsWith(policy.EffectsNone), &r.NoEffects},
		{"effects", pol.HostsWith(policy.EffectsAll), &r.ReadEffects},
	} {
		if *s.into, err = policy.NewHostSet(s.hosts); err != nil {
			return Rules{}, fmt.Errorf("%s: %w", s.field, err)
		}
	}
	if r.budgetRules, err = compileBudgetRules(pol); err != nil {
		return Rules{}, err
	}
	d := pol.Destinations
	r.AllowDest = append(append([]string(nil), allow...), d.Allow...)
	r.DenyDest, r.ReportDest, r.DefaultDest = d.Deny, d.Report, d.Default
	if _, err := newDestinations(context.Background(), r.destinationRules(nil)); err != nil {
		return Rules{}, fmt.Errorf("destinations: %w", err)
	}
	return r, nil
}

// destinationRules are the destination rules of r, on top of protected.
func (r Rules) destinationRules(protected []Protected) destinationRules {
	return destinationRules{allow: r.AllowDest, deny: r.DenyDest, report: r.ReportDest, byDefault: r.DefaultDest, protected: protected}
}

// rules are Rules ready to apply: the destination check built.
type rules struct {
	Rules
	dests *destinations
}

// compile builds r's destination check with this proxy's protected
// addresses and resolver.
func (p *Proxy) compile(ctx context.Context, r Rules) (*rules, error) {
	dr := r.destinationRules(p.cfg.Protected)
	dr.resolve, dr.local = p.cfg.Resolve, localAddrs()
	dests, err := newDestinations(ctx, dr)
	if err != nil {
		return nil, err
	}
	return &rules{Rules: r, dests: dests}, nil
}

// SetRules replaces the proxy's rules: every exchange that starts from now
// on applies r; those open keep theirs. On an error nothing changes.
func (p *Proxy) SetRules(ctx context.Context, r Rules) error {
	c, err := p.compile(ctx, r)
	if err != nil {
		return fmt.Errorf("proxy: %w", err)
	}
	p.rules.Store(c)
	return nil
}

// current is the rules an exchange starting now applies.
func (p *Proxy) current() *rules { return p.rules.Load() }

// effectsOf is the policy of a destination (host or host:port).
func (r *rules) effectsOf(host string) effects {
	switch {
	case r.NoEffects.Match(host):
		return effectsNone
	case r.ReadEffects.Match(host):
		return effectsAll
	}
	return effectsWrites
}
