package serve

import (
	"context"
	"log/slog"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/policy"
	"github.com/stopgate/stopgate/proxy"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/telemetry"
)

// loadPolicy reads serve's policy file and the proxy's rules of it.
func loadPolicy(cfg Config) (policy.Policy, proxy.Rules, error) {
	pol, err := policy.Load(cfg.Config)
	if err != nil {
		return policy.Policy{}, proxy.Rules{}, err
	}
	rules, err := proxy.RulesOf(pol, cfg.AllowDest)
	if err != nil {
		return policy.Policy{}, proxy.Rules{}, err
	}
	rules.CancelDrain = cfg.DrainTimeout
	return pol, rules, nil
}

// policyHolder is the policy in force, which SIGHUP and POST
// /v1/policy/reload replace: the egress proxy's rules (exchanges already
// open keep theirs) and the webhook sources. Lookups are the reconciler's
// from the start; a reload that changes them says so.
type policyHolder struct {
	cfg     Config
	egress  *proxy.Proxy
	metrics *telemetry.Metrics
	log     *slog.Logger
	// mu makes reloads one at a time, so the last one read is the one in force.
	mu  sync.Mutex
	pol atomic.Pointer[policy.Policy]
	// started is the policy the reconciler runs with.
	started policy.Policy
}

func newPolicyHolder(cfg Config, pol policy.Policy, m *telemetry.Metrics, log *slog.Logger) *policyHolder {
	h := &policyHolder{cfg: cfg, metrics: m, log: log, started: pol}
	h.pol.Store(&pol)
	return h
}

// secret is the webhook source's secret in the policy in force.
func (h *policyHolder) secret(source string) ([]byte, bool) { return h.pol.Load().Secret(source) }

// budget is the budget the policy in force gives a run admitted with
// labels and given (docs/budgets.md).
func (h *policyHolder) budget(runID string, labels map[string]string, given state.Budget) state.Budget {
	return h.pol.Load().Budgets.Admitted(runID, labels, given, h.cfg.DrainTimeout)
}

// autoBudget is the budget the policy in force gives a run admitted on
// first sight (no labels, nothing given).
func (h *policyHolder) autoBudget(runID string) state.Budget {
	return h.budget(runID, nil, state.Budget{})
}

// reloader is the control API's reload, nil without a policy file.
func (h *policyHolder) reloader() control.PolicyReloader {
	if h.cfg.Config == "" {
		return nil
	}
	return h.reload
}

// reload reads the policy file again and applies it; a file that does not
// parse or validate keeps the policy in force, and the error says why. by
// names who asked, for the log.
func (h *policyHolder) reload(ctx context.Context, by string) (control.PolicyReloaded, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.cfg.Config == "" {
		h.log.Warn("policy reload asked, but serve has no --config: nothing to reload", "by", by)
		return control.PolicyReloaded{}, refusal.New(refusal.NotFound, "this server has no policy file to reload: start stopgate serve with --config")
	}
	fail := func(err error) (control.PolicyReloaded, error) {
		h.metrics.PolicyReloaded(false)
		h.log.Error("policy reload failed: the policy in force stays as it was", "config", h.cfg.Config, "by", by, "err", err)
		return control.PolicyReloaded{}, refusal.Wrap(err, refusal.PolicyInvalid, "%v; the policy in force stays as it was", err)
	}
	pol, rules, err := loadPolicy(h.cfg)
	if err != nil {
		return fail(err)
	}
	ctx, cancel := context.WithTimeout(ctx, h.cfg.StoreTimeout)
	defer cancel()
	if err := h.egress.SetRules(ctx, rules); err != nil {
		return fail(err)
	}
	h.pol.Store(&pol)
	h.metrics.PolicyReloaded(true)
	out := control.PolicyReloaded{Config: h.cfg.Config, ReloadedAt: time.Now().UTC(), Rules: pol.RuleCounts()}
	if !reflect.DeepEqual(pol.Lookups, h.started.Lookups) {
		out.Notes = append(out.Notes, "lookups changed: the reconciler keeps the lookups it started with until stopgate serve restarts")
	}
	attrs := []any{"config", h.cfg.Config, "by", by}
	for _, k := range policy.RuleKinds {
		attrs = append(attrs, k, out.Rules[k])
	}
	for _, n := range out.Notes {
		attrs = append(attrs, "note", n)
	}
	h.log.Info("policy reloaded: new exchanges apply it, open ones keep the rules they started under", attrs...)
	return out, nil
}
