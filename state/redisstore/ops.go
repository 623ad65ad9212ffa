package redisstore

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/machine"
)

// The operations of state.Store that change a run: each is one step (a
// rule of package machine), run through the batcher.

// Admit creates the run ACTIVE at version 1, or returns an ACTIVE row as it is.
func (s *Store) Admit(ctx context.Context, req state.AdmitRequest) (state.AdmitResult, error) {
	if err := req.Validate(); err != nil {
		return state.AdmitResult{}, err
	}
	if err := s.refuseWhileReset("admit", req.RunID); err != nil {
		return state.AdmitResult{}, err
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	if err := s.beforeCreate(ctx, "admit", req.RunID); err != nil {
		return state.AdmitResult{}, err
	}
	if err := s.index(ctx, "admit", req.RunID, indexCreate); err != nil {
		return state.AdmitResult{}, err
	}
	var out state.AdmitResult
	err := s.batches.do(ctx, s, &step{run: req.RunID, op: "admit",
		decide: func(v machine.View, now time.Time) (m *machine.Mutation, err error) {
			out, m, err = machine.Admit(v, req, now)
			return m, err
		},
		settle: func(row state.Run, _ []*record) error { out.Run = row; return nil },
	})
	return out, err
}

// Cancel is the compare-and-set ACTIVE → CANCELLING (or a tombstone for an
// unseen run); a changed row is announced on the cancel channel in the same
// step.
func (s *Store) Cancel(ctx context.Context, req state.CancelRequest) (state.CancelResult, error) {
	if err := req.Validate(); err != nil {
		return state.CancelResult{}, err
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	// A tombstone is a row, and a cancelled run drains: index it first.
	if err := s.index(ctx, "cancel", req.RunID, indexCancel); err != nil {
		return state.CancelResult{}, err
	}
	var out state.CancelResult
	st := &step{run: req.RunID, op: "cancel", needs: needs{schedule: true},
		decide: func(v machine.View, now time.Time) (m *machine.Mutation, err error) {
			out, m, err = machine.Cancel(v, req, now)
			return m, err
		},
		settle: func(row state.Run, _ []*record) error { out.Run = row; return nil },
	}
	var err error
	if s.cancelReplicas > 0 {
		err = s.cancelReplicated(ctx, st, &out)
	} else {
		err = s.batches.do(ctx, s, st)
	}
	if err != nil {
		return state.CancelResult{}, err
	}
	if out.Run.Final() {
		// Nothing to drain (a run never admitted, or with nothing in
		// flight): its draining entry would only be read and dropped
		// by every instance's next sweep.
		s.dropFinal(ctx, req.RunID)
	}
	return out, nil
}

// cancelReplicated runs the cancel, then WAIT, on one connection to the
// run's primary: WAIT counts the replicas that have the last write of its
// own connection. A cancel that changes nothing (a retry after a WAIT fell
// short) still writes, the row's last step, which replicates after the
// cancel it confirms. Neither is retried (MaxRetries -1 on every node
// client).
func (s *Store) cancelReplicated(ctx context.Context, st *step, out *state.CancelResult) error {
	k := keysOf(st.run)
	node, err := s.primary(ctx, k.row)
	if err != nil {
		return s.fail("cancel", st.run, err)
	}
	conn := node.Conn()
	defer conn.Close()
	on := func(ctx context.Context, p *program, keys []string, cmd []any) *redis.Cmd {
		return s.execOn(ctx, conn, p, keys, cmd[headRoom(keys):]...)
	}
	s.runStepsVia(ctx, []*step{st}, on)
	if st.err != nil {
		return st.err
	}
	if !out.Changed {
		touch := &step{run: st.run, op: "cancel", touch: []any{"=", "status", string(out.Run.Status)}}
		if s.runStepsVia(ctx, []*step{touch}, on); touch.err != nil {
			return touch.err
		}
	}
	// WAIT must answer before the operation's deadline, or its answer is lost.
	wait := time.Second
	if dl, ok := ctx.Deadline(); ok {
		wait = time.Until(dl) * 4 / 5
	}
	wait = max(wait, time.Millisecond)
	got, err := conn.Do(ctx, "WAIT", s.cancelReplicas, ms(wait)).Int()
	if err != nil {
		err = s.fail("cancel wait", st.run, err)
		return fmt.Errorf("%w (the cancel ran on the primary; cancel again to confirm it reached %d replicas)", err, s.cancelReplicas)
	}
	if got < s.cancelReplicas {
		return fmt.Errorf("redis cancel run %s on %s: %w: only %d of %d replicas confirmed the cancel within %s; "+
			"it is committed on the primary, which refuses the run's effects, but a failover now could lose it: cancel again to confirm",
			st.run, s.addr, state.ErrUnavailable, got, s.cancelReplicas, wait.Round(time.Millisecond))
	}
	return nil
}

// primary is the client of the node that holds key's slot: the cluster's
// master for it, or the one server (Sentinel's current master).
func (s *Store) primary(ctx context.Context, key string) (*redis.Client, error) {
	switch c := s.rdb.(type) {
	case *redis.ClusterClient:
		return c.MasterForKey(ctx, key)
	case *redis.Client:
		return c, nil
	default:
		return nil, fmt.Errorf("no primary for a %T", s.rdb)
	}
}

// Complete moves ACTIVE → COMPLETED at the observed version.
func (s *Store) Complete(ctx context.Context, req state.CompleteRequest) (state.Run, error) {
	if err := req.Validate(); err != nil {
		return state.Run{}, err
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	if err := s.index(ctx, "complete", req.RunID, indexEnd); err != nil {
		return state.Run{}, err
	}
	var out state.Run
	err := s.batches.do(ctx, s, &step{run: req.RunID, op: "complete",
		decide: func(v machine.View, now time.Time) (m *machine.Mutation, err error) {
			out, m, err = machine.Complete(v, req, now)
			return m, err
		},
		settle: func(row state.Run, _ []*record) error { out = row; return nil },
	})
	return out, err
}

// Guard is the one atomic check-and-record of an effect. On a run this
// process saw ACTIVE it is one round trip: decided on what was seen, and
// written under it.
func (s *Store) Guard(ctx context.Context, req state.GuardRequest) (state.GuardResult, error) {
	if err := req.Validate(); err != nil {
		return state.GuardResult{}, err
	}
	if err := s.refuseWhileReset("guard", req.RunID); err != nil {
		return state.GuardResult{}, err
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	req = req.Fenced(ctx)
	// Only an auto-admitting guard can create the row; once this process
	// has seen the row, its index entry exists and the extra round trips
	// (the marker, the index) are skipped (the hot path).
	seen := s.seen.has(req.RunID)
	if req.AutoAdmit && !seen {
		if err := s.markerHolds(ctx, "guard", req.RunID); err != nil {
			return state.GuardResult{}, err
		}
		if err := s.index(ctx, "guard", req.RunID, indexCreate); err != nil {
			return state.GuardResult{}, err
		}
	}
	// A row seen once is never created again: gone, it was lost (marker.go).
	req.AutoAdmit = req.AutoAdmit && !seen
	var out state.GuardResult
	if err := s.batches.do(ctx, s, s.guardStep(req, &out)); err != nil {
		return state.GuardResult{}, err
	}
	if seen && out.Refusal == state.RefusalRunNotAdmitted {
		return state.GuardResult{}, s.rowGone(ctx, "guard", req.RunID)
	}
	if !out.Admitted && out.Run.Final() && !out.Run.PrunedAt.IsZero() {
		// A refusal recorded against a pruned run: retention must find
		// the run again. The record is written already; if this step
		// fails it stays until the next refusal puts the entry back.
		if err := s.index(ctx, "guard", req.RunID, indexEnd); err != nil {
			s.log.Warn("a refusal of a pruned run is not in the retention index", "run_id", req.RunID, "err", err)
		}
	}
	return out, nil
}

// guardStep is the step of a guard; out is its answer.
func (s *Store) guardStep(req state.GuardRequest, out *state.GuardResult) *step {
	return &step{run: req.RunID, op: "guard", assume: assumption{on: true}, key: req.Key, derived: !req.ExplicitKey,
		decide: func(v machine.View, now time.Time) (m *machine.Mutation, err error) {
			*out, m, err = machine.Guard(v, req, now)
			return m, err
		},
		settle: func(row state.Run, _ []*record) error { out.Run = row; return nil },
	}
}

// finishStep is the step of an outcome; out is the record as written.
func (s *Store) finishStep(req state.FinishRequest, out *state.Intent) *step {
	return &step{run: req.RunID, op: "finish", rowless: true, assume: assumption{on: true, key: req.Key, attempt: req.Attempt},
		key: req.Key,
		decide: func(v machine.View, now time.Time) (m *machine.Mutation, err error) {
			*out, m, err = machine.Finish(v, req, now)
			return m, err
		},
		settle: func(_ state.Run, recs []*record) error {
			if r := recordOf(recs, req.Key); r != nil {
				*out = r.in
			}
			return nil
		},
	}
}

// Finish records the outcome of an IN_FLIGHT intent, then finalizes the run.
func (s *Store) Finish(ctx context.Context, req state.FinishRequest) (state.Intent, error) {
	if err := req.Validate(); err != nil {
		return state.Intent{}, err
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	var out state.Intent
	if err := s.batches.do(ctx, s, s.finishStep(req, &out)); err != nil {
		return state.Intent{}, err
	}
	return out, nil
}

// FinishLater queues the outcome in the batcher without leading a call:
// it goes with the next step of its lane, or on its own after
// Options.OutcomeDelay. The call that carries it is bounded by OpTimeout,
// as every call is; ctx only withdraws it if it ends before then.
func (s *Store) FinishLater(ctx context.Context, req state.FinishRequest, done func(error)) {
	if err := req.Validate(); err != nil {
		done(err)
		return
	}
	s.batches.doLater(ctx, s, s.finishStep(req, new(state.Intent)), done)
}

// Note appends one event about an intent and changes nothing else.
func (s *Store) Note(ctx context.Context, req state.NoteRequest) error {
	if err := req.Validate(); err != nil {
		return err
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	return s.batches.do(ctx, s, &step{run: req.RunID, op: "note", rowless: true, key: req.Key,
		decide: func(v machine.View, now time.Time) (*machine.Mutation, error) { return machine.Note(v, req, now) },
	})
}

// Resolve reconciles an UNKNOWN intent, then finalizes the run.
func (s *Store) Resolve(ctx context.Context, req state.ResolveRequest) (state.Intent, error) {
	if err := req.Validate(); err != nil {
		return state.Intent{}, err
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	var out state.Intent
	err := s.batches.do(ctx, s, &step{run: req.RunID, op: "resolve", rowless: true, key: req.Key,
		decide: func(v machine.View, now time.Time) (m *machine.Mutation, err error) {
			out, m, err = machine.Resolve(v, req, now)
			return m, err
		},
		settle: func(_ state.Run, recs []*record) error {
			if r := recordOf(recs, req.Key); r != nil {
				out = r.in
			}
			return nil
		},
	})
	return out, err
}

// Renew extends the owner's leases: one step per run named in refs, in one
// round.
func (s *Store) Renew(ctx context.Context, req state.RenewRequest) (state.RenewResult, error) {
	if err := req.Validate(); err != nil {
		return state.RenewResult{}, err
	}
	out := state.RenewResult{Runs: map[string]state.Run{}}
	runs, keys := req.ByRun()
	ctx, cancel := s.op(ctx)
	defer cancel()
	steps := make([]*step, len(runs))
	renewals := make([]machine.Renewal, len(runs))
	for i, id := range runs {
		steps[i] = &step{run: id, op: "renew", needs: needs{keys: keys[id]},
			decide: func(v machine.View, now time.Time) (m *machine.Mutation, err error) {
				renewals[i], m, err = machine.Renew(v, id, req.Owner, req.TTL, keys[id], now)
				return m, err
			},
			settle: func(row state.Run, _ []*record) error { renewals[i].Run = row; return nil },
		}
	}
	s.runSteps(ctx, steps)
	for i, st := range steps {
		if st.err != nil {
			return state.RenewResult{}, st.err
		}
		if r := renewals[i]; r.Found {
			out.Runs[runs[i]] = r.Run
			out.Renewed = append(out.Renewed, r.Renewed...)
		}
	}
	return out, nil
}

// Tick expires leases and moves a cancelled run on.
func (s *Store) Tick(ctx context.Context, req state.TickRequest) (state.Run, error) {
	if err := req.Validate(); err != nil {
		return state.Run{}, err
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	var out state.Run
	err := s.batches.do(ctx, s, &step{run: req.RunID, op: "tick", needs: needs{leases: true},
		decide: func(v machine.View, now time.Time) (m *machine.Mutation, err error) {
			out, m, err = machine.Tick(v, req, now)
			return m, err
		},
		settle: func(row state.Run, _ []*record) error { out = row; return nil },
	})
	return out, err
}

// recordOf is the last record written under key.
func recordOf(recs []*record, key string) *record {
	for i := len(recs) - 1; i >= 0; i-- {
		if recs[i] != nil && recs[i].in.Key == key {
			return recs[i]
		}
	}
	return nil
}
