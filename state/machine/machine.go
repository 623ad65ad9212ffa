// Package machine decides every step of a run's state machine, once, for
// every store: admit, cancel, complete, the guard, an outcome, a
// reconciliation, a note, a lease renewal and a tick. Each rule is a
// function of what the step reads of its run (a View) and of the request;
// it answers what the caller is told, and a Mutation: what the step
// writes, and what it read that must still hold when the write is applied.
//
// A store applies a mutation atomically under its expectations: the
// embedded store in the bbolt transaction it read the view in (where they
// hold by construction), Redis with one small generic program that checks
// them and writes, so that what the rules decided read and what Redis
// holds cannot differ (a failed expectation is read again and decided
// again). docs/state-machine.md is these rules in prose.
//
// It never touches storage, never keeps state between steps and never
// reads a clock: the store gives each step its time.
package machine

import (
	"errors"
	"maps"
	"sync"
	"time"

	"github.com/stopgate/stopgate/state"
)

// Late reports whether m is a guard whose fence (ExpectNotAfter) a store
// whose own clock reads now must refuse: nothing of it may be written.
func Late(m *Mutation, now time.Time) (time.Time, bool) {
	if m == nil {
		return time.Time{}, false
	}
	for _, e := range m.Expect {
		if e.Kind == ExpectNotAfter && now.UnixMilli() > e.Time.UnixMilli() {
			return e.Time, true
		}
	}
	return time.Time{}, false
}

// View is what one step reads of its run. A store answers from its
// transaction, or from what it read of the run; a view that does not know
// something (Redis deciding from what it last saw of the run, without
// reading it) answers ErrUnknown, and the store reads the run and decides
// again.
type View interface {
	// Row is the run's row with its intent counts; false for a run never
	// seen.
	Row() (state.Run, bool, error)
	// Intent is the record under key; false for none.
	Intent(key string) (state.Intent, bool, error)
	// Taken reports whether a record exists under key, whatever it says
	// (how derived keys are named).
	Taken(key string) (bool, error)
	// Derived is the dispatch counter of a derived key base (0: none kept).
	Derived(base string) (int64, error)
	// InFlight lists the run's IN_FLIGHT intents, Scheduled its
	// SCHEDULED ones, in creation order.
	InFlight() ([]state.Intent, error)
	Scheduled() ([]state.Intent, error)
}

// ErrUnknown is a view's answer for what it does not know: the store reads
// the run and decides again.
var ErrUnknown = errors.New("machine: the view does not know; read the run")

// Mutation is what one step writes, and what it read that must still hold.
// The zero Mutation writes nothing.
type Mutation struct {
	RunID string
	// Now is the step's time: every time it writes is Now, or Now plus a
	// lease or a drain.
	Now time.Time
	// Create: the step creates the row (Row is all of it).
	Create bool
	// RowChanged: the row's own fields changed to those of Row (status,
	// version, reasons, times); its counts change by Counts alone.
	RowChanged bool
	Row        state.Run
	// Counts are the changes to the row's intent counts, by state.
	Counts Counts
	// Intents are the records written, in the order written.
	Intents []IntentWrite
	// Derived sets dispatch counters of derived key bases.
	Derived []DerivedWrite
	// Events are appended to the run's audit log, in order.
	Events []state.Event
	// Publish: the step committed a cancel, which every instance must hear.
	Publish bool
	// Expect is what the step read that its decision depends on.
	Expect []Expect
	// Tally is what the step changes of the store's totals across runs
	// (state.Totals), which a store adds in the same write.
	Tally []TallyDelta

	// owner is the step whose room the mutation's lists use (Release).
	owner *step
}

// steps keeps the room of steps released (Release) for the next: a step
// costs a few hundred bytes of lists, on every effect's path.
var steps = sync.Pool{New: func() any { return new(step) }}

