package statetest

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/stopgate/stopgate/state"
)

// Clock is a clock a test moves by hand, shared by every store of a
// differential history, so that their records carry the same times.
type Clock struct {
	mu  sync.Mutex
	now time.Time
}

// NewClock starts a clock at now (ms).
func NewClock(now time.Time) *Clock {
	return &Clock{now: now.UTC().Truncate(time.Millisecond)}
}

// Now reads the clock.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the clock on by d.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// OpenClocked returns a new, empty store whose steps read clock; the
// differential suite closes it.
type OpenClocked func(t *testing.T, clock func() time.Time) state.Store

// Differential runs generated histories of every operation of a run —
// admissions (with budgets and without), guards (explicit and derived
// keys, observed versions, scheduled retries and their dispatch,
// deliveries to a cancelling run, an edge's own refusals, tripwires,
// request bytes, bursts of more than sixteen effects in flight), outcomes
// now and later (with response bytes and LLM usage, known and unknown,
// priced and not), cancels, completions, ticks at chosen times,
// reconciliations, notes and lease renewals — against the model (package
// machine's rules over runs in memory) and every store given, one step at
// a time, and fails at the first step whose complete answer differs, or
// at the end of a history if any run's row, intents or events differ.
// RAPID_CHECKS (or -rapid.checks) sets how many histories: 100 by default.
func Differential(t *testing.T, stores map[string]OpenClocked) {
	names := make([]string, 0, len(stores))
	for name := range stores {
		names = append(names, name)
	}
	slices.Sort(names)
	var ops, histories, limited int
	rapid.Check(t, func(rt *rapid.T) {
		clock := NewClock(time.Now())
		h := &history{t: rt, clock: clock, model: &Model{Clock: clock.Now, runs: map[string]*modelRun{}}}
		for _, name := range names {
			h.names = append(h.names, name)
			h.stores = append(h.stores, stores[name](t, clock.Now))
		}
		defer func() {
			for _, s := range h.stores {
				_ = s.Close()
			}
		}()
		n := rapid.IntRange(10, 80).Draw(rt, "steps")
		for range n {
			h.step()
		}
		h.compareAll()
		ops += n
		histories++
		limited += h.limited
	})
	t.Logf("differential: %d histories, %d operations, %d runs cancelled by a budget or a tripwire, %d stores beside the model", histories, ops, limited, len(stores))
}

type history struct {
	t      *rapid.T
	clock  *Clock
	model  *Model
	names  []string
	stores []state.Store
	// intents are the keys a guard admitted or refused, by run, so that
	// outcomes, resolutions and notes name real ones mostly.
	intents map[string][]known
	// burst counts effects put in flight in one run at once.
	burst int
	// limited counts the cancels stopgate made (budgets, tripwires).
	limited int
}

type known struct {
	key      string
	attempts int
}

var (
	runIDs   = []string{"r0", "r1", "r2", "r3"}
	keyNames = []string{"k0", "k1", "k2", "claim:s1", "retry:s1:2", "d-aa.2"}
	bases    = []string{"d-aa", "d-bb", "d-cc"}
	methods  = []string{"GET", "POST"}
	targets  = []string{"https://a.example/x", "https://b.example/y"}
	owners   = []string{"proxy:1", "proxy:2"}
)

func (h *history) ctx() context.Context { return context.Background() }

