package filestore

import (
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"fmt"
	"slices"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/stopgate/stopgate/state"
)

// The rules each method applies are docs/state-machine.md, row by row.

// Admit creates the run ACTIVE at version 1, or returns an ACTIVE row as it is.
func (s *Store) Admit(ctx context.Context, req state.AdmitRequest) (state.AdmitResult, error) {
	if err := req.Validate(); err != nil {
		return state.AdmitResult{}, err
	}
	var out state.AdmitResult
	err := s.update(ctx, "admit", func(t *txn) error {
		r, found, err := t.run(req.RunID)
		if err != nil {
			return err
		}
		if found {
			if r.row.Status != state.StatusActive {
				return r.conflict(state.RefusalRunNotActive, nil, "only an unseen run can be admitted")
			}
			out = state.AdmitResult{Run: r.row}
			return nil
		}
		if r, err = t.admit(req.RunID, req.Actor, req.Reason); err != nil {
			return err
		}
		if err := r.save(); err != nil {
			return err
		}
		out = state.AdmitResult{Run: r.row, Created: true}
		return nil
	})
	return out, err
}

// Cancel is the compare-and-set ACTIVE → CANCELLING, or a tombstone for an
// unseen run. Subscribers hear of it only after it has committed.
func (s *Store) Cancel(ctx context.Context, req state.CancelRequest) (state.CancelResult, error) {
	if err := req.Validate(); err != nil {
		return state.CancelResult{}, err
	}
	var out state.CancelResult
	err := s.update(ctx, "cancel", func(t *txn) error {
		r, found, err := t.run(req.RunID)
		if err != nil {
			return err
		}
		if !found {
			// A tombstone: a run cancelled before anyone admitted it must
			// never be admitted later.
			if r, err = t.createRun(req.RunID, state.StatusCancelled, 2); err != nil {
				return err
			}
			r.row.Reason = req.Reason
			r.row.CancelledAt = t.now
			if err := r.event(state.Event{Actor: req.Actor, Kind: state.EventRunCancelled, Reason: req.Reason, To: string(state.StatusCancelled)}); err != nil {
				return err
			}
			if err := r.save(); err != nil {
				return err
			}
			out = state.CancelResult{Run: r.row, Changed: true}
			return nil
		}
		switch r.row.Status {
		case state.StatusActive:
		case state.StatusCompleted:
			return r.conflict(state.RefusalRunNotActive, nil, "a completed run cannot be cancelled")
		default:
			out = state.CancelResult{Run: r.row}
			return nil
		}
		r.row.Status = state.StatusCancelling
		r.row.CancelVersion++
		r.row.Reason = req.Reason
		r.row.CancelledAt = t.now
		r.row.DrainDeadline = t.now.Add(req.DrainTimeout).Truncate(time.Millisecond)
		r.row.UpdatedAt = t.now
		r.dirty = true
		if err := r.event(state.Event{Actor: req.Actor, Kind: state.EventRunCancelled, Reason: req.Reason,
			From: string(state.StatusActive), To: string(state.StatusCancelling)}); err != nil {
			return err
		}
		err = r.eachPending(state.IntentScheduled, func(rec *intentRecord) error {
			rec.State = state.IntentRevoked
			rec.Reason = reasonRunCancelled
			rec.UpdatedAt = t.now
			if err := r.putIntent(rec, state.IntentScheduled); err != nil {
				return err
			}
			return r.event(state.Event{Actor: req.Actor, Kind: state.EventIntentRevoked, Intent: rec.Key,
				From: string(state.IntentScheduled), To: string(state.IntentRevoked), Reason: reasonRunCancelled})
		})
		if err != nil {
			return err
		}
		if err := r.save(); err != nil {
			return err
		}
		out = state.CancelResult{Run: r.row, Changed: true}
		return nil
	})
	if err != nil {
		return state.CancelResult{}, err
	}
	if out.Changed {
		s.publish(req.RunID)
	}
	return out, nil
}