// Release gives a mutation's room back for a later step: its caller, and
// whatever the caller gave m to, holds nothing of it after (its lists, its
// row); the answers a rule returned are the caller's own and stay. A
// mutation never released is collected as any value is.
func Release(m *Mutation) {
	if m != nil && m.owner != nil {
		s := m.owner
		m.owner = nil
		steps.Put(s)
	}
}

// TallyDelta is a change of one of a store's totals, named by TallyRuns,
// TallyUnknown or TallyResolved.
type TallyDelta struct {
	Name string
	N    int64
}

// The names of the totals. A store keeps each as a counter under its name
// and reads them back with Totals.
const (
	tallyRunsPrefix     = "runs:"
	TallyUnknown        = "intents:UNKNOWN"
	tallyResolvedPrefix = "resolved:"
)

// TallyRuns names the count of runs in status st.
func TallyRuns(st state.Status) string { return tallyRunsPrefix + string(st) }

// TallyResolved names the count of reconciliations from source (a
// state.ResolutionSources one).
func TallyResolved(source string) string { return tallyResolvedPrefix + source }

// TallyOf is what a row adds to the totals: its status and its UNKNOWN
// intents (a store that holds rows it never tallied counts each once).
func TallyOf(row state.Run) []TallyDelta {
	out := []TallyDelta{{TallyRuns(row.Status), 1}}
	if n := row.Intents[state.IntentUnknown]; n != 0 {
		out = append(out, TallyDelta{TallyUnknown, int64(n)})
	}
	return out
}

// Totals reads the totals from counters kept under their names; a name
// it does not know is left out.
func Totals(counters map[string]int64) state.Totals {
	t := state.Totals{Runs: make(map[state.Status]int64, len(state.Statuses)), Resolutions: make(map[string]int64, len(state.ResolutionSources))}
	for _, st := range state.Statuses {
		t.Runs[st] = counters[TallyRuns(st)]
	}
	for _, src := range state.ResolutionSources {
		t.Resolutions[src] = counters[TallyResolved(src)]
	}
	t.UnknownIntents = counters[TallyUnknown]
	return t
}

// Empty reports whether the mutation writes nothing.
func (m *Mutation) Empty() bool {
	return m == nil || !m.Create && !m.RowChanged && m.Counts.Zero() && len(m.Intents) == 0 &&
		len(m.Derived) == 0 && len(m.Events) == 0
}

// Counts are changes to a row's intent counts, one for each state, in the
// order of state.IntentStates: an array, so that a mutation's counts cost
// no allocation of their own.
type Counts [9]int

func init() {
	if len(state.IntentStates) != len(Counts{}) {
		panic("machine: Counts has room for a count of each intent state")
	}
}

// Of is the change to the count of st.
func (c *Counts) Of(st state.IntentState) int { return c[stateIndex(st)] }

func (c *Counts) add(st state.IntentState, d int) { c[stateIndex(st)] += d }

// Zero reports whether no count changes.
func (c *Counts) Zero() bool { return *c == Counts{} }

// Each calls fn for every count that changes, in state order.
func (c *Counts) Each(fn func(st state.IntentState, d int)) {
	for i, d := range c {
		if d != 0 {
			fn(state.IntentStates[i], d)
		}
	}
}

func stateIndex(st state.IntentState) int {
	for i, s := range state.IntentStates {
		if s == st {
			return i
		}
	}
	panic("machine: unknown intent state " + string(st))
}

// IntentWrite is one record as the step leaves it.
type IntentWrite struct {
	Rec state.Intent
	// From is the record's state before the step; "" for a new record,
	// which takes the run's next creation ordinal.
	From state.IntentState
	// Mutable: only the record's moving part changed (state, counts,
	// lease, outcome); what the guard recorded of the effect (boundary,
	// method, target, digest, observed version, creation) is as it was.
	Mutable bool
}

// New reports whether the write creates the record.
func (w IntentWrite) New() bool { return w.From == "" }

// DerivedWrite sets the dispatch counter of a derived key base.
type DerivedWrite struct {
	Base string
	N    int64
}