// step draws one operation and runs it everywhere.
func (h *history) step() {
	t := h.t
	run := rapid.SampledFrom(runIDs).Draw(t, "run")
	switch op := rapid.IntRange(0, 19).Draw(t, "op"); {
	case op == 0:
		req := state.AdmitRequest{RunID: run, Actor: "operator:t", Reason: "start", Budget: h.budget()}
		h.same("admit", func(s state.Store) any { r, err := s.Admit(h.ctx(), req); return resultOf(r, err) })
	case op <= 7:
		h.guard(run)
	case op <= 10:
		h.finish(run, op == 10)
	case op == 11:
		req := state.CancelRequest{RunID: run, Actor: "operator:t", Reason: "stop",
			DrainTimeout: time.Duration(rapid.IntRange(0, 3).Draw(t, "drain s")) * time.Second}
		h.same("cancel", func(s state.Store) any { r, err := s.Cancel(h.ctx(), req); return resultOf(r, err) })
	case op == 12:
		req := state.CompleteRequest{RunID: run, Version: int64(rapid.IntRange(1, 2).Draw(t, "version")), Actor: "operator:t"}
		h.same("complete", func(s state.Store) any { r, err := s.Complete(h.ctx(), req); return resultOf(r, err) })
	case op <= 14:
		req := state.TickRequest{RunID: run, Actor: "sweeper:t"}
		h.same("tick", func(s state.Store) any { r, err := s.Tick(h.ctx(), req); return resultOf(r, err) })
	case op == 15:
		k := h.someKey(run)
		req := state.ResolveRequest{RunID: run, Key: k.key, Applied: rapid.Bool().Draw(t, "applied"), Source: "operator", Note: "checked", Actor: "operator:t"}
		switch rapid.IntRange(0, 2).Draw(t, "resolved by") {
		case 1:
			req.Source, req.Actor = "lookup", "reconciler:1"
		case 2:
			req.Source, req.Actor = "stripe", "webhook:stripe"
		}
		h.same("resolve", func(s state.Store) any { r, err := s.Resolve(h.ctx(), req); return resultOf(r, err) })
	case op == 16:
		k := h.someKey(run)
		req := state.NoteRequest{RunID: run, Key: k.key, Kind: state.EventIntentCut, Reason: "client gone", Actor: "proxy:1"}
		h.same("note", func(s state.Store) any { return resultOf(nil, s.Note(h.ctx(), req)) })
	case op == 17:
		var refs []state.IntentRef
		for range rapid.IntRange(1, 3).Draw(t, "refs") {
			refs = append(refs, state.IntentRef{RunID: rapid.SampledFrom(runIDs).Draw(t, "ref run"), Key: h.someKey(run).key})
		}
		req := state.RenewRequest{Owner: rapid.SampledFrom(owners).Draw(t, "owner"), TTL: time.Minute, Refs: refs}
		h.same("renew", func(s state.Store) any { r, err := s.Renew(h.ctx(), req); return resultOf(renewal(r), err) })
	default:
		// Time passes: a little, past a lease, past a drain deadline.
		d := rapid.SampledFrom([]time.Duration{time.Millisecond, 500 * time.Millisecond, 2 * time.Second, 31 * time.Second}).Draw(t, "advance")
		h.clock.Advance(d)
	}
}

func (h *history) guard(run string) {
	t := h.t
	req := state.GuardRequest{RunID: run, Boundary: state.BoundaryHTTP, Actor: "proxy:1",
		Method: rapid.SampledFrom(methods).Draw(t, "method"), Target: rapid.SampledFrom(targets).Draw(t, "target"),
		BodyDigest: rapid.SampledFrom([]string{"", "sha256:1", "sha256:2"}).Draw(t, "digest"),
		AutoAdmit:  rapid.Bool().Draw(t, "auto-admit"), ObservedVersion: int64(rapid.IntRange(0, 2).Draw(t, "observed")),
		LeaseOwner: rapid.SampledFrom(owners).Draw(t, "lease owner"),
		LeaseTTL:   time.Duration(rapid.SampledFrom([]int{1, 30}).Draw(t, "lease s")) * time.Second}
	if rapid.Bool().Draw(t, "explicit") {
		req.Key, req.ExplicitKey = rapid.SampledFrom(keyNames).Draw(t, "key"), true
	} else {
		req.Key = rapid.SampledFrom(bases).Draw(t, "base")
	}
	switch rapid.IntRange(0, 10).Draw(t, "kind") {
	case 0:
		req.Boundary, req.NotBefore, req.LeaseTTL = state.BoundaryRetry, h.clock.Now().Add(time.Minute), 0
	case 1:
		req.Boundary, req.AllowCancelling = state.BoundaryDelivery, true
	case 2:
		req.Refuse = "destination_denied"
	case 3:
		req.Boundary = state.BoundaryCustom
	case 4:
		req.Tripwire, req.TripwireDrain = "no-paste", time.Second
	}
	req.RequestBytes = int64(rapid.SampledFrom([]int{0, 0, 10, 40}).Draw(t, "request bytes"))
	if req.AutoAdmit {
		req.Budget = h.budget()
	}
	n := 1
	if rapid.IntRange(0, 7).Draw(t, "burst?") == 0 {
		// Many at once: past the sixteen leases a run's lease set holds
		// as a list.
		n = 18
	}
	for i := range n {
		r := req
		if n > 1 && !r.ExplicitKey {
			r.Target = fmt.Sprintf("%s?i=%d", r.Target, i)
		}
		got := h.same("guard", func(s state.Store) any { res, err := s.Guard(h.ctx(), r); return resultOf(res, err) })
		if res, ok := got.(result); ok {
			if g, ok := res.value.(state.GuardResult); ok && g.Intent.Key != "" {
				h.remember(run, known{key: g.Intent.Key, attempts: g.Intent.Attempts})
			}
		}
	}
}