// Complete moves ACTIVE → COMPLETED at the version the caller observed.
func (s *Store) Complete(ctx context.Context, req state.CompleteRequest) (state.Run, error) {
	if err := req.Validate(); err != nil {
		return state.Run{}, err
	}
	var out state.Run
	err := s.update(ctx, "complete", func(t *txn) error {
		r, found, err := t.run(req.RunID)
		if err != nil {
			return err
		}
		if !found {
			return fmt.Errorf("complete run %s: %w", req.RunID, state.ErrNotFound)
		}
		if r.row.Status != state.StatusActive {
			return r.conflict(state.RefusalRunNotActive, nil, "only an ACTIVE run can complete")
		}
		if r.row.CancelVersion != req.Version {
			return r.conflict(state.RefusalStaleVersion, nil, fmt.Sprintf("completion observed cancel_version %d", req.Version))
		}
		r.row.Status = state.StatusCompleted
		r.row.Reason = req.Reason
		r.row.UpdatedAt = t.now
		r.dirty = true
		if err := r.event(state.Event{Actor: req.Actor, Kind: state.EventRunCompleted, Reason: req.Reason,
			From: string(state.StatusActive), To: string(state.StatusCompleted)}); err != nil {
			return err
		}
		if err := r.save(); err != nil {
			return err
		}
		out = r.row
		return nil
	})
	return out, err
}

// Get returns the row, or ErrNotFound.
func (s *Store) Get(ctx context.Context, runID string) (state.Run, error) {
	if err := state.ValidateRunID(runID); err != nil {
		return state.Run{}, err
	}
	var out state.Run
	err := s.view(ctx, "get", func(tx *bolt.Tx) error {
		row, _, found, err := loadRun(tx, runID)
		if err != nil {
			return err
		}
		if !found {
			return fmt.Errorf("run %s: %w", runID, state.ErrNotFound)
		}
		out = row
		return nil
	})
	return out, err
}

// List returns rows ordered by run id; status "" lists all.
func (s *Store) List(ctx context.Context, status state.Status) ([]state.Run, error) {
	if status != "" && !slices.Contains(state.Statuses, status) {
		return nil, fmt.Errorf("%w: unknown run status %q", state.ErrInvalid, status)
	}
	var out []state.Run
	err := s.view(ctx, "list", func(tx *bolt.Tx) error {
		if status == "" {
			return tx.Bucket([]byte(bucketRuns)).ForEach(func(k, _ []byte) error {
				row, _, _, err := loadRun(tx, string(k))
				out = append(out, row)
				return err
			})
		}
		ids := idsWithStatus(tx, status)
		for _, id := range ids {
			row, _, found, err := loadRun(tx, id)
			if err != nil {
				return err
			}
			if !found {
				return storeErr("status index names missing run %s", id)
			}
			out = append(out, row)
		}
		return nil
	})
	return out, err
}

// DrainingRuns lists the ids of CANCELLING and UNKNOWN runs.
func (s *Store) DrainingRuns(ctx context.Context) ([]string, error) {
	var out []string
	err := s.view(ctx, "draining runs", func(tx *bolt.Tx) error {
		for _, st := range []state.Status{state.StatusCancelling, state.StatusUnknown} {
			out = append(out, idsWithStatus(tx, st)...)
		}
		return nil
	})
	slices.Sort(out)
	return out, err
}

// ActiveRuns lists up to limit ids of ACTIVE runs after `after`, from the
// status index: a seek and a short walk, whatever the number of runs.
func (s *Store) ActiveRuns(ctx context.Context, after string, limit int) ([]string, error) {
	if err := state.ValidatePage(after, limit); err != nil {
		return nil, err
	}
	var out []string
	err := s.view(ctx, "active runs", func(tx *bolt.Tx) error {
		prefix := statusKey(state.StatusActive, "")
		c := tx.Bucket([]byte(bucketStatus)).Cursor()
		k, _ := c.Seek(statusKey(state.StatusActive, after))
		for ; k != nil && len(out) < limit && bytes.HasPrefix(k, prefix); k, _ = c.Next() {
			if id := string(k[len(prefix):]); id != after {
				out = append(out, id)
			}
		}
		return nil
	})
	return out, err
}

