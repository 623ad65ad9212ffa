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
	"time"

	"github.com/stopgate/stopgate/state"
)

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

// ErrLate is the answer to a guard whose fence (NotAfter) the step's time
// has passed; it wraps state.ErrUnavailable, and nothing is written.
var ErrLate = errLate{}

type errLate struct{}

func (errLate) Error() string {
	return "the guard's deadline passed before its turn; nothing was recorded"
}
func (errLate) Unwrap() error { return state.ErrUnavailable }

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
	Counts map[state.IntentState]int
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
}

// Empty reports whether the mutation writes nothing.
func (m *Mutation) Empty() bool {
	return m == nil || !m.Create && !m.RowChanged && len(m.Counts) == 0 && len(m.Intents) == 0 &&
		len(m.Derived) == 0 && len(m.Events) == 0
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
	// fence).
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
	// read is the row as read (its counts among them), for expectations.
	read   state.Run
	counts map[state.IntentState]int
	// intents are the records the step read or wrote, as they now stand.
	intents map[string]*state.Intent
}

func newStep(v View, runID string, now time.Time) *step {
	return &step{v: v, now: now.UTC().Truncate(time.Millisecond), m: Mutation{RunID: runID}}
}

// readRow reads the row once.
func (s *step) readRow() (bool, error) {
	row, found, err := s.v.Row()
	if err != nil {
		return false, err
	}
	s.row, s.found, s.read = row, found, row
	s.row.Intents = maps.Clone(row.Intents)
	if s.row.Intents == nil {
		s.row.Intents = map[state.IntentState]int{}
	}
	s.counts = row.Intents
	s.m.Now = s.now
	return found, nil
}

// intent reads the record under key, or the step's own write of it.
func (s *step) intent(key string) (*state.Intent, error) {
	if in, ok := s.intents[key]; ok {
		return in, nil
	}
	rec, ok, err := s.v.Intent(key)
	if err != nil {
		return nil, err
	}
	if s.intents == nil {
		s.intents = map[string]*state.Intent{}
	}
	if !ok {
		s.intents[key] = nil
		return nil, nil
	}
	s.intents[key] = &rec
	return &rec, nil
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
	if s.m.Counts == nil {
		s.m.Counts = map[state.IntentState]int{}
	}
	if from != "" {
		s.m.Counts[from]--
		if s.row.Intents[from]--; s.row.Intents[from] <= 0 {
			delete(s.row.Intents, from)
		}
	}
	if to != "" {
		s.m.Counts[to]++
		s.row.Intents[to]++
	}
}

// put writes a record that was in state from ("" for a new one).
func (s *step) put(rec state.Intent, from state.IntentState, mutable bool) {
	s.count(from, rec.State)
	s.m.Intents = append(s.m.Intents, IntentWrite{Rec: rec, From: from, Mutable: mutable})
	if s.intents == nil {
		s.intents = map[string]*state.Intent{}
	}
	in := rec
	s.intents[rec.Key] = &in
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

// done is the step's mutation, with the row as it stands.
func (s *step) done() *Mutation {
	s.m.Row = s.row
	s.m.Row.Intents = nil
	if s.m.Empty() {
		return nil
	}
	return &s.m
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

// Status reasons of a run leaving CANCELLING or UNKNOWN, and the reasons
// the rules give an intent or an event.
const (
	ReasonAutoAdmit    = "auto-admit"
	ReasonDrained      = "drained"
	ReasonUnresolved   = "unresolved_intents"
	ReasonDrainTimeout = "drain_timeout"
	ReasonReconciled   = "reconciled"
	ReasonLeaseExpired = "lease_expired"
	ReasonRunCancelled = "run_cancelled"
	ReasonLateResponse = "late_response"
)

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