// ExpectKind names what an expectation says held when the step read it.
type ExpectKind uint8

const (
	// ExpectRowAbsent: no row.
	ExpectRowAbsent ExpectKind = iota + 1
	// ExpectStatus: the row's status is Status.
	ExpectStatus
	// ExpectVersion: the row's cancel_version is N.
	ExpectVersion
	// ExpectCount: the row counts N intents in State.
	ExpectCount
	// ExpectCountAtLeast: the row counts N or more intents in State.
	ExpectCountAtLeast
	// ExpectIntentAbsent: no record under Key.
	ExpectIntentAbsent
	// ExpectIntentPresent: a record under Key, whatever it says.
	ExpectIntentPresent
	// ExpectIntentAt: the record under Key is in State at attempt N with
	// Refusals refusals; its lease and outcome may be anything.
	ExpectIntentAt
	// ExpectIntent: the record under Key is exactly as the view read it.
	ExpectIntent
	// ExpectDerived: the dispatch counter of base Key is N.
	ExpectDerived
	// ExpectNotAfter: the store's own clock is not past Time (a guard's
	// fence). Unlike every other expectation it may fail in the store
	// that read the view, since time moves: every store checks it.
	ExpectNotAfter
)

// Expect is one thing a step read that must still hold when its mutation
// is applied.
type Expect struct {
	Kind     ExpectKind
	Status   state.Status
	State    state.IntentState
	Key      string
	N        int64
	Refusals int
	Time     time.Time
}

// step is one rule's work on a run: what it read, and its mutation, which
// it applies to its own copies so that the rest of the step reads its
// writes.
type step struct {
	v   View
	now time.Time
	m   Mutation

	row   state.Run
	found bool
	// shared: row.Intents is the view's map, copied before a change.
	shared bool
	// readStatus, readVersion and counts are the row as read, for
	// expectations.
	readStatus  state.Status
	readVersion int64
	counts      map[state.IntentState]int
	// intents are the records the step read or wrote, as they now stand
	// (rec nil: none under key).
	intents []touched

	// resolved is the source of the reconciliation the step records.
	resolved string

	// Room for the mutation's lists, so that a step of the common
	// kinds costs one allocation.
	expectBuf [4]Expect
	intentBuf [1]IntentWrite
	eventBuf  [2]state.Event
	touchBuf  [2]touched
}

type touched struct {
	key string
	rec *state.Intent
}

func newStep(v View, runID string, now time.Time) *step {
	s := steps.Get().(*step)
	*s = step{v: v, now: now.UTC().Truncate(time.Millisecond), m: Mutation{RunID: runID}}
	s.m.owner = s
	s.m.Expect, s.m.Intents, s.m.Events, s.intents = s.expectBuf[:0], s.intentBuf[:0], s.eventBuf[:0], s.touchBuf[:0]
	return s
}

// touch is the record under key as the step knows it (ok false: not read).
func (s *step) touched(key string) (*state.Intent, bool) {
	for _, t := range s.intents {
		if t.key == key {
			return t.rec, true
		}
	}
	return nil, false
}

func (s *step) keep(key string, rec *state.Intent) {
	for i := range s.intents {
		if s.intents[i].key == key {
			s.intents[i].rec = rec
			return
		}
	}
	s.intents = append(s.intents, touched{key, rec})
}

// readRow reads the row once.
func (s *step) readRow() (bool, error) {
	row, found, err := s.v.Row()
	if err != nil {
		return false, err
	}
	s.row, s.found, s.readStatus, s.readVersion = row, found, row.Status, row.CancelVersion
	s.shared = true
	s.counts = row.Intents
	s.m.Now = s.now
	return found, nil
}

// intent reads the record under key, or the step's own write of it.
func (s *step) intent(key string) (*state.Intent, error) {
	if in, ok := s.touched(key); ok {
		return in, nil
	}
	rec, ok, err := s.v.Intent(key)
	if err != nil {
		return nil, err
	}
	if !ok {
		s.keep(key, nil)
		return nil, nil
	}
	s.keep(key, &rec)
	return &rec, nil
}