func idsWithStatus(tx *bolt.Tx, status state.Status) []string {
	var ids []string
	prefix := statusKey(status, "")
	c := tx.Bucket([]byte(bucketStatus)).Cursor()
	for k, _ := c.Seek(prefix); k != nil && len(k) >= len(prefix) && string(k[:len(prefix)]) == string(prefix); k, _ = c.Next() {
		ids = append(ids, string(k[len(prefix):]))
	}
	return ids
}

// Guard checks the run and records the effect in one transaction.
func (s *Store) Guard(ctx context.Context, req state.GuardRequest) (state.GuardResult, error) {
	if err := req.Validate(); err != nil {
		return state.GuardResult{}, err
	}
	req = req.Fenced(ctx)
	var out state.GuardResult
	err := s.update(ctx, "guard", func(t *txn) error {
		// Checked inside the transaction, after the wait for the writer:
		// a caller that gave up while queued must find nothing recorded.
		if req.Late(t.now) {
			return fmt.Errorf("filestore: guard run %s: %w: the guard's turn came at %s, after its deadline %s; nothing was recorded",
				req.RunID, state.ErrUnavailable, t.now.Format(time.RFC3339Nano), req.NotAfter.UTC().Format(time.RFC3339Nano))
		}
		r, found, err := t.run(req.RunID)
		if err != nil {
			return err
		}
		if !found {
			if !req.AutoAdmit {
				// Nothing is recorded for a run nobody admitted, so there
				// is no intent to return either.
				out = state.GuardResult{Refusal: state.RefusalRunNotAdmitted, Run: state.Run{ID: req.RunID}}
				return nil
			}
			if r, err = t.admit(req.RunID, req.Actor, reasonAutoAdmit); err != nil {
				return err
			}
		}
		if out, err = r.guard(req); err != nil {
			return err
		}
		if err := r.save(); err != nil {
			return err
		}
		out.Run = r.row
		return nil
	})
	if err != nil {
		return state.GuardResult{}, err
	}
	return out, nil
}

func (r *runTx) guard(req state.GuardRequest) (state.GuardResult, error) {
	key := req.Key
	var rec *intentRecord
	var exists bool
	var err error
	if req.ExplicitKey {
		rec, exists, err = r.intent(key)
	} else {
		// A derived key is one no record has yet.
		key, err = r.deriveKey(req.Key)
	}
	if err != nil {
		return state.GuardResult{}, err
	}
	if refusal := r.runRefusal(req); refusal != "" {
		return r.refuseDispatch(req, key, rec, exists, refusal)
	}
	if !exists {
		return r.dispatch(req, &intentRecord{Intent: state.Intent{RunID: req.RunID, Key: key, CreatedAt: r.t.now}}, "")
	}
	// A duplicate of an effect under way, a key reused for another effect,
	// or a key whose effect is over leaves the record untouched, refusals
	// included (statetest ExplicitKeyFollowsIdempotencyRules counts only
	// refusals by the run); the event still records the attempt.
	if refusal := state.ReplayRefusal(rec.Intent, req); refusal != "" {
		return r.refused(req, rec, refusal, "")
	}
	return r.dispatch(req, rec, rec.State)
}

