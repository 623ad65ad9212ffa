package redisstore

import (
	"context"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/state"
)

// A run's usage counters are fields of its hash, "u:<counter>", so that
// they share the run's slot and change in the step that uses them (the
// apply program's '+'). The counters of a destination or a model are
// named by what they count, which no reader can know in advance: their
// names are listed in the field u:names ('a'), one a line, for Get, List
// and Prune to read them by.

const (
	usagePrefix = "u:"
	namesField  = usagePrefix + "names"
)

// usageField is the field of a usage counter.
func usageField(counter string) string { return usagePrefix + counter }

// fixedUsage are the fields of the counters every run may have, and the
// list of the named ones, last.
var fixedUsage = []string{
	usageField(state.CounterEffects), usageField(state.CounterRequestBytes), usageField(state.CounterResponseBytes),
	usageField(state.CounterInputTokens), usageField(state.CounterOutputTokens), usageField(state.CounterTokens),
	usageField(state.CounterSpend), usageField(state.CounterLLMCalls), usageField(state.CounterUnknownUsage),
	usageField(state.CounterUnpriced), namesField,
}

// namesOf lists the named counters of a u:names field.
func namesOf(list string) []string {
	var out []string
	for _, n := range strings.Split(list, "\n") {
		if n != "" {
			out = append(out, n)
		}
	}
	return out
}

// usageOf reads the values of an HMGET of fields (usage fields), adding
// them to u.
func usageOf(u state.Usage, fields []string, vals []any) state.Usage {
	for i, f := range fields {
		s, ok := vals[i].(string)
		if !ok || f == namesField {
			continue
		}
		if n, err := strconv.ParseInt(s, 10, 64); err == nil && n != 0 {
			if u == nil {
				u = state.Usage{}
			}
			u[strings.TrimPrefix(f, usagePrefix)] = n
		}
	}
	return u
}

// usageOfRuns fills in the usage of rows, in two pipelined reads: the
// fixed counters and the list of named ones, then the named ones of the
// runs that have some. A read between two steps may see one step's
// counters and the next's names, never a counter that does not exist.
func (s *Store) usageOfRuns(ctx context.Context, op string, rows []*state.Run) error {
	const batch = 512
	for start := 0; start < len(rows); start += batch {
		part := rows[start:min(start+batch, len(rows))]
		cmds := make([]*redis.SliceCmd, len(part))
		if _, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, r := range part {
				cmds[i] = p.HMGet(ctx, keysOf(r.ID).row, fixedUsage...)
			}
			return nil
		}); err != nil {
			return s.fail(op, "", err)
		}
		named := map[int][]string{}
		for i, r := range part {
			vals := cmds[i].Val()
			if len(vals) != len(fixedUsage) {
				continue
			}
			r.Usage = usageOf(r.Usage, fixedUsage, vals)
			if list, ok := vals[len(vals)-1].(string); ok {
				for _, n := range namesOf(list) {
					named[i] = append(named[i], usageField(n))
				}
			}
		}
		if len(named) == 0 {
			continue
		}
		more := map[int]*redis.SliceCmd{}
		if _, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, fields := range named {
				more[i] = p.HMGet(ctx, keysOf(part[i].ID).row, fields...)
			}
			return nil
		}); err != nil {
			return s.fail(op, "", err)
		}
		for i, cmd := range more {
			if vals := cmd.Val(); len(vals) == len(named[i]) {
				part[i].Usage = usageOf(part[i].Usage, named[i], vals)
			}
		}
	}
	return nil
}
