package machine

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/stopgate/stopgate/state"
)

// Admit creates the run ACTIVE at version 1; an ACTIVE run is returned as
// it is; any other status is a Conflict.
func Admit(v View, req state.AdmitRequest, now time.Time) (state.AdmitResult, *Mutation, error) {
	s := newStep(v, req.RunID, now)
	found, err := s.readRow()
	if err != nil {
		return state.AdmitResult{}, nil, err
	}
	if found {
		if s.row.Status != state.StatusActive {
			return state.AdmitResult{}, nil, s.conflict(state.RefusalRunNotActive, nil, "only an unseen run can be admitted")
		}
		return state.AdmitResult{Run: s.row}, nil, nil
	}
	s.create(state.StatusActive, 1)
	s.event(state.Event{Actor: req.Actor, Kind: state.EventRunAdmitted, Reason: req.Reason, To: string(state.StatusActive)})
	return state.AdmitResult{Run: s.row, Created: true}, s.done(), nil
}

// create makes the row of a run never seen.
func (s *step) create(status state.Status, version int64) {
	s.expect(Expect{Kind: ExpectRowAbsent})
	s.found = true
	s.row = state.Run{ID: s.m.RunID, Status: status, CancelVersion: version, CreatedAt: s.now, UpdatedAt: s.now,
		Intents: map[state.IntentState]int{}}
	s.counts, s.shared = nil, false
	s.m.Create = true
}

// expectRow expects the row's status as read, and its version when the
// decision compared it.
func (s *step) expectRow(version bool) {
	if s.m.Create {
		return
	}
	s.expect(Expect{Kind: ExpectStatus, Status: s.readStatus})
	if version {
		s.expect(Expect{Kind: ExpectVersion, N: s.readVersion})
	}
}

// Cancel is the compare-and-set ACTIVE → CANCELLING with a new version, a
// reason and a drain deadline, revoking every scheduled retry; an unseen
// run gets a CANCELLED tombstone at version 2. A run already cancelling,
// cancelled or unknown is returned unchanged; a completed one is a
// Conflict.
func Cancel(v View, req state.CancelRequest, now time.Time) (state.CancelResult, *Mutation, error) {
	s := newStep(v, req.RunID, now)
	found, err := s.readRow()
	if err != nil {
		return state.CancelResult{}, nil, err
	}
	if !found {
		// A tombstone: a run cancelled before anyone admitted it must
		// never be admitted later.
		s.create(state.StatusCancelled, 2)
		s.row.Reason, s.row.CancelledAt = req.Reason, s.now
		s.event(state.Event{Actor: req.Actor, Kind: state.EventRunCancelled, Reason: req.Reason, To: string(state.StatusCancelled)})
		s.m.Publish = true
		return state.CancelResult{Run: s.row, Changed: true}, s.done(), nil
	}
	switch s.row.Status {
	case state.StatusActive:
	case state.StatusCompleted:
		return state.CancelResult{}, nil, s.conflict(state.RefusalRunNotActive, nil, "a completed run cannot be cancelled")
	default:
		return state.CancelResult{Run: s.row}, nil, nil
	}
	scheduled, err := s.v.Scheduled()
	if err != nil {
		return state.CancelResult{}, nil, err
	}
	s.expectRow(true)
	s.expectCount(state.IntentScheduled)
	s.row.Status = state.StatusCancelling
	s.row.CancelVersion++
	s.row.Reason, s.row.CancelledAt, s.row.UpdatedAt = req.Reason, s.now, s.now
	s.row.DrainDeadline = s.now.Add(req.DrainTimeout).Truncate(time.Millisecond)
	s.changeRow()
	s.event(state.Event{Actor: req.Actor, Kind: state.EventRunCancelled, Reason: req.Reason,
		From: string(state.StatusActive), To: string(state.StatusCancelling)})
	for _, rec := range scheduled {
		s.force(rec, state.IntentRevoked, state.ReasonRunCancelled, state.EventIntentRevoked, req.Actor)
	}
	s.m.Publish = true
	return state.CancelResult{Run: s.row, Changed: true}, s.done(), nil
}

// force moves an intent on by the step itself rather than by its carrier:
// revoked by the cancel, expired, or cut by the drain deadline.
func (s *step) force(rec state.Intent, to state.IntentState, why, kind, actor string) {
	s.expect(Expect{Kind: ExpectIntent, Key: rec.Key})
	from := rec.State
	rec.State, rec.Reason, rec.UpdatedAt = to, why, s.now
	s.put(rec, from, true)
	s.event(state.Event{Actor: actor, Kind: kind, Intent: rec.Key, From: string(from), To: string(to), Reason: why})
}

