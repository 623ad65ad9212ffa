package redisstore

import (
	"context"
	"fmt"

	"github.com/stopgate/stopgate/state"
)

// Test access to the key layout: the hash-tag test checks the KEYS every
// per-run script is given.

// KeysOf returns the KEYS of every per-run script for runID.
func KeysOf(runID string) []string { return keysOf(runID).list() }

// IndexKeys are the cross-run index keys: all runs, active, draining, ended.
var IndexKeys = indexKeys

// LegacyLiveKey is the live set of the index layout before this one.
const LegacyLiveKey = legacyLiveKey

// PruneGrace is how old a rowless index entry must be to be dropped.
const PruneGrace = pruneGrace

// Functions reports whether the store runs its programs as functions (true)
// or as scripts.
func (s *Store) Functions() bool { return s.fns.on() }

// BatchStep is one step of a call of the batch program: a guard or, when
// Guard is nil, an outcome.
type BatchStep struct {
	Guard  *state.GuardRequest
	Finish state.FinishRequest
}

// CallBatch sends steps, all of runID, as one call of the batch program,
// as the batcher would have joined them, and returns each step's intent
// key: a benchmark that needs calls of one shape, every time, makes them
// so.
func (s *Store) CallBatch(ctx context.Context, runID string, steps []BatchStep) ([]string, error) {
	args := []any{1, len(steps)}
	for _, st := range steps {
		if st.Guard != nil {
			g := *st.Guard
			g.RunID = runID
			args = append(append(args, "g"), guardArgs(g)...)
			continue
		}
		f := st.Finish
		f.RunID = runID
		args = append(append(args, "f"), finishArgs(f)...)
	}
	v, err := s.exec(ctx, batchProgram, keysOf(runID).list(), args...).Result()
	if err != nil {
		return nil, err
	}
	answers, ok := v.([]any)
	if !ok || len(answers) != len(steps) {
		return nil, errBatchReply
	}
	keys := make([]string, len(steps))
	for i, a := range answers {
		r, err := parseReply(a)
		if err != nil {
			return nil, err
		}
		if r.result != "ok" || r.intent == nil {
			return nil, fmt.Errorf("step %d answered %s %s", i, r.result, r.code)
		}
		keys[i] = r.intent.key
	}
	return keys, nil
}
