package redisstore

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
