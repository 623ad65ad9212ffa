package redisstore

import (
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/state"
)

// The store's epoch marker. A Redis can lose what it acknowledged without
// failing a single call: FLUSHALL or FLUSHDB, a restart without
// persistence, a restore of an older snapshot, a failover to a replica
// that lacked the last writes, a row evicted or deleted. A cancelled run
// whose row is gone is, to every later guard, a run never seen — and
// auto-admit would create it ACTIVE at version 1. So the store keeps one
// marker (markerKey, a hash): an epoch, made when the marker is created and
// renewed when an operator acknowledges a reset, and a count of the checks
// made of it. Every instance reads it in the background (CheckInterval)
// and remembers the epoch and count it saw:
//
//   - no marker, and this instance never saw one: a new store; it creates
//     the marker, ok.
//   - no marker, but this instance saw epoch E: the store was emptied; it
//     writes a marker that says reset.
//   - a marker of another epoch, neither reset nor an acknowledgement newer
//     than E: the store was emptied and a fresh instance made a new marker
//     since, or an older copy was restored; it marks that marker reset.
//   - the epoch it saw, but a count no greater than the one it saw: the
//     marker went back (an older snapshot, a failover that lost writes); it
//     marks it reset.
//
// While the marker says reset, every instance refuses every admission
// (Admit, every Guard) with state.ErrInconsistent and fails its readiness
// ping; cancels, reads, outcomes, ticks and resolves go on, since they only
// stop or record. An operator re-cancels the runs that were lost and
// acknowledges the reset (Acknowledge): the marker takes a new epoch, marked
// acknowledged, which every instance adopts at its next check.
//
// Besides, a guard that finds no row for a run this process has seen with
// one (seenRuns) does not create it: rows are never deleted (Prune keeps
// them), so the row was lost, and the store is marked reset at once.
//
// The marker is a key of its own, read and written here, never by a run's
// programs: on Redis Cluster a program may touch only its run's slot.

//go:embed lua/marker.lua
var markerLua string

var markerScript = redis.NewScript(markerLua)

// markerKey is the store's marker, on a slot of its own (the tag {marker}).
const markerKey = keyPrefix + "{marker}"

// DefaultCheckInterval is how often an instance reads the marker when
// Options.CheckInterval is zero: a flush is noticed within it.
const DefaultCheckInterval = 2 * time.Second

// MarkerState is what the marker says of the store.
type MarkerState string

const (
	// MarkerOK: the store holds what it acknowledged, as far as the marker
	// can tell.
	MarkerOK MarkerState = "ok"
	// MarkerReset: the store lost writes it acknowledged; nothing is
	// admitted until an operator acknowledges it.
	MarkerReset MarkerState = "reset"
)

// ErrNotReset is an acknowledgement of a store that is not marked reset.
var ErrNotReset = errors.New("the store is not marked reset")

// Marker is the store's marker as Redis holds it.
type Marker struct {
	State MarkerState `json:"state"`
	// Epoch names the marker's life: made at its creation (a time in µs),
	// and made anew, greater, by each acknowledgement.
	Epoch int64 `json:"epoch"`
	// Checks counts the reads instances made of this marker; it only grows.
	Checks int64 `json:"checks"`
	// Acked says the epoch was made by an acknowledgement.
	Acked bool `json:"acknowledged"`
	// By, Reason and At are the marker's last change: its creation, a
	// reset, an acknowledgement.
	By     string    `json:"by"`
	Reason string    `json:"reason"`
	At     time.Time `json:"at"`
	// ResetBy, ResetReason and ResetAt are the last reset, kept once it is
	// acknowledged.
	ResetBy     string    `json:"reset_by,omitempty"`
	ResetReason string    `json:"reset_reason,omitempty"`
	ResetAt     time.Time `json:"reset_at,omitzero"`
}

