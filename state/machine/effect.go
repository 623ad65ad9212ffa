package machine

import (
	"fmt"
	"strconv"
	"time"

	"github.com/stopgate/stopgate/state"
)

// Guard is the one check-and-record of an effect (docs/state-machine.md,
// The guard): whether the run takes it, under which key it is recorded,
// and the record.
func Guard(v View, req state.GuardRequest, now time.Time) (state.GuardResult, *Mutation, error) {
	s := newStep(v, req.RunID, now)
	found, err := s.readRow()
	if err != nil {
		return state.GuardResult{}, nil, err
	}
	if !found {
		if !req.AutoAdmit {
			// Nothing is recorded for a run nobody admitted.
			return state.GuardResult{Refusal: state.RefusalRunNotAdmitted, Run: state.Run{ID: req.RunID}}, nil, nil
		}
		s.create(state.StatusActive, 1)
		s.budget(req.Budget)
		s.event(state.Event{Actor: req.Actor, Kind: state.EventRunAdmitted, Reason: state.ReasonAutoAdmit, To: string(state.StatusActive)})
	}
	if !req.NotAfter.IsZero() {
		// The fence: a guard whose caller gave up must leave no trace,
		// which the store checks by its own clock (not the step's time,
		// which a clock gone back keeps at the run's last step).
		s.expect(Expect{Kind: ExpectNotAfter, Time: req.NotAfter})
	}
	refusal := runRefusal(s.row, req)
	s.expectRow(req.Refuse == "" && s.row.Status == state.StatusActive && req.ObservedVersion != 0)

	key := req.Key
	var rec *state.Intent
	if req.ExplicitKey {
		if rec, err = s.intent(key); err != nil {
			return state.GuardResult{}, nil, err
		}
		if rec == nil {
			s.expect(Expect{Kind: ExpectIntentAbsent, Key: key})
		} else {
			s.expect(Expect{Kind: ExpectIntent, Key: key})
		}
	} else if key, err = s.derive(req.Key); err != nil {
		return state.GuardResult{}, nil, err
	}

	switch {
	case refusal != "":
		return s.refuseDispatch(req, key, rec, refusal, refusal), s.done(), nil
	case req.Tripwire != "":
		// What an agent must never do: refused and recorded, whatever
		// its key says, and the run cancelled in this same step.
		return s.refuseAndCancel(req, key, rec, state.RefusalTripwire, state.TripwireReason(req.Tripwire), req.TripwireDrain)
	case rec != nil:
		if why := state.ReplayRefusal(*rec, req); why != "" {
			// The record stands as it is; the audit log keeps the attempt.
			s.event(state.Event{Actor: req.Actor, Kind: state.EventIntentRefused, Intent: key, Reason: why})
			return state.GuardResult{Refusal: why, Run: s.row, Intent: *rec}, s.done(), nil
		}
	}
	if req.NotBefore.IsZero() {
		limit, err := s.overBudget(req)
		if err != nil {
			return state.GuardResult{}, nil, err
		}
		if limit != "" {
			return s.refuseAndCancel(req, key, rec, state.RefusalBudgetExceeded, state.BudgetReason(limit), s.row.Budget.DrainTimeout)
		}
	}
	return s.dispatch(req, key, rec), s.done(), nil
}

// refuseAndCancel refuses the effect for cause (budget:<limit>,
// tripwire:<rule>) and, if the run is ACTIVE, cancels it in the same
// step, as stopgate, for the same reason: every instance cuts the run's
// flows as for any cancel.
func (s *step) refuseAndCancel(req state.GuardRequest, key string, rec *state.Intent, refusal, cause string, drain time.Duration) (state.GuardResult, *Mutation, error) {
	res := s.refuseDispatch(req, key, rec, refusal, cause)
	if s.row.Status == state.StatusActive {
		if err := s.cancelRun(cause, state.ActorStopgate, drain, key); err != nil {
			return state.GuardResult{}, nil, err
		}
		res.Run = s.row
	}
	res.Cause = cause
	return res, s.done(), nil
}