func (h *history) finish(run string, later bool) {
	t := h.t
	k := h.someKey(run)
	attempt := k.attempts
	if rapid.IntRange(0, 5).Draw(t, "stale attempt?") == 0 {
		attempt++
	}
	req := state.FinishRequest{RunID: run, Key: k.key, Attempt: max(attempt, 1), Actor: "proxy:1",
		Outcome: rapid.SampledFrom([]state.IntentState{state.IntentResponded, state.IntentNotSent, state.IntentUnknown, state.IntentNotApplied}).Draw(t, "outcome")}
	if req.Outcome == state.IntentResponded {
		req.StatusCode = 200
	}
	if req.Outcome == state.IntentNotApplied {
		req.Source = state.SourceSafeMethod
	}
	req.ResponseBytes = int64(rapid.SampledFrom([]int{0, 0, 30, 120}).Draw(t, "response bytes"))
	switch rapid.IntRange(0, 4).Draw(t, "llm") {
	case 1:
		req.LLM = &state.LLMUsage{Model: rapid.SampledFrom([]string{"", "m-a", "m:b"}).Draw(t, "model"), Known: true,
			InputTokens: int64(rapid.IntRange(0, 30).Draw(t, "in")), OutputTokens: int64(rapid.IntRange(0, 30).Draw(t, "out"))}
		if rapid.Bool().Draw(t, "priced") {
			req.LLM.Priced, req.LLM.Spend = true, int64(rapid.IntRange(0, 900).Draw(t, "spend"))
		}
	case 2:
		req.LLM = &state.LLMUsage{Model: "m-a"}
	}
	if later {
		h.same("finish later", func(s state.Store) any {
			ch := make(chan error, 1)
			s.FinishLater(h.ctx(), req, func(err error) { ch <- err })
			select {
			case err := <-ch:
				return resultOf(nil, err)
			case <-time.After(10 * time.Second):
				return "FinishLater never answered"
			}
		})
		return
	}
	h.same("finish", func(s state.Store) any { r, err := s.Finish(h.ctx(), req); return resultOf(r, err) })
}

// budget is a budget for an admission: none, mostly, or small limits
// that a history crosses.
func (h *history) budget() state.Budget {
	t := h.t
	if rapid.IntRange(0, 2).Draw(t, "budget?") == 0 {
		return state.Budget{}
	}
	pick := func(label string, vals ...int) int64 { return int64(rapid.SampledFrom(vals).Draw(t, label)) }
	return state.Budget{
		MaxEffects:               pick("max effects", 0, 2, 5),
		MaxEffectsPerDestination: pick("max per destination", 0, 0, 2),
		MaxRequestBytes:          pick("max request bytes", 0, 0, 60),
		MaxResponseBytes:         pick("max response bytes", 0, 0, 200),
		MaxWallTime:              time.Duration(pick("max wall s", 0, 0, 3)) * time.Second,
		MaxTokens:                pick("max tokens", 0, 40),
		MaxInputTokens:           pick("max input tokens", 0, 0, 25),
		MaxSpend:                 pick("max spend", 0, 0, 1000),
		CancelOnUnknownUsage:     rapid.Bool().Draw(t, "cancel on unknown"),
		DrainTimeout:             time.Duration(pick("budget drain s", 0, 2)) * time.Second,
	}
}

func (h *history) remember(run string, k known) {
	if h.intents == nil {
		h.intents = map[string][]known{}
	}
	for i, old := range h.intents[run] {
		if old.key == k.key {
			h.intents[run][i] = k
			return
		}
	}
	h.intents[run] = append(h.intents[run], k)
}

