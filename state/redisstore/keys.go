package redisstore

import "strings"

// Key layout (docs/redis.md). Every key of a run carries the hash tag {RUN}
// so that all of them hash to one slot and each script runs on one Redis
// Cluster node. Run ids cannot contain braces (state.ValidateRunID), so the
// tag is always the whole id.

const keyPrefix = "sg:"

// cancelChannel is the pub/sub channel that carries the id of every run whose
// cancel commits.
const cancelChannel = keyPrefix + "cancels"

// The cross-run indexes share their own tag, so one script can maintain
// several. They cannot share a slot with the runs they list; index.go says
// how they stay correct anyway.
const (
	// allRunsKey: every run id (score: when it was last indexed), for List,
	// and the date that tells an entry whose row never came from one whose
	// row is being created now.
	allRunsKey = keyPrefix + "{index}:runs"
	// activeKey: ids of runs that may be ACTIVE (score 0, so that ids read
	// in order by ZRANGE BYLEX), for ActiveRuns.
	activeKey = keyPrefix + "{index}:active"
	// drainingKey: ids of runs that may be CANCELLING or UNKNOWN (score:
	// when the cancel was indexed), for DrainingRuns.
	drainingKey = keyPrefix + "{index}:draining"
	// endedKey: ids of runs that were cancelled or completed (score: no
	// later than when they became final), for Prune.
	endedKey = keyPrefix + "{index}:ended"
	// layoutKey marks the index layout; legacyLiveKey is the live set of
	// the layout before it, folded into the others at Open.
	layoutKey     = keyPrefix + "{index}:layout"
	legacyLiveKey = keyPrefix + "{index}:live"
)

// indexKeys are every index key, in the order the rowless script takes them.
var indexKeys = []string{allRunsKey, activeKey, drainingKey, endedKey}

// runKeys are the KEYS of every per-run program, in the order the prelude
// names them. The run's hash holds the row and its intents; legacy and
// order hold the intents of a run written before layout 2 until a step
// moves them.
type runKeys struct {
	row, legacy, order, seq, inflight, sched, events string
}

// loneLease is the field of the run's hash that holds the key of its one
// effect in flight, when it has only one: its lease is then in the record
// alone, and the lease set is not written (lua/apply.lua). Readers take
// it as one more member of the set.
const loneLease = "l"

// runKeySuffixes name the keys of a run, in the order of runKeys.
var runKeySuffixes = [...]string{"run", "intents", "order", "seq", "inflight", "sched", "events"}

// keysOf names a run's keys, all seven cut from one string: a call of many
// runs names seven keys of each.
func keysOf(runID string) runKeys {
	prefix := len(keyPrefix) + len(runID) + 3 // sg:{RUN}:
	var b strings.Builder
	b.Grow(len(runKeySuffixes)*prefix + len("runintentsorderseqinflightschedevents"))
	var ends [len(runKeySuffixes)]int
	for i, suffix := range runKeySuffixes {
		b.WriteString(keyPrefix + "{")
		b.WriteString(runID)
		b.WriteString("}:")
		b.WriteString(suffix)
		ends[i] = b.Len()
	}
	all := b.String()
	var k [len(runKeySuffixes)]string
	start := 0
	for i, end := range ends {
		k[i], start = all[start:end], end
	}
	return runKeys{row: k[0], legacy: k[1], order: k[2], seq: k[3], inflight: k[4], sched: k[5], events: k[6]}
}

func (k runKeys) list() []string {
	return []string{k.row, k.legacy, k.order, k.seq, k.inflight, k.sched, k.events}
}
