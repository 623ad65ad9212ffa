package redisstore

// Test access to the key layout: the hash-tag test checks the KEYS every
// per-run script is given.

// KeysOf returns the KEYS of every per-run script for runID.
func KeysOf(runID string) []string { return keysOf(runID).list() }

// IndexKeys are the cross-run index keys.
var IndexKeys = []string{allRunsKey, liveRunsKey}

// PruneGrace is how old a rowless index entry must be to be dropped.
const PruneGrace = pruneGrace
