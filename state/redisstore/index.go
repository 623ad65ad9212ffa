package redisstore

import (
	"context"
	"slices"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/state"
)

// The cross-run indexes (keys.go: all runs, active, draining, ended)
// cannot live in a run's slot, so no run script can keep them in step. The
// rules that keep them correct whatever fails in between:
//
//   - an id is added to an index (index.lua) BEFORE any script that may
//     put its row where that index must find it: before a row is created
//     (all runs, active), before a cancel (draining, ended), before a
//     completion (ended). A row is never in a state its indexes miss, even
//     if this process dies between the two steps.
//   - readers read an index, then the rows, and trust the rows: an id
//     without a row is skipped; an id whose row is no longer in the
//     index's states is dropped from that index (a run never goes back to
//     ACTIVE, and a final row never changes again).
//   - an entry is dropped for lack of a row (or, in the draining set, for
//     an ACTIVE row) only when it is older than pruneGrace (unindex.lua
//     dates it by the server's clock, in one step), because a younger entry
//     may belong to a row being created, or a cancel being applied, now.
//   - removal that would hide a row comes BEFORE the run step that makes
//     the entry useless, and is undone if that step fails (Prune); an entry
//     added again after a run step (a refusal recorded against a pruned
//     run) only costs a read if the step did not happen.

// pruneGrace is how long an index entry without a row is kept. It only has
// to exceed the time between the index step and the row's script, which is
// bounded by OpTimeout; minutes leave room for a stalled process.
const pruneGrace = 10 * time.Minute

// indexLayout is the index layout this store writes; Open folds an older
// one into it (layout.lua).
const indexLayout = "2"

// indexEntry names one index key and how the index script scores the id
// there (index.lua: 't' now, 'n' now unless present, '0' zero).
type indexEntry struct {
	key, mode string
}

var (
	// indexCreate comes before a step that may create an ACTIVE row.
	indexCreate = []indexEntry{{allRunsKey, "t"}, {activeKey, "0"}}
	// indexCancel comes before a cancel: it may create a tombstone, and
	// it starts the run's drain and its way to a final status.
	indexCancel = []indexEntry{{allRunsKey, "t"}, {drainingKey, "t"}, {endedKey, "n"}}
	// indexEnd comes before a completion, and after a refusal recorded
	// against a pruned run (so that retention finds the new records).
	indexEnd = []indexEntry{{endedKey, "n"}}
	// indexSelfCancel comes after a step that cancelled its run itself
	// (a budget crossed, a tripwire met, in a guard, an outcome or a
	// tick), which no index step could come before without a round trip
	// on every effect of every run: the active set, which holds every run
	// that may be ACTIVE, stands in until then (ActiveRuns moves what it
	// finds cancelled into the draining and ended sets).
	indexSelfCancel = []indexEntry{{drainingKey, "n"}, {endedKey, "n"}}
)

// indexCancelled indexes a run that a step cancelled itself, in the
// background: the step is written already, and a failure leaves the run
// to ActiveRuns.
func (s *Store) indexCancelled(run string) {
	go func() {
		ctx, cancel := s.bound(context.Background())
		defer cancel()
		if err := s.index(ctx, "self-cancel", run, indexSelfCancel); err != nil {
			s.log.Warn("a run its budget or a tripwire cancelled is not in the draining set yet; the sweep of active runs puts it there", "run_id", run, "err", err)
		}
	}()
}

// index adds the id to the indexes named, as the first step of op.
func (s *Store) index(ctx context.Context, op, runID string, entries []indexEntry) error {
	keys := make([]string, len(entries))
	args := make([]any, 0, 1+len(entries))
	args = append(args, runID)
	for i, e := range entries {
		keys[i] = e.key
		args = append(args, e.mode)
	}
	if err := indexScript.Run(ctx, s.scripter, keys, args...).Err(); err != nil {
		return s.fail(op+" (index step)", runID, err)
	}
	return nil
}

// migrate folds an index of an older layout into this one.
func (s *Store) migrate(ctx context.Context) error {
	n, err := layoutScript.Run(ctx, s.scripter,
		[]string{layoutKey, legacyLiveKey, allRunsKey, activeKey, drainingKey, endedKey}, indexLayout).Int()
	if err != nil {
		return s.fail("index layout", "", err)
	}
	if n == 1 {
		s.log.Info("run indexes are in layout " + indexLayout)
	}
	return nil
}