// guardLimit is one limit a dispatch is counted against.
type guardLimit struct {
	limit, counter string
	max, add       int64
}

// overBudget is the limit of the run's budget the dispatch would cross,
// "" for none. A limit is crossed when the run's usage would exceed it.
// It expects what it read: each limit it found not crossed stays so with
// the dispatch added (at most max-add before it), and the one crossed
// stays crossed; so that a store whose view of the counters was behind
// writes the decision only if it holds of what the store holds, and
// instances that guard the same run at once cannot both take its last
// effect.
func (s *step) overBudget(req state.GuardRequest) (string, error) {
	b := s.row.Budget
	if !b.Limited() || s.row.Status != state.StatusActive {
		return "", nil
	}
	if b.MaxWallTime > 0 && !s.now.Before(s.row.CreatedAt.Add(b.MaxWallTime)) {
		return state.LimitWallTime, nil
	}
	checks := [3]guardLimit{
		{state.LimitEffects, state.CounterEffects, b.MaxEffects, 1},
		{state.LimitRequestBytes, state.CounterRequestBytes, b.MaxRequestBytes, req.RequestBytes},
	}
	if dest := state.Destination(req.Boundary, req.Target); dest != "" {
		checks[2] = guardLimit{state.LimitEffectsPerDestination, state.DestinationCounter(dest), b.MaxEffectsPerDestination, 1}
	}
	return s.crossed(checks[:], false)
}

// crossed is the first of limits whose counter would exceed it with its
// addition, "" for none, with the expectations of what it read. made: the
// step has added them already (an outcome's usage), so what was there
// before is what it reads less the addition.
func (s *step) crossed(limits []guardLimit, made bool) (string, error) {
	for _, l := range limits {
		if l.max <= 0 || l.add <= 0 {
			continue
		}
		have, err := s.usage(l.counter)
		if err != nil {
			return "", err
		}
		if made {
			have -= l.add
		}
		if have > l.max-l.add {
			s.expect(Expect{Kind: ExpectUsageAtLeast, Key: l.counter, N: l.max - l.add + 1})
			return l.limit, nil
		}
		s.expect(Expect{Kind: ExpectUsageAtMost, Key: l.counter, N: l.max - l.add})
	}
	return "", nil
}

// runRefusal is why the run refuses the effect ("" when it takes it): the
// edge's own refusal, a run no longer ACTIVE (a delivery may still go out
// while a run drains, but not be scheduled), or a version the cancel has
// moved past.
func runRefusal(run state.Run, req state.GuardRequest) string {
	switch {
	case req.Refuse != "":
		return req.Refuse
	case run.Status == state.StatusActive && (req.ObservedVersion == 0 || req.ObservedVersion == run.CancelVersion):
		return ""
	case req.AllowCancelling && run.Status == state.StatusCancelling && req.NotBefore.IsZero():
		return ""
	case run.Status == state.StatusActive:
		return state.RefusalStaleVersion
	}
	return state.RefusalRunNotActive
}

// derive names the next dispatch under a derived key base: the base for
// the first, base.n after, each dispatch a record of its own. A name
// already taken (an explicit key that looks derived) is skipped, never
// written over. The counter is kept from the second dispatch on: most
// requests are made once.
func (s *step) derive(base string) (string, error) {
	taken, err := s.taken(base)
	if err != nil {
		return "", err
	}
	if !taken {
		s.expect(Expect{Kind: ExpectIntentAbsent, Key: base})
		return base, nil
	}
	s.expect(Expect{Kind: ExpectIntentPresent, Key: base})
	n, err := s.v.Derived(base)
	if err != nil {
		return "", err
	}
	for _, d := range s.m.Derived {
		if d.Base == base {
			n = d.N
		}
	}
	s.expect(Expect{Kind: ExpectDerived, Key: base, N: n})
	for k := max(n, 1) + 1; ; k++ {
		key := base + "." + strconv.FormatInt(k, 10)
		taken, err := s.taken(key)
		if err != nil {
			return "", err
		}
		if !taken {
			s.expect(Expect{Kind: ExpectIntentAbsent, Key: key})
			s.m.Derived = append(s.m.Derived, DerivedWrite{Base: base, N: k})
			return key, nil
		}
	}
}