// runRefusal is why the run refuses the effect ("" when it takes it): the
// edge's own refusal, a run no longer ACTIVE (a delivery may still go out
// while a run drains), or a version the cancel has moved past.
func (r *runTx) runRefusal(req state.GuardRequest) string {
	run := r.row
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

// refuseDispatch records an effect the run refused: CANCELLED_BEFORE_DISPATCH
// under a new key; under a key already used, what happened stays recorded
// and only the refusal counts.
func (r *runTx) refuseDispatch(req state.GuardRequest, key string, rec *intentRecord, exists bool, refusal string) (state.GuardResult, error) {
	now := r.t.now
	from := state.IntentState("")
	if exists {
		from = rec.State
		rec.Refusals++
		rec.UpdatedAt = now
	} else {
		rec = &intentRecord{Intent: state.Intent{
			RunID: req.RunID, Key: key, Boundary: req.Boundary, State: state.IntentCancelledBeforeDispatch,
			Method: req.Method, Target: req.Target, BodyDigest: req.BodyDigest,
			ObservedVersion: req.ObservedVersion, Reason: refusal, CreatedAt: now, UpdatedAt: now,
		}}
		if !req.NotBefore.IsZero() {
			rec.NotBefore = req.NotBefore.UTC().Truncate(time.Millisecond)
		}
	}
	if err := r.putIntent(rec, from); err != nil {
		return state.GuardResult{}, err
	}
	return r.refused(req, rec, refusal, state.IntentCancelledBeforeDispatch)
}

// refused answers a refusal and audits it; the run is kept for retention
// to find again.
func (r *runTx) refused(req state.GuardRequest, rec *intentRecord, refusal string, to state.IntentState) (state.GuardResult, error) {
	if err := r.keepForRetention(); err != nil {
		return state.GuardResult{}, err
	}
	err := r.event(state.Event{Actor: req.Actor, Kind: state.EventIntentRefused, Intent: rec.Key, To: string(to), Reason: refusal})
	return state.GuardResult{Refusal: refusal, Run: r.row, Intent: rec.Intent}, err
}

// dispatch admits the effect: IN_FLIGHT under a lease, or SCHEDULED for
// later; rec moves from from ("" for a new record).
func (r *runTx) dispatch(req state.GuardRequest, rec *intentRecord, from state.IntentState) (state.GuardResult, error) {
	now := r.t.now
	rec.Boundary = req.Boundary
	rec.Method = req.Method
	rec.Target = req.Target
	if req.BodyDigest != "" {
		rec.BodyDigest = req.BodyDigest
	}
	rec.Attempts++
	rec.ObservedVersion = req.ObservedVersion
	rec.StatusCode = 0
	rec.Reason = ""
	rec.Source = ""
	rec.Note = ""
	rec.UpdatedAt = now
	if req.NotBefore.IsZero() {
		rec.State = state.IntentInFlight
		rec.LeaseOwner = req.LeaseOwner
		rec.LeaseExpires = now.Add(req.LeaseTTL).Truncate(time.Millisecond)
		rec.NotBefore = time.Time{}
	} else {
		rec.State = state.IntentScheduled
		rec.LeaseOwner = ""
		rec.LeaseExpires = time.Time{}
		rec.NotBefore = req.NotBefore.UTC().Truncate(time.Millisecond)
	}
	if err := r.putIntent(rec, from); err != nil {
		return state.GuardResult{}, err
	}
	err := r.event(state.Event{Actor: req.Actor, Kind: state.EventIntentAdmitted, Intent: rec.Key, From: string(from), To: string(rec.State)})
	return state.GuardResult{Admitted: true, Run: r.row, Intent: rec.Intent}, err
}

// Finish records what happened to an IN_FLIGHT intent (or a late answer
// for one a deadline turned UNKNOWN), then finalizes the run.
func (s *Store) Finish(ctx context.Context, req state.FinishRequest) (state.Intent, error) {
	if err := req.Validate(); err != nil {
		return state.Intent{}, err
	}
	var out state.Intent
	err := s.update(ctx, "finish", finishStep(req, &out))
	return out, err
}

// FinishLater queues the outcome without leading a commit: it goes with
// the next write, or on its own after Options.OutcomeDelay.
func (s *Store) FinishLater(ctx context.Context, req state.FinishRequest, done func(error)) {
	if err := req.Validate(); err != nil {
		done(err)
		return
	}
	s.updateLater(ctx, "finish", finishStep(req, new(state.Intent)), done)
}

// finishStep is the outcome's step of a write transaction; out is the
// intent as recorded.
func finishStep(req state.FinishRequest, out *state.Intent) func(t *txn) error {
	return func(t *txn) error {
		r, rec, err := t.runIntent(req.RunID, req.Key)
		if err != nil {
			return err
		}
		from := rec.State
		late := from == state.IntentUnknown && req.Outcome == state.IntentResponded
		if from != state.IntentInFlight && !late {
			return r.conflict(state.ConflictNotInFlight, rec, fmt.Sprintf("cannot record %s", req.Outcome))
		}
		if req.Attempt != rec.Attempts {
			return r.conflict(state.ConflictStaleAttempt, rec, fmt.Sprintf("report for attempt %d, latest is %d", req.Attempt, rec.Attempts))
		}
		rec.State = req.Outcome
		rec.StatusCode = req.StatusCode
		rec.Reason = req.Reason
		if late {
			rec.Reason = reasonLateResponse
		}
		rec.Source = req.Source
		rec.LeaseOwner = ""
		rec.LeaseExpires = time.Time{}
		rec.UpdatedAt = t.now
		if err := r.putIntent(rec, from); err != nil {
			return err
		}
		if err := r.event(state.Event{Actor: req.Actor, Kind: state.EventIntentOutcome, Intent: rec.Key,
			From: string(from), To: string(rec.State), Reason: outcomeReason(rec.Source, rec.Reason)}); err != nil {
			return err
		}
		if err := r.finalize(req.Actor); err != nil {
			return err
		}
		*out = rec.Intent
		return r.save()
	}
}

// outcomeReason is the audit reason of an outcome or a resolution: its
// source first when it has one ("safe_method: run_cancelled").
func outcomeReason(source, reason string) string {
	switch {
	case source == "":
		return reason
	case reason == "":
		return source
	}
	return source + ": " + reason
}

// Note appends one event about an intent and changes nothing else.
func (s *Store) Note(ctx context.Context, req state.NoteRequest) error {
	if err := req.Validate(); err != nil {
		return err
	}
	return s.update(ctx, "note", func(t *txn) error {
		r, rec, err := t.runIntent(req.RunID, req.Key)
		if err != nil {
			return err
		}
		if err := r.keepForRetention(); err != nil {
			return err
		}
		if err := r.event(state.Event{Actor: req.Actor, Kind: req.Kind, Intent: rec.Key, Reason: req.Reason}); err != nil {
			return err
		}
		return r.save()
	})
}

// Resolve reconciles an UNKNOWN intent, then finalizes the run.
func (s *Store) Resolve(ctx context.Context, req state.ResolveRequest) (state.Intent, error) {
	if err := req.Validate(); err != nil {
		return state.Intent{}, err
	}
	var out state.Intent
	err := s.update(ctx, "resolve", func(t *txn) error {
		r, rec, err := t.runIntent(req.RunID, req.Key)
		if err != nil {
			return err
		}
		if rec.State != state.IntentUnknown {
			return r.conflict(state.ConflictNotUnknown, rec, "only an UNKNOWN intent can be reconciled")
		}
		rec.State = state.IntentNotApplied
		if req.Applied {
			rec.State = state.IntentApplied
		}
		rec.Source = req.Source
		rec.Note = req.Note
		rec.UpdatedAt = t.now
		if err := r.putIntent(rec, state.IntentUnknown); err != nil {
			return err
		}
		if err := r.event(state.Event{Actor: req.Actor, Kind: state.EventIntentResolved, Intent: rec.Key,
			From: string(state.IntentUnknown), To: string(rec.State), Reason: outcomeReason(req.Source, req.Note)}); err != nil {
			return err
		}
		if err := r.finalize(req.Actor); err != nil {
			return err
		}
		out = rec.Intent
		return r.save()
	})
	return out, err
}

func (t *txn) runIntent(runID, key string) (*runTx, *intentRecord, error) {
	r, found, err := t.run(runID)
	if err != nil {
		return nil, nil, err
	}
	if !found {
		return nil, nil, fmt.Errorf("run %s: %w", runID, state.ErrNotFound)
	}
	rec, found, err := r.intent(key)
	if err != nil {
		return nil, nil, err
	}
	if !found {
		return nil, nil, fmt.Errorf("run %s intent %s: %w", runID, key, state.ErrNotFound)
	}
	return r, rec, nil
}

// Renew extends the leases req.Owner holds; anything else named is skipped.
func (s *Store) Renew(ctx context.Context, req state.RenewRequest) (state.RenewResult, error) {
	if err := req.Validate(); err != nil {
		return state.RenewResult{}, err
	}
	out := state.RenewResult{Runs: map[string]state.Run{}}
	if len(req.Refs) == 0 {
		return out, nil
	}
	err := s.update(ctx, "renew", func(t *txn) error {
		// A step may run again (its shared commit rolled back): start over.
		out = state.RenewResult{Runs: map[string]state.Run{}}
		runs := map[string]*runTx{}
		for _, ref := range req.Refs {
			r, seen := runs[ref.RunID]
			if !seen {
				var err error
				if r, _, err = t.run(ref.RunID); err != nil {
					return err
				}
				runs[ref.RunID] = r
			}
			if r == nil {
				continue
			}
			rec, found, err := r.intent(ref.Key)
			if err != nil {
				return err
			}
			if !found || rec.State != state.IntentInFlight || rec.LeaseOwner != req.Owner {
				continue
			}
			rec.LeaseExpires = t.now.Add(req.TTL).Truncate(time.Millisecond)
			if err := r.putIntent(rec, rec.State); err != nil {
				return err
			}
			out.Renewed = append(out.Renewed, rec.Intent)
		}
		for id, r := range runs {
			if r != nil {
				out.Runs[id] = r.row
			}
		}
		return nil
	})
	if err != nil {
		return state.RenewResult{}, err
	}
	return out, nil
}

// Tick expires leases and moves a cancelled run on. Any number of
// instances may tick the same run: each tick is one transaction, and one
// that finds nothing to do writes nothing.
func (s *Store) Tick(ctx context.Context, req state.TickRequest) (state.Run, error) {
	if err := req.Validate(); err != nil {
		return state.Run{}, err
	}
	var out state.Run
	err := s.update(ctx, "tick", func(t *txn) error {
		r, found, err := t.run(req.RunID)
		if err != nil {
			return err
		}
		if !found {
			return fmt.Errorf("run %s: %w", req.RunID, state.ErrNotFound)
		}
		switch r.row.Status {
		case state.StatusActive:
			err = r.expireLeases(req.Actor)
		case state.StatusCancelling, state.StatusUnknown:
			if err = r.expireLeases(req.Actor); err == nil {
				err = r.finalize(req.Actor)
			}
		}
		if err != nil {
			return err
		}
		if err := r.save(); err != nil {
			return err
		}
		out = r.row
		return nil
	})
	return out, err
}

// Intent returns one intent, or ErrNotFound.
func (s *Store) Intent(ctx context.Context, runID, key string) (state.Intent, error) {
	if err := state.ValidateRunID(runID); err != nil {
		return state.Intent{}, err
	}
	if err := state.ValidateKey(key); err != nil {
		return state.Intent{}, err
	}
	var out state.Intent
	err := s.view(ctx, "intent", func(tx *bolt.Tx) error {
		b, err := runBucket(tx, runID)
		if err != nil {
			return err
		}
		raw := b.Bucket([]byte(bucketIntents)).Get([]byte(key))
		if raw == nil {
			return fmt.Errorf("run %s intent %s: %w", runID, key, state.ErrNotFound)
		}
		rec, err := decodeIntent(runID, key, raw)
		if err != nil {
			return storeErr("run %s: decoding intent %s: %w", runID, key, err)
		}
		out = rec.Intent
		return nil
	})
	return out, err
}

// Intents returns the run's intents in creation order.
func (s *Store) Intents(ctx context.Context, runID string) ([]state.Intent, error) {
	if err := state.ValidateRunID(runID); err != nil {
		return nil, err
	}
	var out []state.Intent
	err := s.view(ctx, "intents", func(tx *bolt.Tx) error {
		b, err := runBucket(tx, runID)
		if err != nil {
			return err
		}
		var recs []intentRecord
		err = b.Bucket([]byte(bucketIntents)).ForEach(func(key, raw []byte) error {
			rec, err := decodeIntent(runID, string(key), raw)
			if err != nil {
				return storeErr("run %s: decoding intent %s: %w", runID, key, err)
			}
			recs = append(recs, rec)
			return nil
		})
		slices.SortFunc(recs, func(a, b intentRecord) int { return cmp.Compare(a.Seq, b.Seq) })
		out = make([]state.Intent, len(recs))
		for i := range recs {
			out[i] = recs[i].Intent
		}
		return err
	})
	return out, err
}

// Events returns the run's audit log in commit order.
func (s *Store) Events(ctx context.Context, runID string) ([]state.Event, error) {
	if err := state.ValidateRunID(runID); err != nil {
		return nil, err
	}
	var out []state.Event
	err := s.view(ctx, "events", func(tx *bolt.Tx) error {
		b, err := runBucket(tx, runID)
		if err != nil {
			return err
		}
		return b.Bucket([]byte(bucketEvents)).ForEach(func(k, raw []byte) error {
			e, err := decodeEvent(runID, raw)
			if err != nil {
				return storeErr("run %s: decoding event %x: %w", runID, k, err)
			}
			out = append(out, e)
			return nil
		})
	})
	return out, err
}

func runBucket(tx *bolt.Tx, runID string) (*bolt.Bucket, error) {
	b := tx.Bucket([]byte(bucketRun)).Bucket([]byte(runID))
	if b == nil {
		return nil, fmt.Errorf("run %s: %w", runID, state.ErrNotFound)
	}
	return b, nil
}

// Prune removes the intents and events of up to req.Limit runs whose
// retention entry is older than req.FinalBefore, oldest first, in one
// transaction. It reads the retention index only up to FinalBefore, so a
// call that finds nothing costs a seek.
func (s *Store) Prune(ctx context.Context, req state.PruneRequest) (int, error) {
	if err := req.Validate(); err != nil {
		return 0, err
	}
	before := req.FinalBefore.UnixMilli()
	var due []string
	err := s.view(ctx, "prune", func(tx *bolt.Tx) error {
		c := tx.Bucket([]byte(bucketFinal)).Cursor()
		for k, _ := c.First(); k != nil && len(due) < req.Limit; k, _ = c.Next() {
			if len(k) < 8 || int64(binary.BigEndian.Uint64(k)) >= before {
				break
			}
			due = append(due, string(k[8:]))
		}
		return nil
	})
	if err != nil || len(due) == 0 {
		return 0, err
	}
	pruned := 0
	err = s.update(ctx, "prune", func(t *txn) error {
		pruned = 0
		for _, id := range due {
			r, found, err := t.run(id)
			if err != nil {
				return err
			}
			// Checked again in the write transaction: a refusal may have
			// renewed the entry since the read.
			if !found || !r.row.Final() || r.retention == 0 || r.retention >= before {
				continue
			}
			if err := r.prune(); err != nil {
				return err
			}
			if err := r.save(); err != nil {
				return err
			}
			pruned++
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	return pruned, nil
}