// explain says what a reset marker means, and the way out.
func (m *Marker) explain() string {
	return fmt.Sprintf("the store was marked reset at %s by %s: %s. A cancel it held may be lost with it, so no run is admitted "+
		"and no effect guarded until an operator has re-cancelled the runs that were lost and acknowledged the reset "+
		"(stopgate store acknowledge-reset --reason R, or POST /v1/store/acknowledge-reset)",
		m.ResetAt.UTC().Format(time.RFC3339), m.ResetBy, m.ResetReason)
}

// markerWatch is this instance's memory of the marker.
type markerWatch struct {
	interval time.Duration
	// file keeps seen and checks across restarts (Options.MarkerFile).
	file string
	// by names this instance in the marker.
	by string

	// mu makes checks one at a time; it guards seen, checks, pending and
	// failing.
	mu sync.Mutex
	// seen is the epoch last seen (0: none), checks its count then.
	seen, checks int64
	// pending is a loss found by a step (a row gone) that could not be
	// written into the marker yet.
	pending string
	// failing: the last background check failed (logged once).
	failing bool

	// reset is the marker while it says reset, nil otherwise: read by
	// every admission.
	reset atomic.Pointer[Marker]
	// current is seen, for markerHolds, which reads it without mu.
	current atomic.Int64

	stopOnce sync.Once
	stop     chan struct{}
	done     chan struct{}
}

// refuseWhileReset is the marker's word on an admission (Admit, Guard) and
// on readiness: ErrInconsistent while the store is marked reset.
func (s *Store) refuseWhileReset(op, runID string) error {
	if m := s.mark.reset.Load(); m != nil {
		return s.inconsistent(op, runID, m)
	}
	return nil
}

func (s *Store) inconsistent(op, runID string, m *Marker) error {
	what := "redis " + op
	if runID != "" {
		what += " run " + runID
	}
	return fmt.Errorf("%s on %s: %w: %s", what, s.addr, state.ErrInconsistent, m.explain())
}

// rowGone answers a step that found no row for a run this process had seen
// with one: the store lost it. It marks the store reset and refuses.
func (s *Store) rowGone(ctx context.Context, op, runID string) error {
	reason := fmt.Sprintf("the row of run %s, which this instance had seen, is gone: evicted (maxmemory-policy), deleted, or lost with the rest of the data", runID)
	s.mark.mu.Lock()
	err := s.markReset(ctx, reason)
	s.mark.mu.Unlock()
	if err != nil {
		s.log.Warn("the store lost a row; marking it reset failed, this instance refuses admissions meanwhile", "run_id", runID, "err", err)
	}
	m := s.mark.reset.Load()
	if m == nil {
		m = &Marker{State: MarkerReset, ResetBy: s.mark.by, ResetReason: reason, ResetAt: time.Now()}
	}
	return s.inconsistent(op, runID, m)
}

// beforeCreate is Admit's check before a step that may create the row: a
// run this process has seen with a row must still have it (if it is gone,
// the store lost it); for any other, the marker must still be the one
// this instance saw. Reads before the admission's own step: they detect,
// the admission's program decides.
func (s *Store) beforeCreate(ctx context.Context, op, runID string) error {
	if !s.seen.has(runID) {
		return s.markerHolds(ctx, op, runID)
	}
	n, err := s.rdb.Exists(ctx, keysOf(runID).row).Result()
	if err != nil {
		return s.fail(op, runID, err)
	}
	if n == 0 {
		return s.rowGone(ctx, op, runID)
	}
	return nil
}