// statuses reads the named fields of the rows of ids, in pipelined
// batches. A missing row is absent from the map.
func (s *Store) statuses(ctx context.Context, op string, ids []string, fields ...string) (map[string][]string, error) {
	out := make(map[string][]string, len(ids))
	err := s.readRows(ctx, op, ids, fields, func(id string, vals []any) {
		if len(vals) == 0 || vals[0] == nil {
			return
		}
		row := make([]string, len(vals))
		for j, v := range vals {
			row[j], _ = v.(string)
		}
		out[id] = row
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// rows reads the rows of ids (their own fields, not their intents), in
// pipelined batches. Missing rows are absent from the map.
func (s *Store) rows(ctx context.Context, op string, ids []string) (map[string]state.Run, error) {
	out := make(map[string]state.Run, len(ids))
	err := s.readRows(ctx, op, ids, rowFields, func(id string, vals []any) {
		if m := rowOf(vals); m != nil {
			out[id] = runOf(id, m)
		}
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// readRows reads fields of the rows of ids with HMGET, pipelined in
// batches, and hands each row's answer to got, in the order of ids.
func (s *Store) readRows(ctx context.Context, op string, ids, fields []string, got func(id string, vals []any)) error {
	const batch = 512
	for start := 0; start < len(ids); start += batch {
		part := ids[start:min(start+batch, len(ids))]
		cmds := make([]*redis.SliceCmd, len(part))
		_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, id := range part {
				cmds[i] = p.HMGet(ctx, keysOf(id).row, fields...)
			}
			return nil
		})
		if err != nil {
			return s.fail(op, "", err)
		}
		for i, id := range part {
			got(id, cmds[i].Val())
		}
	}
	return nil
}

// unindex drops old entries of ids that the caller found useless from
// dated and the other keys, within the reader's deadline. It is
// housekeeping: a failure is logged, not returned.
func (s *Store) unindex(ctx context.Context, why string, ids []string, dated string, others ...string) {
	if len(ids) == 0 {
		return
	}
	args := make([]any, 0, 1+len(ids))
	args = append(args, pruneGrace.Milliseconds())
	for _, id := range ids {
		args = append(args, id)
	}
	n, err := unindexScript.Run(ctx, s.scripter, append([]string{dated}, others...), args...).Int()
	if err != nil {
		s.log.Warn("index entries not dropped", "why", why, "ids", len(ids), "err", err)
		return
	}
	if n > 0 {
		s.log.Info("index entries dropped", "why", why, "entries", n)
	}
}

// rowless drops old entries of ids without a row from every index.
func (s *Store) rowless(ctx context.Context, ids []string) {
	s.unindex(ctx, "no row: its creation never completed", ids, indexKeys[0], indexKeys[1:]...)
}

// List returns rows ordered by run id, filtered by status ("" lists all).
// It reads every row in the index: the cost grows with the number of runs.
func (s *Store) List(ctx context.Context, status state.Status) ([]state.Run, error) {
	if err := validStatus(status); err != nil {
		return nil, err
	}
	ctx, cancel := s.op(ctx)
	defer cancel()
	ids, err := s.rdb.ZRange(ctx, allRunsKey, 0, -1).Result()
	if err != nil {
		return nil, s.fail("list", "", err)
	}
	rows, err := s.rows(ctx, "list", ids)
	if err != nil {
		return nil, err
	}
	slices.Sort(ids)
	var out []state.Run
	var rowless []string
	for _, id := range ids {
		r, ok := rows[id]
		if !ok {
			rowless = append(rowless, id)
			continue
		}
		if status == "" || r.Status == status {
			out = append(out, r)
		}
	}
	s.rowless(ctx, rowless)
	ptrs := make([]*state.Run, len(out))
	for i := range out {
		ptrs[i] = &out[i]
	}
	if err := s.usageOfRuns(ctx, "list", ptrs); err != nil {
		return nil, err
	}
	return out, nil
}

// drainingPage is how many entries of the draining set one read takes:
// the set is walked in pages, each settled before the next is read.
const drainingPage = 1000

// DrainingRuns lists the ids of CANCELLING and UNKNOWN runs from the
// draining set, and drops from it the final runs it finds there.
//
// The set is walked with ZSCAN, a page at a time, and each page's final
// runs are dropped before the next page is read: a set that grew large
// (cancels applied while no sweeper ran, each leaving its entry) shrinks
// with every walk, even one its caller's deadline cuts short, instead of
// being read whole, and failing whole, on every sweep. ZSCAN returns
// every id that stays in the set for the whole walk (some perhaps twice).
func (s *Store) DrainingRuns(ctx context.Context) ([]string, error) {
	ctx, cancel := s.op(ctx)
	defer cancel()
	var out []string
	var cursor uint64
	for {
		ids, next, err := s.rdb.ZScan(ctx, drainingKey, cursor, "", drainingPage).Result()
		if err != nil {
			return nil, s.fail("draining runs", "", err)
		}
		// ZSCAN answers member, score, member, score, ...
		members := make([]string, 0, len(ids)/2)
		for i := 0; i < len(ids); i += 2 {
			members = append(members, ids[i])
		}
		found, err := s.settleDraining(ctx, members)
		if err != nil {
			return nil, err
		}
		out = append(out, found...)
		if cursor = next; cursor == 0 {
			break
		}
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

// settleDraining reads the rows of ids from the draining set and returns
// those still draining; final runs leave the set now, and entries without
// a row or of a cancel never applied once they are old.
func (s *Store) settleDraining(ctx context.Context, ids []string) ([]string, error) {
	rows, err := s.statuses(ctx, "draining runs", ids, "status")
	if err != nil {
		return nil, err
	}
	var out, final, active, rowless []string
	for _, id := range ids {
		row, ok := rows[id]
		switch {
		case !ok:
			rowless = append(rowless, id)
		case row[0] == string(state.StatusCancelling) || row[0] == string(state.StatusUnknown):
			out = append(out, id)
		case row[0] == string(state.StatusActive):
			// A cancel indexed but not applied (yet, or ever).
			active = append(active, id)
		default:
			final = append(final, id)
		}
	}
	s.dropFinal(ctx, final...)
	s.unindex(ctx, "a cancel that was never applied", active, drainingKey)
	s.rowless(ctx, rowless)
	return out, nil
}

// dropFinal takes runs that are final out of the draining set: a final row
// never changes again, so its entry can only cost reads. A failure leaves
// them for the next walk.
func (s *Store) dropFinal(ctx context.Context, ids ...string) {
	if len(ids) == 0 {
		return
	}
	if err := s.rdb.ZRem(ctx, drainingKey, anys(ids)...).Err(); err != nil {
		s.log.Warn("final runs not dropped from the draining set", "ids", len(ids), "err", err)
	}
}

// ActiveRuns lists up to limit ids of ACTIVE runs after `after`, in id
// order, from the active set (ZRANGE BYLEX: a seek and a short read,
// whatever the number of runs). Ids found no longer ACTIVE leave the set
// as they are read; reading goes on until limit ids are found or the set
// ends, so a short page means the end.
func (s *Store) ActiveRuns(ctx context.Context, after string, limit int) ([]string, error) {
	if err := state.ValidatePage(after, limit); err != nil {
		return nil, err
	}
	ctx, cancel := s.op(ctx)
	defer cancel()
	var out []string
	for len(out) < limit {
		start := "-"
		if after != "" {
			start = "(" + after
		}
		want := limit - len(out)
		ids, err := s.rdb.ZRangeByLex(ctx, activeKey, &redis.ZRangeBy{Min: start, Max: "+", Count: int64(want)}).Result()
		if err != nil {
			return nil, s.fail("active runs", "", err)
		}
		rows, err := s.statuses(ctx, "active runs", ids, "status")
		if err != nil {
			return nil, err
		}
		var gone, rowless []string
		for _, id := range ids {
			row, ok := rows[id]
			switch {
			case !ok:
				rowless = append(rowless, id)
			case row[0] == string(state.StatusActive):
				out = append(out, id)
			default:
				gone = append(gone, id)
				if row[0] != string(state.StatusCompleted) {
					// Cancelled by one of its own steps (a budget, a
					// tripwire), whose index step may not have come:
					// it leaves this set only once in the others.
					if err := s.index(ctx, "active runs", id, indexSelfCancel); err != nil {
						return nil, err
					}
				}
			}
		}
		if len(gone) > 0 {
			if err := s.rdb.ZRem(ctx, activeKey, anys(gone)...).Err(); err != nil {
				s.log.Warn("runs no longer ACTIVE not dropped from the active set", "ids", len(gone), "err", err)
			}
		}
		s.rowless(ctx, rowless)
		if len(ids) < want {
			break
		}
		after = ids[len(ids)-1]
	}
	return out, nil
}

// Prune removes the intents and events of up to req.Limit runs that became
// final before req.FinalBefore. It walks the ended set oldest first, up to
// FinalBefore; each entry read is settled so that the next walk does not
// read it again: pruned (the entry leaves first, and comes back if the
// run's step fails), not final yet (re-dated now), or final too recently
// (re-dated to when it became final).
func (s *Store) Prune(ctx context.Context, req state.PruneRequest) (int, error) {
	if err := req.Validate(); err != nil {
		return 0, err
	}
	ctx, cancel := s.op(ctx)
	defer cancel()
	before := req.FinalBefore.UnixMilli()
	// A walk reads a bounded number of entries: young entries without a
	// row may stay in range until their grace passes.
	budget := 4*req.Limit + 256
	pruned := 0
	for pruned < req.Limit && budget > 0 {
		zs, err := s.rdb.ZRangeByScoreWithScores(ctx, endedKey, &redis.ZRangeBy{
			Min: "-inf", Max: "(" + strconv.FormatInt(before, 10), Count: int64(min(budget, 256)),
		}).Result()
		if err != nil {
			return pruned, s.fail("prune", "", err)
		}
		if len(zs) == 0 {
			break
		}
		budget -= len(zs)
		ids := make([]string, len(zs))
		for i, z := range zs {
			ids[i] = z.Member.(string)
		}
		rows, err := s.statuses(ctx, "prune", ids, "status", "updated", "t")
		if err != nil {
			return pruned, err
		}
		var rowless, draining []string
		for i, id := range ids {
			row, ok := rows[id]
			if !ok {
				rowless = append(rowless, id)
				continue
			}
			if row[0] != string(state.StatusCancelled) && row[0] != string(state.StatusCompleted) {
				draining = append(draining, id)
				continue
			}
			final, _ := strconv.ParseInt(row[1], 10, 64)
			if final >= before {
				if err := s.rdb.ZAddXX(ctx, endedKey, redis.Z{Score: float64(final), Member: id}).Err(); err != nil {
					return pruned, s.fail("prune", id, err)
				}
				continue
			}
			if pruned == req.Limit {
				continue
			}
			ok, err := s.pruneRun(ctx, id, row, zs[i].Score)
			if err != nil {
				return pruned, err
			}
			if ok {
				pruned++
			}
		}
		for _, id := range draining {
			if err := s.index(ctx, "prune", id, []indexEntry{{endedKey, "t"}}); err != nil {
				return pruned, err
			}
		}
		s.rowless(ctx, rowless)
	}
	return pruned, nil
}

// pruneRun prunes one run: its ended entry leaves first, so that a refusal
// recorded against it after the prune puts one back (indexEnd); if the
// run's step fails, the entry is put back.
func (s *Store) pruneRun(ctx context.Context, id string, row []string, score float64) (bool, error) {
	if err := s.rdb.ZRem(ctx, endedKey, id).Err(); err != nil {
		return false, s.fail("prune", id, err)
	}
	// The row's status and last step as read: anything recorded against
	// the run since (a refusal of its agent) leaves it for the next prune.
	args := append(append([]any{row[0], row[2], s.clock().UnixMilli()}, anys(rowFields)...), anys(fixedUsage)...)
	n, err := s.exec(ctx, pruneProgram, keysOf(id).list(), args...).Int()
	if err != nil {
		if err2 := s.rdb.ZAddNX(ctx, endedKey, redis.Z{Score: score, Member: id}).Err(); err2 != nil {
			s.log.Warn("a run's retention entry was not put back after its prune failed; its records stay until something is recorded against it", "run_id", id, "err", err2)
		}
		return false, s.fail("prune", id, err)
	}
	return n == 1, nil
}

func anys(ss []string) []any {
	out := make([]any, len(ss))
	for i, s := range ss {
		out[i] = s
	}
	return out
}