// someKey is a key a guard of run named, mostly, or one it never did.
func (h *history) someKey(run string) known {
	ks := h.intents[run]
	if len(ks) == 0 || rapid.IntRange(0, 9).Draw(h.t, "unknown key?") == 0 {
		return known{key: rapid.SampledFrom(keyNames).Draw(h.t, "any key"), attempts: 1}
	}
	return rapid.SampledFrom(ks).Draw(h.t, "known key")
}

// result is an answer in a form compared across stores: the value, and the
// error by what it says, not by how each store words its own failures.
type result struct {
	value any
	err   string
}

func resultOf(v any, err error) any {
	r := result{value: v}
	var c *state.Conflict
	switch {
	case err == nil:
	case errors.As(err, &c):
		var in any
		if c.Intent != nil {
			in = *c.Intent
		}
		r.err = fmt.Sprintf("conflict %s: run %+v, intent %+v, %s", c.Code, normal(c.Run), in, c.Detail)
	case errors.Is(err, state.ErrNotFound):
		r.err = "not found"
	case errors.Is(err, state.ErrInvalid):
		r.err = "invalid: " + err.Error()
	case errors.Is(err, state.ErrUnavailable):
		r.err = "unavailable"
	default:
		r.err = "error: " + err.Error()
	}
	return r
}

// renewal is a renewal's answer in an order that does not depend on the
// order a store walked its runs in.
func renewal(r state.RenewResult) state.RenewResult {
	slices.SortStableFunc(r.Renewed, func(a, b state.Intent) int {
		return cmp.Or(strings.Compare(a.RunID, b.RunID), strings.Compare(a.Key, b.Key))
	})
	return r
}

// same runs op on the model and on every store and fails at the first
// answer that differs from the model's; it returns the model's.
func (h *history) same(name string, op func(s state.Store) any) any {
	before := h.model.stopgateCancels()
	want := op(h.model)
	h.limited += h.model.stopgateCancels() - before
	for i, s := range h.stores {
		if got := op(s); !reflect.DeepEqual(normal(got), normal(want)) {
			h.t.Fatalf("%s: %s answered\n  %+v\nthe model\n  %+v", name, h.names[i], got, want)
		}
	}
	return want
}

// compareAll compares every run's row, intents and events, and the
// totals, with the model's.
func (h *history) compareAll() {
	h.same("totals", func(s state.Store) any { r, err := s.Totals(h.ctx()); return resultOf(r, err) })
	for _, run := range runIDs {
		want := h.dump(h.model, run)
		for i, s := range h.stores {
			if got := h.dump(s, run); !reflect.DeepEqual(got, want) {
				h.t.Fatalf("run %s at the end: %s holds\n  %+v\nthe model\n  %+v", run, h.names[i], got, want)
			}
		}
	}
}

type dump struct {
	row     any
	intents any
	events  any
}

func (h *history) dump(s state.Store, run string) dump {
	row, err := s.Get(h.ctx(), run)
	ins, err2 := s.Intents(h.ctx(), run)
	evs, err3 := s.Events(h.ctx(), run)
	return dump{normal(resultOf(row, err)), normal(resultOf(ins, err2)), normal(resultOf(evs, err3))}
}

// normal makes answers comparable: empty and nil maps and slices alike.
func normal(v any) any {
	switch x := v.(type) {
	case result:
		return result{value: normal(x.value), err: x.err}
	case state.Run:
		if len(x.Intents) == 0 {
			x.Intents = nil
		}
		if len(x.Usage) == 0 {
			x.Usage = nil
		}
		return x
	case state.AdmitResult:
		x.Run = normal(x.Run).(state.Run)
		return x
	case state.CancelResult:
		x.Run = normal(x.Run).(state.Run)
		return x
	case state.GuardResult:
		x.Run = normal(x.Run).(state.Run)
		return x
	case state.RenewResult:
		for id, r := range x.Runs {
			x.Runs[id] = normal(r).(state.Run)
		}
		if len(x.Runs) == 0 {
			x.Runs = nil
		}
		if len(x.Renewed) == 0 {
			x.Renewed = nil
		}
		return x
	case []state.Intent:
		if len(x) == 0 {
			return []state.Intent(nil)
		}
		return x
	case []state.Event:
		if len(x) == 0 {
			return []state.Event(nil)
		}
		return x
	}
	return v
}