// markerHolds is read before a step that may create a row (an admission,
// an auto-admitting guard of a run this process has not seen): the marker
// must still be the one this instance saw, so that no row is created in a
// store emptied since the last check. Otherwise the marker is checked at
// once, and the step refused if the store is reset. The read and the step
// are two round trips: a flush between them (well under a millisecond) is
// seen by the next check.
func (s *Store) markerHolds(ctx context.Context, op, runID string) error {
	vals, err := s.rdb.HMGet(ctx, markerKey, "epoch", "state").Result()
	if err != nil {
		return s.fail(op+" (marker)", runID, err)
	}
	epoch, _ := vals[0].(string)
	st, _ := vals[1].(string)
	if epoch == strconv.FormatInt(s.mark.current.Load(), 10) && st == string(MarkerOK) {
		return nil
	}
	if err := s.CheckMarker(ctx); err != nil {
		return err
	}
	return s.refuseWhileReset(op, runID)
}

// openMarker reads what this instance remembers of the marker, makes the
// first check, and starts the background ones.
func (s *Store) openMarker(ctx context.Context, opts Options) error {
	w := &s.mark
	w.interval = opts.CheckInterval
	if w.interval == 0 {
		w.interval = DefaultCheckInterval
	}
	w.file = opts.MarkerFile
	w.by = instanceName()
	w.stop, w.done = make(chan struct{}), make(chan struct{})
	s.loadMemo()
	if err := s.CheckMarker(ctx); err != nil {
		close(w.done)
		return fmt.Errorf("the store's marker: %w", err)
	}
	go s.watchMarker()
	return nil
}

// watchMarker checks the marker every interval until the store is closed.
func (s *Store) watchMarker() {
	w := &s.mark
	defer close(w.done)
	t := time.NewTicker(w.interval)
	defer t.Stop()
	for {
		select {
		case <-w.stop:
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), s.opTimeout)
		err := s.CheckMarker(ctx)
		cancel()
		w.mu.Lock()
		switch {
		case err != nil && !w.failing:
			s.log.Warn("the store's marker could not be checked; retrying every "+w.interval.String(), "err", err)
		case err == nil && w.failing:
			s.log.Info("the store's marker is checked again")
		}
		w.failing = err != nil
		w.mu.Unlock()
	}
}

// stopMarker ends the background checks and keeps what this instance saw.
func (s *Store) stopMarker() {
	w := &s.mark
	if w.stop == nil {
		return
	}
	w.stopOnce.Do(func() { close(w.stop) })
	<-w.done
	w.mu.Lock()
	s.saveMemo()
	w.mu.Unlock()
}

// CheckMarker reads the store's marker and judges it against what this
// instance saw (see the top of this file): it creates the marker of a new
// store, marks the store reset when it finds it emptied or gone back, and
// adopts an acknowledgement. It returns an error only when it could not
// read or write the marker; a reset it finds is a state, not an error.
func (s *Store) CheckMarker(ctx context.Context) error {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	w := &s.mark
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.pending != "" {
		if err := s.markReset(ctx, w.pending); err != nil {
			return err
		}
		w.pending = ""
		return nil
	}
	for range 4 {
		m, found, err := s.readMarker(ctx)
		if err != nil {
			return err
		}
		done, err := s.judge(ctx, m, found)
		if err != nil || done {
			return err
		}
	}
	return fmt.Errorf("redis marker on %s: it changed under four reads in a row", s.addr)
}

