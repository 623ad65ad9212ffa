package redisstore

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"

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

// BatchStep is one step of a call of the batch program: a guard (Code
// 'g') or an outcome ('f'), its run left to the call.
type BatchStep struct {
	Code   byte
	Guard  state.GuardRequest
	Finish state.FinishRequest
}

// args are the step's arguments, for run.
func (st BatchStep) args(run string) stepArgs {
	if st.Code == 'g' {
		req := st.Guard
		req.RunID = run
		return guardArgs(req)
	}
	req := st.Finish
	req.RunID = run
	return finishArgs(req)
}

// callArgs are the KEYS and ARGV of one call of the batch program holding
// steps for each of runs, a group per run, as the batcher joins them.
func callArgs(runs []string, steps []BatchStep) ([]string, []any) {
	var sent []*step
	for _, run := range runs {
		for _, st := range steps {
			sent = append(sent, &step{run: run, code: st.Code, args: st.args(run)})
		}
	}
	return batchCall(sent)
}

// CallBatch sends steps, all of runID, as one call of the batch program,
// and returns each step's intent key: a benchmark that needs calls of one
// shape, every time, makes them so.
func (s *Store) CallBatch(ctx context.Context, runID string, steps []BatchStep) ([]string, error) {
	keys, err := s.CallRuns(ctx, []string{runID}, [][]BatchStep{steps})
	if err != nil {
		return nil, err
	}
	return keys[0], nil
}

// CallRuns sends steps[i] of runs[i], a group each, as one call of the
// batch program, as the batcher joins the steps of a fleet's runs, and
// returns each step's intent key, group by group.
func (s *Store) CallRuns(ctx context.Context, runs []string, steps [][]BatchStep) ([][]string, error) {
	var sent []*step
	for i, run := range runs {
		for _, st := range steps[i] {
			sent = append(sent, &step{run: run, code: st.Code, args: st.args(run)})
		}
	}
	keys, args := batchCall(sent)
	v, err := s.exec(ctx, batchProgram, keys, args...).Result()
	if err != nil {
		return nil, err
	}
	answers, ok := v.([]any)
	if !ok || len(answers) != len(sent) {
		return nil, errBatchReply
	}
	out := make([][]string, len(runs))
	k := 0
	for i := range runs {
		for _, st := range steps[i] {
			r, err := parseReply(answers[k])
			if err != nil {
				return nil, err
			}
			switch {
			case r.result == "ok" && r.admitted.key != "":
				out[i] = append(out[i], r.admitted.key)
			case r.result == "ok" && r.intent != nil:
				out[i] = append(out[i], r.intent.key)
			case r.result == "ok" && st.Code == 'l':
				// Answered without its record.
				out[i] = append(out[i], st.Finish.Key)
			default:
				return nil, fmt.Errorf("step %d answered %s %s", k, r.result, r.code)
			}
			k++
		}
	}
	return out, nil
}

// ClientPassword is the password the go-redis client built for raw, with
// password given apart, authenticates with: for a Sentinel URL, to the
// master; for a cluster, to every node.
func ClientPassword(raw, password string) (string, error) {
	t, err := parseURL(raw)
	if err != nil {
		return "", err
	}
	if err := t.withPassword(password); err != nil {
		return "", err
	}
	c := newClient(t, DefaultOpTimeout)
	defer c.Close()
	switch c := c.(type) {
	case *redis.ClusterClient:
		return c.Options().Password, nil
	case *redis.Client:
		return c.Options().Password, nil
	}
	return "", fmt.Errorf("a %T", c)
}
