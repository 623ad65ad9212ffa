package redisstore

import (
	"fmt"

	"github.com/redis/go-redis/v9"
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

// ClientPassword is the password the go-redis client built for raw, with
// password given apart, authenticates with: for a Sentinel URL, to the
// master; for a cluster, to every node.
func ClientPassword(raw, password string) (string, error) {
	t, err := ParseURL(raw)
	if err != nil {
		return "", err
	}
	if t, err = t.WithPassword(password); err != nil {
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

// TLSOf says whether the go-redis client built for u speaks TLS.
func TLSOf(u URL) bool {
	c := newClient(u, DefaultOpTimeout)
	defer c.Close()
	switch c := c.(type) {
	case *redis.ClusterClient:
		return c.Options().TLSConfig != nil
	case *redis.Client:
		return c.Options().TLSConfig != nil
	}
	return false
}