// judge acts on the marker read (w.mu held); done false means the marker
// changed under the step and must be read again.
func (s *Store) judge(ctx context.Context, m Marker, found bool) (bool, error) {
	w := &s.mark
	now := time.Now()
	switch {
	case !found && w.seen == 0:
		return s.writeMarker(ctx, "create", "", Marker{State: MarkerOK, Epoch: now.UnixMicro(), By: w.by, At: now,
			Reason: "created on a store that had none"})
	case !found:
		why := fmt.Sprintf("the store's marker (epoch %d, which this instance saw) is gone: Redis was emptied "+
			"(FLUSHALL, FLUSHDB, a restart without persistence) and lost every row it held", w.seen)
		return s.writeMarker(ctx, "create", "", Marker{State: MarkerReset, Epoch: now.UnixMicro(), By: w.by, At: now,
			Reason: why, ResetBy: w.by, ResetReason: why, ResetAt: now})
	case m.State == MarkerReset:
		s.adopt(m)
		return true, nil
	case m.Epoch == w.seen:
		checks, ok, err := s.bump(ctx, m.Epoch)
		if err != nil || !ok {
			return false, err
		}
		if w.checks > 0 && checks <= w.checks {
			return s.resetMarker(ctx, m, fmt.Sprintf("the store's marker went back (check %d of epoch %d after this instance saw check %d): "+
				"Redis was restored from an older copy, or failed over to a replica that lacked the latest writes", checks, m.Epoch, w.checks))
		}
		m.Checks = checks
		s.adopt(m)
		return true, nil
	case w.seen == 0, m.Acked && m.Epoch > w.seen:
		// A first sight, or an acknowledgement made since this instance
		// looked: the runs it saw are history.
		checks, ok, err := s.bump(ctx, m.Epoch)
		if err != nil || !ok {
			return false, err
		}
		if w.seen != 0 {
			s.log.Warn("the store's reset was acknowledged: admitting runs again", "epoch", m.Epoch, "by", m.By, "reason", m.Reason)
		}
		m.Checks = checks
		s.seen.c.Purge()
		s.adopt(m)
		return true, nil
	default:
		return s.resetMarker(ctx, m, fmt.Sprintf("the store's marker is epoch %d, not the epoch %d this instance saw nor an acknowledgement since: "+
			"Redis was emptied and an instance made a new marker on it, or an older copy was restored", m.Epoch, w.seen))
	}
}

// markReset marks the store reset for a loss a step found (w.mu held),
// whatever its marker says now; if Redis cannot be told, this instance
// refuses admissions until a check can.
func (s *Store) markReset(ctx context.Context, why string) error {
	w := &s.mark
	for range 4 {
		m, found, err := s.readMarker(ctx)
		if err == nil {
			var done bool
			now := time.Now()
			switch {
			case !found:
				done, err = s.writeMarker(ctx, "create", "", Marker{State: MarkerReset, Epoch: now.UnixMicro(), By: w.by, At: now,
					Reason: why, ResetBy: w.by, ResetReason: why, ResetAt: now})
			case m.State == MarkerReset:
				s.adopt(m)
				done = true
			default:
				done, err = s.resetMarker(ctx, m, why)
			}
			if done && err == nil {
				w.pending = ""
				return nil
			}
		}
		if err != nil {
			w.pending = why
			if s.mark.reset.Load() == nil {
				now := time.Now()
				s.mark.reset.Store(&Marker{State: MarkerReset, By: w.by, Reason: why, At: now, ResetBy: w.by, ResetReason: why, ResetAt: now})
			}
			return err
		}
	}
	return fmt.Errorf("redis marker on %s: it changed under four reads in a row", s.addr)
}

// resetMarker marks m, as read, reset.
func (s *Store) resetMarker(ctx context.Context, m Marker, why string) (bool, error) {
	now := time.Now()
	m.State, m.By, m.Reason, m.At = MarkerReset, s.mark.by, why, now
	m.ResetBy, m.ResetReason, m.ResetAt = s.mark.by, why, now
	return s.writeMarker(ctx, "reset", strconv.FormatInt(m.Epoch, 10), m)
}

