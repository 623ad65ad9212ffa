package redisstore

import (
	"context"
	"fmt"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// Durability is what Redis says about persisting acknowledged writes: the
// operator's answer to "does an acknowledged cancel survive a crash?".
type Durability struct {
	// AOF is appendonly yes.
	AOF bool
	// Fsync is appendfsync: always, everysec or no.
	Fsync string
	// Known is false when the server would not say (CONFIG disabled or
	// renamed, as on most managed services).
	Known bool
}

// Safe reports whether every acknowledged write survives a crash of
// redis-server and a power loss: appendonly yes with appendfsync always.
func (d Durability) Safe() bool {
	return d.Known && d.AOF && d.Fsync == "always"
}

// Describe says in one line what an acknowledged cancel survives.
func (d Durability) Describe() string {
	switch {
	case !d.Known:
		return "durability unknown: Redis does not allow CONFIG GET (managed service?); acknowledged cancels survive a restart only if AOF is on (appendonly yes) and power loss only with appendfsync always: check with your provider"
	case !d.AOF:
		return "NOT durable: AOF off (appendonly no): acknowledged cancels can be lost when redis-server restarts or crashes; at best an RDB snapshot brings back an older state"
	case d.Fsync == "always":
		return "acknowledged cancels survive a redis-server crash and power loss (appendonly yes, appendfsync always)"
	case d.Fsync == "everysec":
		return "acknowledged cancels survive a redis-server crash; up to 1s of them may be lost on power loss (appendonly yes, appendfsync everysec)"
	default:
		return fmt.Sprintf("acknowledged cancels survive a redis-server crash; on power loss the OS decides how many are lost (appendonly yes, appendfsync %s)", d.Fsync)
	}
}

// weaker reports whether d promises less than o.
func (d Durability) weaker(o Durability) bool {
	rank := func(d Durability) int {
		switch {
		case !d.Known:
			return 1
		case !d.AOF:
			return 0
		case d.Fsync == "always":
			return 4
		case d.Fsync == "everysec":
			return 3
		default:
			return 2
		}
	}
	return rank(d) < rank(o)
}

// Durability asks Redis how it persists writes. On a cluster every master is
// asked and the weakest answer is reported: a run's keys live on one of
// them, and the operator cannot know which. A server that refuses CONFIG GET
// gives Known false, not an error; an unreachable one gives ErrUnavailable.
func (s *Store) Durability(ctx context.Context) (Durability, error) {
	ctx, cancel := s.op(ctx)
	defer cancel()
	if cc, ok := s.rdb.(*redis.ClusterClient); ok {
		var mu sync.Mutex
		var weakest *Durability
		err := cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
			d, err := s.durabilityOf(ctx, c)
			if err != nil {
				return err
			}
			mu.Lock()
			defer mu.Unlock()
			if weakest == nil || d.weaker(*weakest) {
				weakest = &d
			}
			return nil
		})
		if err != nil {
			return Durability{}, err
		}
		if weakest == nil {
			return Durability{}, nil
		}
		return *weakest, nil
	}
	return s.durabilityOf(ctx, s.rdb)
}

func (s *Store) durabilityOf(ctx context.Context, c redis.Cmdable) (Durability, error) {
	cfg, err := c.ConfigGet(ctx, "append*").Result()
	if err != nil {
		if unavailable(err) {
			return Durability{}, s.fail("config get", "", err)
		}
		// A reply refusing the command: CONFIG renamed away, disabled or
		// not permitted to this user.
		s.log.Info("redis will not tell its persistence settings", "err", err)
		return Durability{}, nil
	}
	aof, okA := cfg["appendonly"]
	fsync, okF := cfg["appendfsync"]
	if !okA || !okF {
		return Durability{}, nil
	}
	return Durability{AOF: strings.EqualFold(aof, "yes"), Fsync: strings.ToLower(fsync), Known: true}, nil
}