// refuseDispatch records an effect the run refused: CANCELLED_BEFORE_DISPATCH
// under a new key; under a key already used, what happened stays recorded
// and only the refusal counts.
func (s *step) refuseDispatch(req state.GuardRequest, key string, rec *state.Intent, refusal, why string) state.GuardResult {
	var out state.Intent
	if rec != nil {
		out = *rec
		out.Refusals++
		s.put(out, rec.State, true)
	} else {
		out = state.Intent{
			RunID: req.RunID, Key: key, Boundary: req.Boundary, State: state.IntentCancelledBeforeDispatch,
			Method: req.Method, Target: req.Target, BodyDigest: req.BodyDigest,
			ObservedVersion: req.ObservedVersion, Reason: why, CreatedAt: s.now, UpdatedAt: s.now,
		}
		if !req.NotBefore.IsZero() {
			out.NotBefore = req.NotBefore.UTC().Truncate(time.Millisecond)
		}
		s.put(out, "", false)
	}
	s.event(state.Event{Actor: req.Actor, Kind: state.EventIntentRefused, Intent: key,
		To: string(state.IntentCancelledBeforeDispatch), Reason: why})
	return state.GuardResult{Refusal: refusal, Run: s.row, Intent: out}
}

// dispatch admits the effect: IN_FLIGHT under a lease, or SCHEDULED for
// later; rec is the record the key names already (nil for a new one).
func (s *step) dispatch(req state.GuardRequest, key string, rec *state.Intent) state.GuardResult {
	var out state.Intent
	var from state.IntentState
	if rec != nil {
		out, from = *rec, rec.State
	} else {
		out = state.Intent{RunID: req.RunID, Key: key, CreatedAt: s.now}
	}
	out.Boundary, out.Method, out.Target = req.Boundary, req.Method, req.Target
	if req.BodyDigest != "" {
		out.BodyDigest = req.BodyDigest
	}
	out.Attempts++
	out.ObservedVersion = req.ObservedVersion
	out.StatusCode, out.Reason, out.Source, out.Note = 0, "", "", ""
	out.UpdatedAt = s.now
	if req.NotBefore.IsZero() {
		out.State = state.IntentInFlight
		out.LeaseOwner = req.LeaseOwner
		out.LeaseExpires = s.now.Add(req.LeaseTTL).Truncate(time.Millisecond)
		out.NotBefore = time.Time{}
	} else {
		out.State = state.IntentScheduled
		out.LeaseOwner, out.LeaseExpires = "", time.Time{}
		out.NotBefore = req.NotBefore.UTC().Truncate(time.Millisecond)
	}
	s.put(out, from, false)
	s.event(state.Event{Actor: req.Actor, Kind: state.EventIntentAdmitted, Intent: key, From: string(from), To: string(out.State)})
	if out.State == state.IntentInFlight {
		// Every dispatch is counted, budget or none: usage is what the
		// operator reads of a run too.
		s.use(state.CounterEffects, 1)
		if dest := state.Destination(req.Boundary, req.Target); dest != "" {
			s.use(state.DestinationCounter(dest), 1)
		}
		s.use(state.CounterRequestBytes, req.RequestBytes)
	}
	return state.GuardResult{Admitted: true, Run: s.row, Intent: out}
}

