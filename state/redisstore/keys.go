package redisstore

// Key layout (docs/redis.md). Every key of a run carries the hash tag {RUN}
// so that all of them hash to one slot and each script runs on one Redis
// Cluster node. Run ids cannot contain braces (state.ValidateRunID), so the
// tag is always the whole id.

const keyPrefix = "sg:"

// cancelChannel is the pub/sub channel that carries the id of every run whose
// cancel commits.
const cancelChannel = keyPrefix + "cancels"

// The cross-run indexes share their own tag, so one script can maintain
// both. They cannot share a slot with the runs they list.
const (
	allRunsKey  = keyPrefix + "{index}:runs"
	liveRunsKey = keyPrefix + "{index}:live"
)

// runKeys are the KEYS of every per-run script, in the order the prelude
// names them.
type runKeys struct {
	row, intents, order, seq, inflight, sched, events string
}

func keysOf(runID string) runKeys {
	p := keyPrefix + "{" + runID + "}:"
	return runKeys{
		row:      p + "run",
		intents:  p + "intents",
		order:    p + "order",
		seq:      p + "seq",
		inflight: p + "inflight",
		sched:    p + "sched",
		events:   p + "events",
	}
}

func (k runKeys) list() []string {
	return []string{k.row, k.intents, k.order, k.seq, k.inflight, k.sched, k.events}
}