// Acknowledge records an operator's acknowledgement of a reset: the
// marker takes a new, greater epoch marked acknowledged, and admissions
// resume (here at once, on the other instances at their next check). It
// is ErrNotReset when the marker is not reset. Call it once the runs the
// store lost have been cancelled again.
func (s *Store) Acknowledge(ctx context.Context, actor, reason string) (Marker, error) {
	if actor == "" || reason == "" {
		return Marker{}, fmt.Errorf("%w: an acknowledgement of a reset needs an actor and a reason", state.ErrInvalid)
	}
	if len(actor) > state.MaxTextLen || len(reason) > state.MaxTextLen {
		return Marker{}, fmt.Errorf("%w: the actor and the reason are at most %d bytes", state.ErrInvalid, state.MaxTextLen)
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	w := &s.mark
	w.mu.Lock()
	defer w.mu.Unlock()
	for range 4 {
		m, found, err := s.readMarker(ctx)
		if err != nil {
			return Marker{}, err
		}
		if !found {
			return Marker{}, fmt.Errorf("%w: the store has no marker (it was emptied again?); its next check marks it reset", ErrNotReset)
		}
		if m.State != MarkerReset {
			return Marker{}, fmt.Errorf("%w: its marker is %s at epoch %d (last change by %s: %s)", ErrNotReset, m.State, m.Epoch, m.By, m.Reason)
		}
		now := time.Now()
		was := m.Epoch
		m.State, m.Acked, m.By, m.Reason, m.At = MarkerOK, true, actor, reason, now
		m.Epoch = max(now.UnixMicro(), was+1)
		done, err := s.writeMarker(ctx, "ack", strconv.FormatInt(was, 10), m)
		if err != nil {
			return Marker{}, err
		}
		if done {
			s.log.Warn("the store's reset is acknowledged: admitting runs again", "actor", actor, "reason", reason,
				"reset_by", m.ResetBy, "reset_reason", m.ResetReason, "epoch", m.Epoch)
			s.seen.c.Purge()
			return m, nil
		}
	}
	return Marker{}, fmt.Errorf("redis marker on %s: it changed under four reads in a row", s.addr)
}

// Marker reads the store's marker as Redis holds it now.
func (s *Store) Marker(ctx context.Context) (Marker, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	m, found, err := s.readMarker(ctx)
	if err != nil {
		return Marker{}, err
	}
	if !found {
		return Marker{}, fmt.Errorf("%w: redis marker on %s", state.ErrNotFound, s.addr)
	}
	return m, nil
}

// writeMarker runs one step of marker.lua with m's fields; done false:
// the marker was not as expected (another instance changed it first).
// Once written, this instance adopts m.
func (s *Store) writeMarker(ctx context.Context, op, expect string, m Marker) (bool, error) {
	ms := func(t time.Time) string {
		if t.IsZero() {
			return ""
		}
		return strconv.FormatInt(t.UnixMilli(), 10)
	}
	args := []any{op, expect}
	if op != "bump" {
		args = append(args, "state", string(m.State), "epoch", strconv.FormatInt(m.Epoch, 10), "acked", flag(m.Acked),
			"by", m.By, "reason", m.Reason, "at", ms(m.At),
			"reset_by", m.ResetBy, "reset_reason", m.ResetReason, "reset_at", ms(m.ResetAt))
	}
	checks, err := markerScript.Run(ctx, s.scripter, []string{markerKey}, args...).Int64()
	if errors.Is(err, redis.Nil) {
		return false, nil
	}
	if err != nil {
		return false, s.fail("marker "+op, "", err)
	}
	m.Checks = checks
	s.adopt(m)
	return true, nil
}

// bump counts one more check of epoch.
func (s *Store) bump(ctx context.Context, epoch int64) (int64, bool, error) {
	checks, err := markerScript.Run(ctx, s.scripter, []string{markerKey}, "bump", strconv.FormatInt(epoch, 10)).Int64()
	if errors.Is(err, redis.Nil) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, s.fail("marker check", "", err)
	}
	return checks, true, nil
}