// taken reports whether a record exists under key, the step's own writes
// included.
func (s *step) taken(key string) (bool, error) {
	if in, ok := s.touched(key); ok {
		return in != nil, nil
	}
	return s.v.Taken(key)
}

func (s *step) expect(e Expect) { s.m.Expect = append(s.m.Expect, e) }

// expectCount expects the row's count of st as read.
func (s *step) expectCount(st state.IntentState) {
	s.expect(Expect{Kind: ExpectCount, State: st, N: int64(s.counts[st])})
}

// count moves one intent from one state to another in the row's counts.
func (s *step) count(from, to state.IntentState) {
	if from == to {
		return
	}
	if s.shared || s.row.Intents == nil {
		s.row.Intents = maps.Clone(s.row.Intents)
		if s.row.Intents == nil {
			s.row.Intents = make(map[state.IntentState]int, 2)
		}
		s.shared = false
	}
	if from != "" {
		s.m.Counts.add(from, -1)
		if s.row.Intents[from]--; s.row.Intents[from] <= 0 {
			delete(s.row.Intents, from)
		}
	}
	if to != "" {
		s.m.Counts.add(to, 1)
		s.row.Intents[to]++
	}
}

// put writes a record that was in state from ("" for a new one).
func (s *step) put(rec state.Intent, from state.IntentState, mutable bool) {
	s.count(from, rec.State)
	s.m.Intents = append(s.m.Intents, IntentWrite{Rec: rec, From: from, Mutable: mutable})
	in := rec
	s.keep(rec.Key, &in)
}

// event appends one line to the audit log, at the step's time and the
// row's version as it stands.
func (s *step) event(e state.Event) {
	e.At, e.RunID, e.Version = s.now, s.row.ID, s.row.CancelVersion
	s.m.Events = append(s.m.Events, e)
}

// changeRow marks the row's own fields changed.
func (s *step) changeRow() {
	s.m.RowChanged = true
}

// move changes the run's status with its run.transition event.
func (s *step) move(to state.Status, reason, actor string) {
	from := s.row.Status
	s.row.Status, s.row.StatusReason, s.row.UpdatedAt = to, reason, s.now
	s.changeRow()
	s.event(state.Event{Actor: actor, Kind: state.EventRunTransition, From: string(from), To: string(to), Reason: reason})
}

// done is the step's mutation, with the row as it stands and what it
// changes of the totals.
func (s *step) done() *Mutation {
	s.m.Row = s.row
	s.m.Row.Intents = nil
	if s.m.Empty() {
		return nil
	}
	s.tally()
	return &s.m
}

// tally is what the step changes of the totals: the run's status, its
// UNKNOWN intents, a reconciliation.
func (s *step) tally() {
	var add []TallyDelta
	if to := s.m.Row.Status; s.m.Create || s.m.RowChanged && to != s.readStatus {
		if !s.m.Create {
			add = append(add, TallyDelta{TallyRuns(s.readStatus), -1})
		}
		add = append(add, TallyDelta{TallyRuns(to), 1})
	}
	if d := s.m.Counts.Of(state.IntentUnknown); d != 0 {
		add = append(add, TallyDelta{TallyUnknown, int64(d)})
	}
	if s.resolved != "" {
		add = append(add, TallyDelta{TallyResolved(s.resolved), 1})
	}
	s.m.Tally = add
}

// conflict reports a transition the row's state refuses.
func (s *step) conflict(code string, in *state.Intent, detail string) *state.Conflict {
	c := &state.Conflict{Code: code, Run: s.row, Detail: detail}
	if in != nil {
		i := *in
		c.Intent = &i
	}
	return c
}

// Why is the audit reason of an outcome or a resolution: its source first
// when it has one ("safe_method: run_cancelled").
func Why(source, reason string) string {
	switch {
	case source == "":
		return reason
	case reason == "":
		return source
	}
	return source + ": " + reason
}
