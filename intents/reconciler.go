package intents

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"sync"
	"time"

	"github.com/stopgate/stopgate/policy"
	"github.com/stopgate/stopgate/state"
)

// Reconciler asks providers what happened to UNKNOWN intents, through the
// lookups of the policy: an answer that means applied or not applied
// resolves the intent (source "lookup"); anything else is tried again with
// backoff until it answers.
//
// A pass looks at every draining run (CANCELLING, UNKNOWN) and at one page
// of ACTIVE runs (PageSize), walking them in id order as the Sweeper does,
// so its cost follows the runs draining now, not the runs stored.
type Reconciler struct {
	Store   state.Store
	Lookups []policy.Lookup
	// Client makes the lookups; it should not go through the egress proxy.
	Client       *http.Client
	Interval     time.Duration
	StoreTimeout time.Duration
	Actor        string
	Logger       *slog.Logger
	// PageSize is how many ACTIVE runs a pass looks at (DefaultSweepPage
	// when zero).
	PageSize int

	runs  runWalk
	mu    sync.Mutex
	next  map[state.IntentRef]time.Time
	waits map[state.IntentRef]time.Duration
}

// Run reconciles until ctx ends.
func (r *Reconciler) Run(ctx context.Context) {
	if len(r.Lookups) == 0 {
		return
	}
	every(ctx, r.Interval, r.Pass)
}

// Pass tries every UNKNOWN intent whose backoff has passed, of every
// draining run and of one page of ACTIVE runs.
func (r *Reconciler) Pass(ctx context.Context) {
	log := r.logger()
	for _, run := range r.runs.pass(ctx, r.Store, r.StoreTimeout, r.PageSize, log, "reconcile") {
		ins, err := storeCall(ctx, r.StoreTimeout, func(ctx context.Context) ([]state.Intent, error) { return r.Store.Intents(ctx, run) })
		if err != nil {
			log.Warn("reconcile: cannot list intents", "run", run, "err", err)
			continue
		}
		for _, in := range ins {
			if in.State != state.IntentUnknown {
				continue
			}
			if l, ok := r.lookupFor(in); ok && r.due(in) {
				r.try(ctx, l, in)
			}
		}
	}
}

func (r *Reconciler) lookupFor(in state.Intent) (policy.Lookup, bool) {
	host := in.Target
	if u, err := url.Parse(in.Target); err == nil && u.Host != "" {
		host = u.Host
	}
	for _, l := range r.Lookups {
		if l.Covers(host) {
			return l, true
		}
	}
	return policy.Lookup{}, false
}

func (r *Reconciler) due(in state.Intent) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return !time.Now().Before(r.next[state.IntentRef{RunID: in.RunID, Key: in.Key}])
}

func (r *Reconciler) backoff(in state.Intent, l policy.Lookup) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.next == nil {
		r.next, r.waits = map[state.IntentRef]time.Time{}, map[state.IntentRef]time.Duration{}
	}
	ref := state.IntentRef{RunID: in.RunID, Key: in.Key}
	wait := r.waits[ref] * 2
	if wait == 0 {
		wait = l.Interval.Duration
		if wait == 0 {
			wait = time.Second
		}
	}
	if limit := l.MaxInterval.Duration; limit > 0 && wait > limit {
		wait = limit
	} else if limit == 0 && wait > time.Minute {
		wait = time.Minute
	}
	r.waits[ref], r.next[ref] = wait, time.Now().Add(wait)
}

func (r *Reconciler) try(ctx context.Context, l policy.Lookup, in state.Intent) {
	log := r.logger()
	target := l.LookupURL(in.RunID, in.Key)
	status, err := r.ask(ctx, l, target)
	var applied bool
	switch {
	case err != nil:
		log.Info("reconcile: lookup did not answer; trying again later", "run", in.RunID, "intent", in.Key, "url", target, "err", err)
		r.backoff(in, l)
		return
	case slices.Contains(l.Applied, status):
		applied = true
	case slices.Contains(l.NotApplied, status):
	default:
		log.Info("reconcile: lookup answered neither applied nor not applied; trying again later", "run", in.RunID, "intent", in.Key, "status", status)
		r.backoff(in, l)
		return
	}
	_, err = storeCall(ctx, r.StoreTimeout, func(ctx context.Context) (state.Intent, error) {
		return r.Store.Resolve(ctx, state.ResolveRequest{
			RunID: in.RunID, Key: in.Key, Applied: applied, Source: "lookup",
			Note: fmt.Sprintf("GET %s answered %d", target, status), Actor: r.Actor,
		})
	})
	if err != nil {
		log.Warn("reconcile: resolution not recorded", "run", in.RunID, "intent", in.Key, "err", err)
		r.backoff(in, l)
		return
	}
	r.mu.Lock()
	delete(r.next, state.IntentRef{RunID: in.RunID, Key: in.Key})
	delete(r.waits, state.IntentRef{RunID: in.RunID, Key: in.Key})
	r.mu.Unlock()
}

func (r *Reconciler) ask(ctx context.Context, l policy.Lookup, target string) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return 0, err
	}
	for k, v := range l.HeaderValues() {
		req.Header.Set(k, v)
	}
	client := r.Client
	if client == nil {
		client = &http.Client{Transport: &http.Transport{Proxy: nil}}
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, err
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
	_ = resp.Body.Close()
	return resp.StatusCode, nil
}

func (r *Reconciler) logger() *slog.Logger {
	if r.Logger == nil {
		return slog.Default()
	}
	return r.Logger
}

// storeCall bounds one store call, so a slow store delays reconciliation
// instead of stalling it.
func storeCall[T any](ctx context.Context, timeout time.Duration, f func(context.Context) (T, error)) (T, error) {
	if timeout <= 0 {
		timeout = state.DefaultTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return f(ctx)
}