// adopt makes m what this instance saw (w.mu held).
func (s *Store) adopt(m Marker) {
	w := &s.mark
	if m.Epoch == 0 {
		// A marker stopgate did not write: what this instance saw before
		// it still stands.
		m.Epoch, m.Checks = w.seen, w.checks
	}
	epochChanged := m.Epoch != w.seen
	w.seen, w.checks = m.Epoch, m.Checks
	w.current.Store(m.Epoch)
	if m.State == MarkerReset {
		if old := w.reset.Swap(&m); old == nil || old.ResetReason != m.ResetReason {
			s.log.Error("THE STORE LOST WRITES IT HAD ACKNOWLEDGED: every admission is refused until an operator acknowledges the reset",
				"reason", m.ResetReason, "by", m.ResetBy, "at", m.ResetAt, "epoch", m.Epoch,
				"way_out", "re-cancel the runs that were lost, then: stopgate store acknowledge-reset --reason R")
		}
	} else {
		w.reset.Store(nil)
	}
	if epochChanged {
		s.saveMemo()
	}
}

// readMarker reads the marker; found false when there is none.
func (s *Store) readMarker(ctx context.Context) (Marker, bool, error) {
	h, err := s.rdb.HGetAll(ctx, markerKey).Result()
	if err != nil {
		return Marker{}, false, s.fail("marker read", "", err)
	}
	if len(h) == 0 {
		return Marker{}, false, nil
	}
	num := func(k string) int64 { n, _ := strconv.ParseInt(h[k], 10, 64); return n }
	at := func(k string) time.Time {
		if h[k] == "" {
			return time.Time{}
		}
		return time.UnixMilli(num(k)).UTC()
	}
	m := Marker{State: MarkerState(h["state"]), Epoch: num("epoch"), Checks: num("seq"), Acked: h["acked"] == "1",
		By: h["by"], Reason: h["reason"], At: at("at"),
		ResetBy: h["reset_by"], ResetReason: h["reset_reason"], ResetAt: at("reset_at")}
	if m.Epoch == 0 || (m.State != MarkerOK && m.State != MarkerReset) {
		// Not a marker this code wrote (written by hand, or half of
		// one): take it for a reset rather than guess.
		m.State = MarkerReset
		if m.ResetReason == "" {
			m.ResetReason = fmt.Sprintf("the store's marker %s is not one stopgate wrote (state %q, epoch %q)", markerKey, h["state"], h["epoch"])
		}
	}
	return m, true, nil
}

// memo is what an instance keeps of the marker in its data directory, so
// that a restart after the store was emptied still knows it saw a marker.
type memo struct {
	Store  string `json:"store"`
	Epoch  int64  `json:"epoch"`
	Checks int64  `json:"checks"`
}

// loadMemo reads the memo of this store, if there is one.
func (s *Store) loadMemo() {
	w := &s.mark
	if w.file == "" {
		return
	}
	b, err := os.ReadFile(w.file)
	if errors.Is(err, os.ErrNotExist) {
		return
	}
	var m memo
	if err == nil {
		err = json.Unmarshal(b, &m)
	}
	if err != nil {
		s.log.Warn("the memo of the store's marker cannot be read: this start cannot tell an emptied store from a new one", "file", w.file, "err", err)
		return
	}
	if m.Store != s.addr {
		s.log.Info("the memo of the store's marker is of another store; ignored", "file", w.file, "memo_store", m.Store)
		return
	}
	w.seen, w.checks = m.Epoch, m.Checks
}

// saveMemo writes the memo (w.mu held), whole or not at all.
func (s *Store) saveMemo() {
	w := &s.mark
	if w.file == "" || w.seen == 0 {
		return
	}
	b, _ := json.Marshal(memo{Store: s.addr, Epoch: w.seen, Checks: w.checks})
	err := os.MkdirAll(filepath.Dir(w.file), 0o700)
	if err == nil {
		tmp := w.file + ".tmp"
		if err = os.WriteFile(tmp, append(b, '\n'), 0o600); err == nil {
			err = os.Rename(tmp, w.file)
		}
	}
	if err != nil {
		s.log.Warn("the memo of the store's marker cannot be written: a restart will not tell an emptied store from a new one", "file", w.file, "err", err)
	}
}

// instanceName names this process in the marker.
func instanceName() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown-host"
	}
	return fmt.Sprintf("stopgate@%s/%d", host, os.Getpid())
}
