package statetest

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/machine"
)

// Model is the state machine alone: the rules of package machine applied
// to runs held in memory, one step at a time under one lock. It is what
// the stores must answer as (the differential suite compares them with
// it), and it checks every expectation a rule states against what it
// holds, so that a rule that expects less than it read shows here first.
// It keeps nothing on disk and is for tests only.
type Model struct {
	// Clock gives each step its time; time.Now when nil.
	Clock func() time.Time

	mu     sync.Mutex
	runs   map[string]*modelRun
	subs   []chan string
	closed bool
	// resolved counts the reconciliations applied, by source, read from
	// the records and events written (not from the rules' tallies, which
	// the stores' totals are checked against).
	resolved map[string]int64
}

type modelRun struct {
	row     state.Run
	last    time.Time // the run's last step, which no later step is dated before
	final   time.Time // when it became final (retention)
	intents map[string]*modelIntent
	order   []string
	derived map[string]int64
	events  []state.Event
	usage   state.Usage
}

type modelIntent struct {
	rec state.Intent
	ord int
}

var _ state.Store = (*Model)(nil)

// NewModel returns an empty model.
func NewModel() *Model { return &Model{runs: map[string]*modelRun{}} }

func (m *Model) now(r *modelRun) time.Time {
	now := time.Now()
	if m.Clock != nil {
		now = m.Clock()
	}
	now = now.UTC().Truncate(time.Millisecond)
	if r != nil && r.last.After(now) {
		now = r.last
	}
	return now
}

// modelView is a run as a rule reads it.
type modelView struct{ r *modelRun }

func (v modelView) Row() (state.Run, bool, error) {
	if v.r == nil {
		return state.Run{}, false, nil
	}
	row := v.r.row
	row.Intents = maps.Clone(row.Intents)
	return row, true, nil
}

func (v modelView) Intent(key string) (state.Intent, bool, error) {
	if v.r == nil {
		return state.Intent{}, false, nil
	}
	in, ok := v.r.intents[key]
	if !ok {
		return state.Intent{}, false, nil
	}
	return in.rec, true, nil
}

func (v modelView) Taken(key string) (bool, error) {
	return v.r != nil && v.r.intents[key] != nil, nil
}

func (v modelView) Derived(base string) (int64, error) {
	if v.r == nil {
		return 0, nil
	}
	return v.r.derived[base], nil
}

func (v modelView) Usage(counter string) (int64, error) {
	if v.r == nil {
		return 0, nil
	}
	return v.r.usage[counter], nil
}

// row is the run's row as Get reads it: with its usage.
func (r *modelRun) rowWithUsage() state.Run {
	row, _, _ := modelView{r}.Row()
	if len(r.usage) > 0 {
		row.Usage = maps.Clone(r.usage)
	}
	return row
}

func (v modelView) withState(st state.IntentState) []state.Intent {
	if v.r == nil {
		return nil
	}
	var out []state.Intent
	for _, k := range v.r.order {
		if in := v.r.intents[k]; in.rec.State == st {
			out = append(out, in.rec)
		}
	}
	return out
}

func (v modelView) InFlight() ([]state.Intent, error) { return v.withState(state.IntentInFlight), nil }
func (v modelView) Scheduled() ([]state.Intent, error) {
	return v.withState(state.IntentScheduled), nil
}

// step runs one rule on a run under the lock, checks its expectations and
// applies its mutation.
func (m *Model) step(id string, rule func(v machine.View, now time.Time) (*machine.Mutation, error)) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return fmt.Errorf("model: %w: closed", state.ErrUnavailable)
	}
	r := m.runs[id]
	mut, err := rule(modelView{r}, m.now(r))
	if err != nil || mut == nil {
		return err
	}
	if deadline, late := machine.Late(mut, m.now(nil)); late {
		return fmt.Errorf("model: guard run %s: %w: its deadline %s passed before its turn; nothing was recorded", id, state.ErrUnavailable, deadline)
	}
	if err := m.check(r, mut); err != nil {
		panic(err)
	}
	m.apply(id, r, mut)
	return nil
}