// Complete moves ACTIVE → COMPLETED at the version the caller observed.
func Complete(v View, req state.CompleteRequest, now time.Time) (state.Run, *Mutation, error) {
	s := newStep(v, req.RunID, now)
	found, err := s.readRow()
	if err != nil {
		return state.Run{}, nil, err
	}
	if !found {
		return state.Run{}, nil, fmt.Errorf("complete run %s: %w", req.RunID, state.ErrNotFound)
	}
	if s.row.Status != state.StatusActive {
		return state.Run{}, nil, s.conflict(state.RefusalRunNotActive, nil, "only an ACTIVE run can complete")
	}
	if s.row.CancelVersion != req.Version {
		return state.Run{}, nil, s.conflict(state.RefusalStaleVersion, nil, fmt.Sprintf("completion observed cancel_version %d", req.Version))
	}
	s.expectRow(true)
	s.row.Status, s.row.Reason, s.row.UpdatedAt = state.StatusCompleted, req.Reason, s.now
	s.changeRow()
	s.event(state.Event{Actor: req.Actor, Kind: state.EventRunCompleted, Reason: req.Reason,
		From: string(state.StatusActive), To: string(state.StatusCompleted)})
	return s.row, s.done(), nil
}

// Tick turns IN_FLIGHT intents whose leases expired UNKNOWN and moves a
// CANCELLING or UNKNOWN run on (finalize). A tick with nothing to do
// writes nothing.
func Tick(v View, req state.TickRequest, now time.Time) (state.Run, *Mutation, error) {
	s := newStep(v, req.RunID, now)
	found, err := s.readRow()
	if err != nil {
		return state.Run{}, nil, err
	}
	if !found {
		return state.Run{}, nil, fmt.Errorf("run %s: %w", req.RunID, state.ErrNotFound)
	}
	if s.row.Final() {
		return s.row, nil, nil
	}
	if err := s.expireLeases(req.Actor); err != nil {
		return state.Run{}, nil, err
	}
	if err := s.finalize(req.Actor); err != nil {
		return state.Run{}, nil, err
	}
	m := s.done()
	if m != nil {
		s.expectRow(false)
	}
	return s.row, m, nil
}

// expireLeases turns every IN_FLIGHT intent whose lease has run out
// UNKNOWN: a carrier that died is never proof that nothing happened. They
// expire in the order their leases ran out (ties by key).
func (s *step) expireLeases(actor string) error {
	if s.row.Intents[state.IntentInFlight] == 0 {
		return nil
	}
	inflight, err := s.v.InFlight()
	if err != nil {
		return err
	}
	var due []state.Intent
	for _, rec := range inflight {
		if !rec.LeaseExpires.After(s.now) {
			due = append(due, rec)
		}
	}
	slices.SortFunc(due, func(a, b state.Intent) int {
		return cmp.Or(a.LeaseExpires.Compare(b.LeaseExpires), strings.Compare(a.Key, b.Key))
	})
	for _, rec := range due {
		s.force(rec, state.IntentUnknown, state.ReasonLeaseExpired, state.EventIntentExpired, actor)
	}
	return nil
}

// finalize moves a CANCELLING or UNKNOWN run on, as far as its intents
// allow (docs/state-machine.md, Finalize).
func (s *step) finalize(actor string) error {
	switch s.row.Status {
	case state.StatusCancelling, state.StatusUnknown:
	default:
		return nil
	}
	inflight, unknown := s.row.Intents[state.IntentInFlight], s.row.Intents[state.IntentUnknown]
	pastDeadline := !s.now.Before(s.row.DrainDeadline)
	if s.row.Status == state.StatusCancelling && inflight > 0 && !pastDeadline {
		// The run drains on: that holds whatever else lands meanwhile,
		// as long as something stays in flight after this step (the
		// outcomes of a draining run, carried by many instances at once,
		// need not wait for each other).
		s.expect(Expect{Kind: ExpectCountAtLeast, State: state.IntentInFlight, N: int64(s.counts[state.IntentInFlight] - inflight + 1)})
		return nil
	}
	s.expectCount(state.IntentInFlight)
	s.expectCount(state.IntentUnknown)
	if s.row.Status == state.StatusUnknown {
		if inflight == 0 && unknown == 0 {
			s.move(state.StatusCancelled, state.ReasonReconciled, actor)
		}
		return nil
	}
	switch {
	case inflight == 0 && unknown == 0:
		s.move(state.StatusCancelled, state.ReasonDrained, actor)
	case inflight == 0 && pastDeadline:
		// Past the deadline, what is unknown was cut by it (by this tick
		// or by the carrier that saw the deadline first).
		s.move(state.StatusUnknown, state.ReasonDrainTimeout, actor)
	case inflight == 0:
		s.move(state.StatusUnknown, state.ReasonUnresolved, actor)
	case pastDeadline:
		recs, err := s.v.InFlight()
		if err != nil {
			return err
		}
		for _, rec := range recs {
			if cur, ok := s.touched(rec.Key); ok && cur != nil && cur.State != state.IntentInFlight {
				continue // this step moved it already
			}
			s.force(rec, state.IntentUnknown, state.ReasonDrainTimeout, state.EventIntentOutcome, actor)
		}
		s.move(state.StatusUnknown, state.ReasonDrainTimeout, actor)
	}
	return nil
}
