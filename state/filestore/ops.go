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
	"github.com/stopgate/stopgate/state/machine"
)

// The rules each method applies are docs/state-machine.md, row by row.

// Admit creates the run ACTIVE at version 1, or returns an ACTIVE row as it is.
func (s *Store) Admit(ctx context.Context, req state.AdmitRequest) (state.AdmitResult, error) {
	if err := req.Validate(); err != nil {
		return state.AdmitResult{}, err
	}
	return oneStep(ctx, s, "admit", req.RunID, machine.Admit, req)
}

// oneStep runs rule on run in a write transaction of its own and answers
// what the rule answers.
func oneStep[R, T any](ctx context.Context, s *Store, op, run string, rule func(machine.View, R, time.Time) (T, *machine.Mutation, error), req R) (T, error) {
	var out T
	err := s.update(ctx, op, func(t *txn) error {
		return t.step(run, func(v machine.View) (m *machine.Mutation, err error) {
			out, m, err = rule(v, req, t.now)
			return m, err
		})
	})
	return out, err
}

// step runs one rule on the run id in t and applies its mutation.
func (t *txn) step(id string, rule func(v machine.View) (*machine.Mutation, error)) error {
	v, err := t.view(id)
	if err != nil {
		return err
	}
	m, err := rule(v)
	if err != nil {
		return err
	}
	defer machine.Release(m)
	return v.apply(m)
}

// Cancel is the compare-and-set ACTIVE → CANCELLING, or a tombstone for an
// unseen run. Subscribers hear of it only after it has committed.
func (s *Store) Cancel(ctx context.Context, req state.CancelRequest) (state.CancelResult, error) {
	if err := req.Validate(); err != nil {
		return state.CancelResult{}, err
	}
	out, err := oneStep(ctx, s, "cancel", req.RunID, machine.Cancel, req)
	if err != nil {
		return state.CancelResult{}, err
	}
	return out, nil
}

// Complete moves ACTIVE → COMPLETED at the version the caller observed.
func (s *Store) Complete(ctx context.Context, req state.CompleteRequest) (state.Run, error) {
	if err := req.Validate(); err != nil {
		return state.Run{}, err
	}
	return oneStep(ctx, s, "complete", req.RunID, machine.Complete, req)
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

// Totals reads the totals each step keeps in its transaction.
func (s *Store) Totals(ctx context.Context) (state.Totals, error) {
	counters := map[string]int64{}
	err := s.view(ctx, "totals", func(tx *bolt.Tx) error {
		return tx.Bucket([]byte(bucketTotals)).ForEach(func(k, v []byte) error {
			if len(v) != 8 {
				return storeErr("total %s is %d bytes", k, len(v))
			}
			counters[string(k)] = int64(binary.BigEndian.Uint64(v))
			return nil
		})
	})
	if err != nil {
		return state.Totals{}, err
	}
	return machine.Totals(counters), nil
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
		// Decided inside the transaction, after the wait for the writer:
		// a caller that gave up while queued finds nothing recorded.
		return t.step(req.RunID, func(v machine.View) (m *machine.Mutation, err error) {
			out, m, err = machine.Guard(v, req, t.now)
			if deadline, late := machine.Late(m, t.clock); late {
				return nil, fmt.Errorf("filestore: guard run %s: %w: the guard's turn came at %s, after its deadline %s; nothing was recorded",
					req.RunID, state.ErrUnavailable, t.clock.Format(time.RFC3339Nano), deadline.UTC().Format(time.RFC3339Nano))
			}
			return m, err
		})
	})
	if err != nil {
		return state.GuardResult{}, err
	}
	return out, nil
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
		return t.step(req.RunID, func(v machine.View) (m *machine.Mutation, err error) {
			*out, m, err = machine.Finish(v, req, t.now)
			return m, err
		})
	}
}

// Note appends one event about an intent and changes nothing else.
func (s *Store) Note(ctx context.Context, req state.NoteRequest) error {
	if err := req.Validate(); err != nil {
		return err
	}
	return s.update(ctx, "note", func(t *txn) error {
		return t.step(req.RunID, func(v machine.View) (*machine.Mutation, error) {
			return machine.Note(v, req, t.now)
		})
	})
}

// Resolve reconciles an UNKNOWN intent, then finalizes the run.
func (s *Store) Resolve(ctx context.Context, req state.ResolveRequest) (state.Intent, error) {
	if err := req.Validate(); err != nil {
		return state.Intent{}, err
	}
	return oneStep(ctx, s, "resolve", req.RunID, machine.Resolve, req)
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
	runs, keys := req.ByRun()
	err := s.update(ctx, "renew", func(t *txn) error {
		// A step may run again (its shared commit rolled back): start over.
		out = state.RenewResult{Runs: map[string]state.Run{}}
		for _, id := range runs {
			err := t.step(id, func(v machine.View) (*machine.Mutation, error) {
				r, m, err := machine.Renew(v, id, req.Owner, req.TTL, keys[id], t.now)
				if r.Found {
					out.Runs[id] = r.Run
					out.Renewed = append(out.Renewed, r.Renewed...)
				}
				return m, err
			})
			if err != nil {
				return err
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
	return oneStep(ctx, s, "tick", req.RunID, machine.Tick, req)
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
