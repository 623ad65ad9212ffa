package redisstore

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/state"
)

// The cross-run indexes (all run ids for List, live run ids for LiveRuns)
// cannot live in a run's slot, so no run script can keep them in step. The
// rule that keeps them correct whatever fails in between:
//
//   - an id is added to the index (index.lua) BEFORE any script that may
//     create its row runs: a row never exists without its index entry, even
//     if this process dies between the two steps;
//   - readers read the index, then the rows: an id without a row is skipped
//     (its creation failed or is under way), an id whose row is final is
//     dropped from the live set (a final row never changes again);
//   - an id without a row is dropped only when its index entry is older
//     than pruneGrace (prune.lua compares the server-time score), because a
//     younger entry may belong to a row being created right now.

// pruneGrace is how long an index entry without a row is kept. It only has
// to exceed the time between the index step and the row's script, which is
// bounded by OpTimeout; minutes leave room for a stalled process.
const pruneGrace = 10 * time.Minute

// maxKnown bounds the memory of the known-rows cache; when full it starts
// over, which costs one extra index round trip per run.
const maxKnown = 1 << 16

// knownRuns remembers ids whose row this process has seen exist. Such an id
// is in the index already (rows are created only after their index entry),
// so an auto-admitting guard can skip the index step.
type knownRuns struct {
	mu sync.Mutex
	m  map[string]struct{}
}

func (k *knownRuns) has(id string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	_, ok := k.m[id]
	return ok
}

func (k *knownRuns) add(id string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.m == nil || len(k.m) >= maxKnown {
		k.m = map[string]struct{}{}
	}
	k.m[id] = struct{}{}
}

// index adds the id to the all-runs index and, when live, to the live set,
// as the first step of op.
func (s *Store) index(ctx context.Context, op, runID string, live bool) error {
	err := indexScript.Run(ctx, s.scripter, []string{allRunsKey, liveRunsKey}, flag(live), runID).Err()
	if err != nil {
		return s.fail(op+" (index step)", runID, err)
	}
	return nil
}

// rows reads the rows of ids, in pipelined batches. Missing rows are absent
// from the map.
func (s *Store) rows(ctx context.Context, op string, ids []string) (map[string]state.Run, error) {
	const batch = 512
	out := make(map[string]state.Run, len(ids))
	for start := 0; start < len(ids); start += batch {
		part := ids[start:min(start+batch, len(ids))]
		cmds := make([]*redis.MapStringStringCmd, len(part))
		_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, id := range part {
				cmds[i] = p.HGetAll(ctx, keysOf(id).row)
			}
			return nil
		})
		if err != nil {
			return nil, s.fail(op, "", err)
		}
		for i, id := range part {
			if m := cmds[i].Val(); len(m) > 0 {
				out[id] = runOf(id, m)
			}
		}
	}
	return out, nil
}

// members reads one index.
func (s *Store) members(ctx context.Context, op, key string) ([]string, error) {
	ids, err := s.rdb.ZRange(ctx, key, 0, -1).Result()
	if err != nil {
		return nil, s.fail(op, "", err)
	}
	return ids, nil
}

// prune drops old index entries of ids found without a row, within the
// reader's deadline. It is housekeeping: a failure is logged, not returned.
func (s *Store) prune(ctx context.Context, rowless []string) {
	if len(rowless) == 0 {
		return
	}
	args := []any{pruneGrace.Milliseconds()}
	for _, id := range rowless {
		args = append(args, id)
	}
	n, err := pruneScript.Run(ctx, s.scripter, []string{allRunsKey, liveRunsKey}, args...).Int()
	if err != nil {
		s.log.Warn("index entries without a row not pruned", "ids", len(rowless), "err", err)
		return
	}
	if n > 0 {
		s.log.Info("pruned index entries of runs whose creation never completed", "entries", n)
	}
}

// List returns rows ordered by run id, filtered by status ("" lists all).
// It reads every row in the index: the cost grows with the number of runs.
func (s *Store) List(ctx context.Context, status state.Status) ([]state.Run, error) {
	if err := validStatus(status); err != nil {
		return nil, err
	}
	ctx, cancel := s.op(ctx)
	defer cancel()
	ids, err := s.members(ctx, "list", allRunsKey)
	if err != nil {
		return nil, err
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
	s.prune(ctx, rowless)
	return out, nil
}

// LiveRuns lists ids of runs that are not final, and drops final ones from
// the live set as it finds them.
func (s *Store) LiveRuns(ctx context.Context) ([]string, error) {
	ctx, cancel := s.op(ctx)
	defer cancel()
	ids, err := s.members(ctx, "live runs", liveRunsKey)
	if err != nil {
		return nil, err
	}
	rows, err := s.rows(ctx, "live runs", ids)
	if err != nil {
		return nil, err
	}
	var live, final, rowless []string
	for _, id := range ids {
		r, ok := rows[id]
		switch {
		case !ok:
			rowless = append(rowless, id)
		case r.Final():
			final = append(final, id)
		default:
			live = append(live, id)
		}
	}
	if len(final) > 0 {
		err := s.rdb.ZRem(ctx, liveRunsKey, anys(final)...).Err()
		if err != nil {
			// The ids stay in the set and are dropped next time.
			s.log.Warn("final runs not dropped from the live set", "ids", len(final), "err", err)
		}
	}
	s.prune(ctx, rowless)
	slices.Sort(live)
	return live, nil
}

func anys(ss []string) []any {
	out := make([]any, len(ss))
	for i, s := range ss {
		out[i] = s
	}
	return out
}