// Finish records what happened to an IN_FLIGHT intent (or a late answer
// for one the drain deadline turned UNKNOWN), then finalizes the run.
func Finish(v View, req state.FinishRequest, now time.Time) (state.Intent, *Mutation, error) {
	s := newStep(v, req.RunID, now)
	rec, err := s.runIntent(req.Key)
	if err != nil {
		return state.Intent{}, nil, err
	}
	from := rec.State
	late := from == state.IntentUnknown && req.Outcome == state.IntentResponded
	if from != state.IntentInFlight && !late {
		return state.Intent{}, nil, s.conflict(state.ConflictNotInFlight, rec, fmt.Sprintf("cannot record %s", req.Outcome))
	}
	if req.Attempt != rec.Attempts {
		return state.Intent{}, nil, s.conflict(state.ConflictStaleAttempt, rec, fmt.Sprintf("report for attempt %d, latest is %d", req.Attempt, rec.Attempts))
	}
	s.expectAt(rec)
	out := *rec
	out.State, out.StatusCode, out.Reason, out.Source = req.Outcome, req.StatusCode, req.Reason, req.Source
	if late {
		out.Reason = state.ReasonLateResponse
		s.resolved = state.ResolutionResponse
	}
	out.LeaseOwner, out.LeaseExpires, out.UpdatedAt = "", time.Time{}, s.now
	s.put(out, from, true)
	s.event(state.Event{Actor: req.Actor, Kind: state.EventIntentOutcome, Intent: out.Key,
		From: string(from), To: string(out.State), Reason: Why(out.Source, out.Reason)})
	if limit, err := s.meter(req); err != nil {
		return state.Intent{}, nil, err
	} else if limit != "" {
		// The effect has happened: the run is cancelled in this step, so
		// that its next effect is refused.
		if err := s.cancelRun(state.BudgetReason(limit), state.ActorStopgate, s.row.Budget.DrainTimeout, out.Key); err != nil {
			return state.Intent{}, nil, err
		}
	}
	if err := s.finalize(req.Actor); err != nil {
		return state.Intent{}, nil, err
	}
	return out, s.done(), nil
}

// meter counts what an answer used (its bytes, and an LLM answer's
// tokens, spend, or its usage as unknown), and returns the limit of an
// ACTIVE run's budget that this crossed, "" for none.
func (s *step) meter(req state.FinishRequest) (string, error) {
	s.use(state.CounterResponseBytes, req.ResponseBytes)
	llm := req.LLM
	var in, out, tokens, spend int64
	unknown := false
	if llm != nil {
		switch {
		case !llm.Known:
			unknown = true
			s.use(state.CounterUnknownUsage, 1)
		default:
			in, out, tokens = llm.InputTokens, llm.OutputTokens, llm.InputTokens+llm.OutputTokens
			s.use(state.CounterInputTokens, in)
			s.use(state.CounterOutputTokens, out)
			s.use(state.CounterTokens, tokens)
			s.use(state.CounterLLMCalls, 1)
			if llm.Model != "" {
				mi, mo, mc := state.ModelCounters(llm.Model)
				s.use(mi, in)
				s.use(mo, out)
				s.use(mc, 1)
			}
			if llm.Priced {
				spend = llm.Spend
				s.use(state.CounterSpend, spend)
			} else {
				s.use(state.CounterUnpriced, 1)
			}
		}
	}
	b := s.row.Budget
	if !b.Limited() || s.row.Status != state.StatusActive {
		return "", nil
	}
	// Each counter is read as it stood before this step's addition: the
	// usage counts it, and the limit holds at most max-add before.
	limit, err := s.crossed([]guardLimit{
		{state.LimitResponseBytes, state.CounterResponseBytes, b.MaxResponseBytes, req.ResponseBytes},
		{state.LimitInputTokens, state.CounterInputTokens, b.MaxInputTokens, in},
		{state.LimitOutputTokens, state.CounterOutputTokens, b.MaxOutputTokens, out},
		{state.LimitTokens, state.CounterTokens, b.MaxTokens, tokens},
		{state.LimitSpend, state.CounterSpend, b.MaxSpend, spend},
	}, true)
	if err != nil || limit != "" {
		return limit, err
	}
	if b.CancelOnUnknownUsage && llm != nil && (unknown || b.MaxSpend > 0 && !llm.Priced) {
		return state.LimitUnknownUsage, nil
	}
	return "", nil
}