// check verifies that a rule's expectations hold of what it read: they
// must, since nothing came between.
func (m *Model) check(r *modelRun, mut *machine.Mutation) error {
	for _, e := range mut.Expect {
		ok := true
		switch e.Kind {
		case machine.ExpectRowAbsent:
			ok = r == nil
		case machine.ExpectStatus:
			ok = r != nil && r.row.Status == e.Status
		case machine.ExpectVersion:
			ok = r != nil && r.row.CancelVersion == e.N
		case machine.ExpectCount:
			ok = r != nil && int64(r.row.Intents[e.State]) == e.N
		case machine.ExpectCountAtLeast:
			ok = r != nil && int64(r.row.Intents[e.State]) >= e.N
		case machine.ExpectIntentAbsent:
			ok = r == nil || r.intents[e.Key] == nil
		case machine.ExpectIntentPresent, machine.ExpectIntent:
			ok = r != nil && r.intents[e.Key] != nil
		case machine.ExpectIntentAt:
			in := r.intents[e.Key]
			ok = in != nil && in.rec.State == e.State && int64(in.rec.Attempts) == e.N && in.rec.Refusals == e.Refusals
		case machine.ExpectDerived:
			ok = r != nil && r.derived[e.Key] == e.N
		case machine.ExpectNotAfter:
			// The clock's, checked by step.
		case machine.ExpectUsageAtMost:
			ok = r.usageOf(e.Key) <= e.N
		case machine.ExpectUsageAtLeast:
			ok = r.usageOf(e.Key) >= e.N
		}
		if !ok {
			return fmt.Errorf("model: run %s: a rule expected %+v, which does not hold of what it read", mut.RunID, e)
		}
	}
	return nil
}

func (r *modelRun) usageOf(counter string) int64 {
	if r == nil {
		return 0
	}
	return r.usage[counter]
}

func (m *Model) apply(id string, r *modelRun, mut *machine.Mutation) {
	if mut.Create {
		r = &modelRun{row: mut.Row, intents: map[string]*modelIntent{}, derived: map[string]int64{}}
		r.row.Intents = map[state.IntentState]int{}
		m.runs[id] = r
	} else if mut.RowChanged {
		counts, pruned, budget := r.row.Intents, r.row.PrunedAt, r.row.Budget
		r.row = mut.Row
		r.row.Intents, r.row.PrunedAt, r.row.Budget = counts, pruned, budget
	}
	r.row.Usage = nil
	for _, u := range mut.Usage {
		if r.usage == nil {
			r.usage = state.Usage{}
		}
		r.usage[u.Counter] += u.N
	}
	mut.Counts.Each(func(st state.IntentState, d int) {
		if r.row.Intents[st] += d; r.row.Intents[st] == 0 {
			delete(r.row.Intents, st)
		}
	})
	for _, w := range mut.Intents {
		if w.From == state.IntentUnknown && w.Rec.State != state.IntentUnknown {
			m.countResolution(w.Rec, mut.Events)
		}
		in := r.intents[w.Rec.Key]
		if in == nil {
			in = &modelIntent{ord: len(r.order) + 1}
			r.intents[w.Rec.Key] = in
			r.order = append(r.order, w.Rec.Key)
		}
		in.rec = w.Rec
	}
	for _, d := range mut.Derived {
		r.derived[d.Base] = d.N
	}
	r.events = append(r.events, mut.Events...)
	r.last = mut.Now
	if r.row.Final() && r.final.IsZero() {
		r.final = mut.Now
	}
	if mut.Publish {
		for _, ch := range m.subs {
			select {
			case ch <- id:
			default:
			}
		}
	}
}

// countResolution counts the reconciliation of an UNKNOWN record, now
// rec, by where it came from: a late answer, or the source and actor of
// its event.
func (m *Model) countResolution(rec state.Intent, events []state.Event) {
	src := state.ResolutionResponse
	if rec.State != state.IntentResponded {
		req := state.ResolveRequest{Source: rec.Source}
		for _, e := range events {
			if e.Intent == rec.Key && e.Kind == state.EventIntentResolved {
				req.Actor = e.Actor
			}
		}
		src = state.ResolutionSource(req)
	}
	if m.resolved == nil {
		m.resolved = map[string]int64{}
	}
	m.resolved[src]++
}

