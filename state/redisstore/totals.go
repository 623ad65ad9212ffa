package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/machine"
)

// The totals (state.Totals) are counters of a hash that the apply program
// changes in the same call as the steps they count (its last key): on one
// Redis a single hash; on a Cluster, where a call touches one slot, a hash
// in each slot (its tag chosen to hash there), summed when read. A row
// counted in them has its field g set; a row written before totals were
// kept (by an older stopgate) is counted once, either by the first step
// that changes a total of its run (which reads it first) or by the walk
// over every run that the first Totals after such an upgrade starts.

// totalsKey is the totals hash of a single Redis.
const totalsKey = keyPrefix + "totals"

// talliedKey marks every run stored counted in the totals (the walk done).
const talliedKey = keyPrefix + "{index}:tallied"

// clusterSlots is the number of hash slots of a Redis Cluster.
const clusterSlots = 16384

// slotTotalsKey is the totals hash of the slot a run's keys hash to.
func (s *Store) totalsKeyOf(runID string) string {
	if !s.batches.perRun {
		return totalsKey
	}
	return slotTotalsKey(slotTags()[slot(runID)])
}

func slotTotalsKey(tag string) string { return keyPrefix + "{" + tag + "}:totals" }

// slot is the Cluster hash slot of a key whose hash tag is tag
// (CRC16-XMODEM, as Redis computes it).
func slot(tag string) int {
	var crc uint16
	for i := 0; i < len(tag); i++ {
		crc ^= uint16(tag[i]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return int(crc) % clusterSlots
}

// slotTags names, for every slot, a hash tag that hashes to it: ~ and a
// number, which no run id can be (state.ValidateRunID).
var slotTags = sync.OnceValue(func() []string {
	tags := make([]string, clusterSlots)
	for n, left := 0, clusterSlots; left > 0; n++ {
		t := "~" + strconv.Itoa(n)
		if i := slot(t); tags[i] == "" {
			tags[i] = t
			left--
		}
	}
	return tags
})

// errTallying is Totals while the runs stored before totals were kept are
// being counted.
var errTallying = errors.New("the runs stored before this version kept totals are being counted")

// Totals reads the totals: one hash on one Redis, every slot's on a
// Cluster. Until every run stored is counted (talliedKey) it starts the
// walk that counts them, and answers ErrUnavailable.
func (s *Store) Totals(ctx context.Context) (state.Totals, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	done, err := s.rdb.Exists(ctx, talliedKey).Result()
	if err != nil {
		return state.Totals{}, s.fail("totals", "", err)
	}
	if done == 0 {
		s.tally.start(s)
		return state.Totals{}, fmt.Errorf("redis totals on %s: %w: %w (%s)", s.addr, state.ErrUnavailable, errTallying, s.tally.progress())
	}
	counters := map[string]int64{}
	add := func(m map[string]string) error {
		for k, v := range m {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return fmt.Errorf("redis totals on %s: %s is %q, not a count", s.addr, k, v)
			}
			counters[k] += n
		}
		return nil
	}
	if !s.batches.perRun {
		m, err := s.rdb.HGetAll(ctx, totalsKey).Result()
		if err != nil {
			return state.Totals{}, s.fail("totals", "", err)
		}
		if err := add(m); err != nil {
			return state.Totals{}, err
		}
		return machine.Totals(counters), nil
	}
	cmds, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, tag := range slotTags() {
			p.HGetAll(ctx, slotTotalsKey(tag))
		}
		return nil
	})
	if err != nil {
		return state.Totals{}, s.fail("totals", "", err)
	}
	for _, c := range cmds {
		if err := add(c.(*redis.MapStringStringCmd).Val()); err != nil {
			return state.Totals{}, err
		}
	}
	return machine.Totals(counters), nil
}

// openTotals marks a store without runs tallied (nothing to count), and
// starts counting the runs of one written before totals were kept.
func (s *Store) openTotals(ctx context.Context) error {
	done, err := s.rdb.Exists(ctx, talliedKey).Result()
	if err != nil || done == 1 {
		return err
	}
	runs, err := s.rdb.ZCard(ctx, allRunsKey).Result()
	if err != nil {
		return err
	}
	if runs == 0 {
		return s.rdb.SetNX(ctx, talliedKey, "1", 0).Err()
	}
	s.log.Info("counting the stored runs into the totals, once", "runs", runs)
	s.tally.start(s)
	return nil
}

// tallyWalk counts, once, the runs stored before totals were kept: a page
// of ids at a time from the index of every run (ZSCAN, which returns every
// id there for the whole walk at least once), each run read and, when not
// yet counted, counted in a step of its own that checks it still is not.
type tallyWalk struct {
	mu      sync.Mutex
	running bool
	counted int64
	seen    int64
}

func (w *tallyWalk) start(s *Store) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.running {
		return
	}
	w.running, w.counted, w.seen = true, 0, 0
	go func() {
		err := s.walkTally()
		w.mu.Lock()
		w.running = false
		w.mu.Unlock()
		if err != nil {
			s.log.Warn("counting the stored runs into the totals stopped; the next read of the totals starts again", "err", err)
		}
	}()
}

func (w *tallyWalk) progress() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return fmt.Sprintf("%d runs read, %d counted so far", w.seen, w.counted)
}

// walkPage is how many run ids the walk reads at a time.
const walkPage = 256

func (s *Store) walkTally() error {
	ctx := s.life
	var cursor uint64
	for {
		call, cancel := context.WithTimeout(ctx, s.opTimeout)
		page, next, err := s.rdb.ZScan(call, allRunsKey, cursor, "", walkPage).Result()
		cancel()
		if err != nil {
			return s.fail("totals (walk)", "", err)
		}
		var steps []*step
		for i := 0; i < len(page); i += 2 {
			steps = append(steps, &step{run: page[i], op: "tally", count: true})
		}
		if len(steps) > 0 {
			call, cancel := context.WithTimeout(ctx, 4*s.opTimeout)
			s.runSteps(call, steps)
			cancel()
			for _, st := range steps {
				if st.err != nil {
					return st.err
				}
			}
			s.tally.mu.Lock()
			s.tally.seen += int64(len(steps))
			for _, st := range steps {
				if st.ops != nil {
					s.tally.counted++
				}
			}
			s.tally.mu.Unlock()
		}
		if cursor = next; cursor == 0 {
			break
		}
	}
	call, cancel := context.WithTimeout(ctx, s.opTimeout)
	defer cancel()
	if err := s.rdb.Set(call, talliedKey, "1", 0).Err(); err != nil {
		return s.fail("totals (walk)", "", err)
	}
	s.log.Info("every stored run is counted in the totals", "runs", s.tally.seen, "counted", s.tally.counted)
	return nil
}