// runIntent reads the row and the record under key, both of which must
// exist.
func (s *step) runIntent(key string) (*state.Intent, error) {
	found, err := s.readRow()
	if err != nil {
		return nil, err
	}
	if !found {
		return nil, fmt.Errorf("run %s: %w", s.m.RunID, state.ErrNotFound)
	}
	rec, err := s.intent(key)
	if err != nil {
		return nil, err
	}
	if rec == nil {
		return nil, fmt.Errorf("run %s intent %s: %w", s.m.RunID, key, state.ErrNotFound)
	}
	return rec, nil
}

// expectAt expects the record in the state, at the attempt and with the
// refusals it was read with, and the row's status, which finalize reads.
func (s *step) expectAt(rec *state.Intent) {
	s.expect(Expect{Kind: ExpectIntentAt, Key: rec.Key, State: rec.State, N: int64(rec.Attempts), Refusals: rec.Refusals})
	s.expectRow(false)
}

// Resolve reconciles an UNKNOWN intent to APPLIED or NOT_APPLIED, then
// finalizes the run.
func Resolve(v View, req state.ResolveRequest, now time.Time) (state.Intent, *Mutation, error) {
	s := newStep(v, req.RunID, now)
	rec, err := s.runIntent(req.Key)
	if err != nil {
		return state.Intent{}, nil, err
	}
	if rec.State != state.IntentUnknown {
		return state.Intent{}, nil, s.conflict(state.ConflictNotUnknown, rec, "only an UNKNOWN intent can be reconciled")
	}
	s.expectAt(rec)
	out := *rec
	out.State = state.IntentNotApplied
	if req.Applied {
		out.State = state.IntentApplied
	}
	out.Source, out.Note, out.UpdatedAt = req.Source, req.Note, s.now
	s.resolved = state.ResolutionSource(req)
	s.put(out, state.IntentUnknown, true)
	s.event(state.Event{Actor: req.Actor, Kind: state.EventIntentResolved, Intent: out.Key,
		From: string(state.IntentUnknown), To: string(out.State), Reason: Why(req.Source, req.Note)})
	if err := s.finalize(req.Actor); err != nil {
		return state.Intent{}, nil, err
	}
	return out, s.done(), nil
}

// Note appends one event about an existing intent and changes nothing
// else.
func Note(v View, req state.NoteRequest, now time.Time) (*Mutation, error) {
	s := newStep(v, req.RunID, now)
	if _, err := s.runIntent(req.Key); err != nil {
		return nil, err
	}
	s.expect(Expect{Kind: ExpectIntentPresent, Key: req.Key})
	s.event(state.Event{Actor: req.Actor, Kind: req.Kind, Intent: req.Key, Reason: req.Reason})
	return s.done(), nil
}

// Renewal is what Renew found of one run: the intents whose lease it
// extended, as they now stand, and the run's row (found false for a run
// never seen, which renews nothing).
type Renewal struct {
	Renewed []state.Intent
	Run     state.Run
	Found   bool
}

// Renew extends the leases owner holds on the IN_FLIGHT intents of one run
// named by keys; any other intent named is skipped. A lease is
// bookkeeping, not a transition: no event.
func Renew(v View, runID, owner string, ttl time.Duration, keys []string, now time.Time) (Renewal, *Mutation, error) {
	s := newStep(v, runID, now)
	found, err := s.readRow()
	if err != nil || !found {
		return Renewal{}, nil, err
	}
	out := Renewal{Found: true}
	for _, key := range keys {
		rec, err := s.intent(key)
		if err != nil {
			return Renewal{}, nil, err
		}
		if rec == nil || rec.State != state.IntentInFlight || rec.LeaseOwner != owner {
			continue
		}
		s.expect(Expect{Kind: ExpectIntent, Key: key})
		renewed := *rec
		renewed.LeaseExpires = s.now.Add(ttl).Truncate(time.Millisecond)
		s.put(renewed, state.IntentInFlight, true)
		out.Renewed = append(out.Renewed, renewed)
	}
	out.Run = s.row
	return out, s.done(), nil
}