// Totals counts the runs the model holds, row by row.
func (m *Model) Totals(context.Context) (state.Totals, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	t := state.Totals{Runs: map[state.Status]int64{}, Resolutions: map[string]int64{}}
	for _, st := range state.Statuses {
		t.Runs[st] = 0
	}
	for _, src := range state.ResolutionSources {
		t.Resolutions[src] = m.resolved[src]
	}
	for _, r := range m.runs {
		t.Runs[r.row.Status]++
		t.UnknownIntents += int64(r.row.Intents[state.IntentUnknown])
	}
	return t, nil
}

// oneStep runs rule on run as one step of the model and answers what the
// rule answers.
func oneStep[R, T any](m *Model, run string, rule func(machine.View, R, time.Time) (T, *machine.Mutation, error), req R) (T, error) {
	var out T
	err := m.step(run, func(v machine.View, now time.Time) (mut *machine.Mutation, err error) {
		out, mut, err = rule(v, req, now)
		return mut, err
	})
	return out, err
}

func (m *Model) Admit(_ context.Context, req state.AdmitRequest) (state.AdmitResult, error) {
	if err := req.Validate(); err != nil {
		return state.AdmitResult{}, err
	}
	return oneStep(m, req.RunID, machine.Admit, req)
}

func (m *Model) Cancel(_ context.Context, req state.CancelRequest) (state.CancelResult, error) {
	if err := req.Validate(); err != nil {
		return state.CancelResult{}, err
	}
	return oneStep(m, req.RunID, machine.Cancel, req)
}

func (m *Model) Complete(_ context.Context, req state.CompleteRequest) (state.Run, error) {
	if err := req.Validate(); err != nil {
		return state.Run{}, err
	}
	return oneStep(m, req.RunID, machine.Complete, req)
}

func (m *Model) Guard(_ context.Context, req state.GuardRequest) (state.GuardResult, error) {
	if err := req.Validate(); err != nil {
		return state.GuardResult{}, err
	}
	return oneStep(m, req.RunID, machine.Guard, req)
}

func (m *Model) Finish(_ context.Context, req state.FinishRequest) (state.Intent, error) {
	if err := req.Validate(); err != nil {
		return state.Intent{}, err
	}
	return oneStep(m, req.RunID, machine.Finish, req)
}

// FinishLater is Finish, answered at once: the model has no writes to
// ride with.
func (m *Model) FinishLater(ctx context.Context, req state.FinishRequest, done func(error)) {
	_, err := m.Finish(ctx, req)
	done(err)
}

func (m *Model) Resolve(_ context.Context, req state.ResolveRequest) (state.Intent, error) {
	if err := req.Validate(); err != nil {
		return state.Intent{}, err
	}
	return oneStep(m, req.RunID, machine.Resolve, req)
}

func (m *Model) Note(_ context.Context, req state.NoteRequest) error {
	if err := req.Validate(); err != nil {
		return err
	}
	return m.step(req.RunID, func(v machine.View, now time.Time) (*machine.Mutation, error) {
		return machine.Note(v, req, now)
	})
}

func (m *Model) Renew(_ context.Context, req state.RenewRequest) (state.RenewResult, error) {
	if err := req.Validate(); err != nil {
		return state.RenewResult{}, err
	}
	out := state.RenewResult{Runs: map[string]state.Run{}}
	runs, byRun := req.ByRun()
	for _, id := range runs {
		err := m.step(id, func(v machine.View, now time.Time) (*machine.Mutation, error) {
			r, mut, err := machine.Renew(v, id, req.Owner, req.TTL, byRun[id], now)
			if err == nil && r.Found {
				out.Runs[id] = r.Run
				out.Renewed = append(out.Renewed, r.Renewed...)
			}
			return mut, err
		})
		if err != nil {
			return state.RenewResult{}, err
		}
	}
	return out, nil
}

func (m *Model) Tick(_ context.Context, req state.TickRequest) (state.Run, error) {
	if err := req.Validate(); err != nil {
		return state.Run{}, err
	}
	return oneStep(m, req.RunID, machine.Tick, req)
}

func (m *Model) run(id string) (*modelRun, error) {
	if err := state.ValidateRunID(id); err != nil {
		return nil, err
	}
	r := m.runs[id]
	if r == nil {
		return nil, fmt.Errorf("run %s: %w", id, state.ErrNotFound)
	}
	return r, nil
}

func (m *Model) Get(_ context.Context, id string) (state.Run, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, err := m.run(id)
	if err != nil {
		return state.Run{}, err
	}
	return r.rowWithUsage(), nil
}

func (m *Model) List(_ context.Context, status state.Status) ([]state.Run, error) {
	if status != "" && !slices.Contains(state.Statuses, status) {
		return nil, fmt.Errorf("%w: unknown run status %q", state.ErrInvalid, status)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []state.Run
	for _, id := range slices.Sorted(maps.Keys(m.runs)) {
		if row := m.runs[id].rowWithUsage(); status == "" || row.Status == status {
			out = append(out, row)
		}
	}
	return out, nil
}

func (m *Model) ids(keep func(state.Run) bool) []string {
	var out []string
	for _, id := range slices.Sorted(maps.Keys(m.runs)) {
		if keep(m.runs[id].row) {
			out = append(out, id)
		}
	}
	return out
}

func (m *Model) DrainingRuns(context.Context) ([]string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.ids(func(r state.Run) bool { return r.Status == state.StatusCancelling || r.Status == state.StatusUnknown }), nil
}

func (m *Model) ActiveRuns(_ context.Context, after string, limit int) ([]string, error) {
	if err := state.ValidatePage(after, limit); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for _, id := range m.ids(func(r state.Run) bool { return r.Status == state.StatusActive }) {
		if id > after && len(out) < limit {
			out = append(out, id)
		}
	}
	return out, nil
}

func (m *Model) Intent(_ context.Context, id, key string) (state.Intent, error) {
	if err := state.ValidateKey(key); err != nil {
		return state.Intent{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	r, err := m.run(id)
	if err != nil {
		return state.Intent{}, err
	}
	in := r.intents[key]
	if in == nil {
		return state.Intent{}, fmt.Errorf("run %s intent %s: %w", id, key, state.ErrNotFound)
	}
	return in.rec, nil
}

func (m *Model) Intents(_ context.Context, id string) ([]state.Intent, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, err := m.run(id)
	if err != nil {
		return nil, err
	}
	out := make([]state.Intent, 0, len(r.order))
	for _, k := range r.order {
		out = append(out, r.intents[k].rec)
	}
	return out, nil
}

func (m *Model) Events(_ context.Context, id string) ([]state.Event, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, err := m.run(id)
	if err != nil {
		return nil, err
	}
	return slices.Clone(r.events), nil
}

// Prune removes the intents and events of final runs, oldest first; the
// rows stay.
func (m *Model) Prune(_ context.Context, req state.PruneRequest) (int, error) {
	if err := req.Validate(); err != nil {
		return 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for _, id := range slices.Sorted(maps.Keys(m.runs)) {
		r := m.runs[id]
		if n == req.Limit || !r.row.Final() || r.final.IsZero() || !r.final.Before(req.FinalBefore) {
			continue
		}
		r.intents, r.order, r.derived, r.events = map[string]*modelIntent{}, nil, map[string]int64{}, nil
		r.row.PrunedAt, r.final = m.now(r), time.Time{}
		n++
	}
	return n, nil
}

func (m *Model) Cancels(ctx context.Context) (<-chan string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	ch := make(chan string, 256)
	m.subs = append(m.subs, ch)
	return ch, nil
}

func (m *Model) Ping(context.Context) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return fmt.Errorf("model: %w: closed", state.ErrUnavailable)
	}
	return nil
}

func (m *Model) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.closed = true
	return nil
}

// stopgateCancels counts the cancels stopgate made itself (a budget, a
// tripwire) in every run the model holds.
func (m *Model) stopgateCancels() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for _, r := range m.runs {
		for _, e := range r.events {
			if e.Kind == state.EventRunCancelled && e.Actor == state.ActorStopgate {
				n++
			}
		}
	}
	return n
}
