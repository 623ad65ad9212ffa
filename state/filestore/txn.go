package filestore

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"maps"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/stopgate/stopgate/state"
)

// Bucket and key names; see the package comment for the layout.
const (
	bucketMeta    = "meta"
	bucketRuns    = "runs"
	bucketStatus  = "status"
	bucketRun     = "run"
	bucketIntents = "intents"
	bucketOrder   = "order"
	bucketPending = "pending"
	bucketSeq     = "seq"
	bucketEvents  = "events"
	bucketFinal   = "final"
	bucketTotals  = "totals"
	keyFormat     = "format"
	keyPing       = "ping"
)

// intentRecord is an intent as stored: Seq is its place in the creation
// order, the key of its "order" and "pending" entries.
type intentRecord struct {
	state.Intent
	Seq uint64 `json:"seq"`
}

// txn is one write transaction: the shared transition rules operate on it,
// so each Store method is one call to Store.update.
type txn struct {
	tx *bolt.Tx
	// now is the step's time: the clock, or the last commit's when the
	// clock went back; clock is the clock's own reading.
	now, clock time.Time
	// wrote is set by every write, so that a transaction that wrote
	// nothing is rolled back instead of paying for a commit.
	wrote bool
	// rows is shared by the steps of one commit.
	rows *rowCache
}

// rowCache holds the run rows the steps of one commit have read or saved,
// so that a group of steps on one run decodes its row once and writes it
// once (flush, at the end of the commit), not once per step. Each step
// works on its own copy and hands it back only through save: a step that
// changes a row and then fails leaves the cache as it found it. A step
// that failed after saving rolls the whole transaction back (see
// Store.transaction), cache and all.
type rowCache struct {
	runs map[string]*cachedRun
}

type cachedRun struct {
	rec    rowRecord
	b      *bolt.Bucket
	stored state.Status // as in runTx
	dirty  bool         // saved since read: flush must write it
	// ordered means the run's creation ordinal has been checked against a
	// format 1 order bucket in this commit (putIntent), so that the
	// lookup, a miss for every run of format 2, is made once per commit.
	ordered bool
	// cursors are the commit's cursors for reads by key (get), one per
	// bucket they read.
	cursors []*bolt.Cursor
}

func newRowCache() *rowCache { return &rowCache{runs: make(map[string]*cachedRun, 4)} }

// flush writes every row saved in this commit.
func (c *rowCache) flush(tx *bolt.Tx) error {
	var runs *bolt.Bucket
	for id, cr := range c.runs {
		if !cr.dirty {
			continue
		}
		if runs == nil {
			runs = tx.Bucket([]byte(bucketRuns))
		}
		if err := runs.Put([]byte(id), encodeRow(cr.rec)); err != nil {
			return storeErr("writing run %s: %w", id, err)
		}
		cr.dirty = false
	}
	return nil
}

// rowRecord is a run row as stored. Retention is the ms time of the run's
// entry in the retention index (bucket final), 0 when it has none: a final
// run gets one when it becomes final, loses it when pruned, and gets one
// again when something is recorded against it after a prune.
type rowRecord struct {
	state.Run
	Retention int64 `json:"retention,omitempty"`
}

// runTx is one run's row and buckets inside a transaction.
type runTx struct {
	t         *txn
	row       state.Run
	retention int64
	b         *bolt.Bucket
	stored    state.Status // the status the index has for this run ("" if new)
	// dirty means the row (fields or counts) must be saved. UpdatedAt is
	// the time of the row's last transition, as in the Redis store: count
	// changes alone do not move it (intents carry their own times).
	dirty bool
	// c is the run's entry in the commit's row cache (nil for a run
	// created by this step until it is saved); shared means row.Intents is
	// the cache's map, which count copies before changing: the counts
	// change through count only.
	c      *cachedRun
	shared bool
}

func storeErr(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{state.ErrUnavailable}, args...)...)
}

func (t *txn) put(b *bolt.Bucket, k, v []byte) error {
	t.wrote = true
	if err := b.Put(k, v); err != nil {
		return storeErr("writing %q: %w", k, err)
	}
	return nil
}

func (t *txn) del(b *bolt.Bucket, k []byte) error {
	t.wrote = true
	if err := b.Delete(k); err != nil {
		return storeErr("deleting %q: %w", k, err)
	}
	return nil
}

func (t *txn) nextSeq(b *bolt.Bucket) (uint64, error) {
	t.wrote = true
	n, err := b.NextSequence()
	if err != nil {
		return 0, storeErr("next sequence: %w", err)
	}
	return n, nil
}

func u64(n uint64) []byte { return binary.BigEndian.AppendUint64(nil, n) }

func statusKey(status state.Status, id string) []byte {
	return []byte(string(status) + "/" + id)
}

// loadRun reads a run row and its buckets; found is false for an unseen run.
func loadRun(tx *bolt.Tx, id string) (row state.Run, b *bolt.Bucket, found bool, err error) {
	rec, b, found, err := loadRecord(tx, id)
	return rec.Run, b, found, err
}

func loadRecord(tx *bolt.Tx, id string) (rec rowRecord, b *bolt.Bucket, found bool, err error) {
	raw := tx.Bucket([]byte(bucketRuns)).Get([]byte(id))
	if raw == nil {
		return rowRecord{}, nil, false, nil
	}
	if rec, err = decodeRow(id, raw); err != nil {
		return rowRecord{}, nil, false, storeErr("run %s: decoding row: %w", id, err)
	}
	b = tx.Bucket([]byte(bucketRun)).Bucket([]byte(id))
	if b == nil {
		return rowRecord{}, nil, false, storeErr("run %s: row without its buckets", id)
	}
	if rec.Intents == nil {
		rec.Intents = map[state.IntentState]int{}
	}
	return rec, b, true, nil
}

func (t *txn) run(id string) (*runTx, bool, error) {
	cr, ok := t.rows.runs[id]
	if !ok {
		rec, b, found, err := loadRecord(t.tx, id)
		if err != nil || !found {
			return nil, found, err
		}
		cr = &cachedRun{rec: rec, b: b, stored: rec.Status}
		t.rows.runs[id] = cr
	}
	// The counts are shared with the cache until the step changes them
	// (count), so that a step copies them at most once.
	return &runTx{t: t, row: cr.rec.Run, retention: cr.rec.Retention, b: cr.b, stored: cr.stored, c: cr, shared: true}, true, nil
}

// createRun writes a new row and its buckets; the caller sets the rest of
// the row, appends the creating event and saves.
func (t *txn) createRun(id string, status state.Status, version int64) (*runTx, error) {
	t.wrote = true
	b, err := t.tx.Bucket([]byte(bucketRun)).CreateBucket([]byte(id))
	if err != nil {
		return nil, storeErr("run %s: creating buckets: %w", id, err)
	}
	for _, name := range []string{bucketIntents, bucketPending, bucketSeq, bucketEvents} {
		if _, err := b.CreateBucket([]byte(name)); err != nil {
			return nil, storeErr("run %s: creating bucket %s: %w", id, name, err)
		}
	}
	r := &runTx{t: t, b: b, dirty: true, row: state.Run{
		ID:            id,
		Status:        status,
		CancelVersion: version,
		CreatedAt:     t.now,
		UpdatedAt:     t.now,
		Intents:       map[state.IntentState]int{},
	}}
	return r, nil
}

// retentionKey is a run's entry in the retention index: time, then id, so
// that the index reads oldest first.
func retentionKey(ms int64, id string) []byte {
	return append(u64(uint64(ms)), id...)
}

// keepForRetention gives a final run that has no retention entry (it was
// pruned) a new one, dated now, before something more is recorded against
// it: what an agent still tries after a prune leaves the store too.
func (r *runTx) keepForRetention() error {
	if !r.row.Final() || r.retention != 0 {
		return nil
	}
	r.retention = r.t.now.UnixMilli()
	r.dirty = true
	return r.t.put(r.t.tx.Bucket([]byte(bucketFinal)), retentionKey(r.retention, r.row.ID), nil)
}

// save writes the row if it changed and keeps the status and retention
// indexes in step.
func (r *runTx) save() error {
	if !r.dirty {
		return nil
	}
	if r.stored != r.row.Status && r.row.Final() {
		if err := r.keepForRetention(); err != nil {
			return err
		}
	}
	// The row itself is written once for the whole commit (rowCache.flush).
	// The cache takes the step's counts as they are: the step copies them
	// again before changing them (count).
	r.t.wrote = true
	if r.c == nil {
		r.c = &cachedRun{}
		r.t.rows.runs[r.row.ID] = r.c
	}
	r.c.rec = rowRecord{Run: r.row, Retention: r.retention}
	r.c.b, r.c.stored, r.c.dirty = r.b, r.row.Status, true
	r.shared = true
	if r.stored != r.row.Status {
		idx := r.t.tx.Bucket([]byte(bucketStatus))
		if r.stored != "" {
			if err := r.t.del(idx, statusKey(r.stored, r.row.ID)); err != nil {
				return err
			}
		}
		if err := r.t.put(idx, statusKey(r.row.Status, r.row.ID), nil); err != nil {
			return err
		}
		r.stored = r.row.Status
	}
	r.dirty = false
	return nil
}

// event appends one line to the run's audit log, as the rules made it
// (its time and the row's version set).
func (r *runTx) event(e state.Event) error {
	raw := encodeEvent(e)
	b := r.b.Bucket([]byte(bucketEvents))
	// Events are only ever appended: a full page need not leave room for
	// keys that will never come between its own.
	b.FillPercent = 1
	n, err := r.t.nextSeq(b)
	if err != nil {
		return err
	}
	return r.t.put(b, u64(n), raw)
}

// get is b.Get(key) through a cursor the steps of this commit share: a
// Get makes a cursor, whose path from the root it allocates anew, for
// every read. A cursor's Seek walks from the root again, so it sees every
// write made since its last Seek.
func (r *runTx) get(b *bolt.Bucket, key []byte) []byte {
	if r.c == nil {
		return b.Get(key)
	}
	var c *bolt.Cursor
	for _, cc := range r.c.cursors {
		if cc.Bucket() == b {
			c = cc
			break
		}
	}
	if c == nil {
		c = b.Cursor()
		r.c.cursors = append(r.c.cursors, c)
	}
	k, v := c.Seek(key)
	if !bytes.Equal(k, key) {
		return nil
	}
	return v
}

func (r *runTx) intent(key string) (*intentRecord, bool, error) {
	raw := r.get(r.b.Bucket([]byte(bucketIntents)), []byte(key))
	if raw == nil {
		return nil, false, nil
	}
	rec, err := decodeIntent(r.row.ID, key, raw)
	if err != nil {
		return nil, false, storeErr("run %s: decoding intent %s: %w", r.row.ID, key, err)
	}
	return &rec, true, nil
}

func isPending(s state.IntentState) bool {
	return s == state.IntentInFlight || s == state.IntentScheduled
}

// putIntent writes an intent whose state was from ("" for a new one),
// keeping the pending index in the same step (the rules move the row's
// counts). A new intent takes the next creation ordinal (the intents
// bucket's sequence).
func (r *runTx) putIntent(rec *intentRecord, from state.IntentState) error {
	if from == "" {
		intents := r.b.Bucket([]byte(bucketIntents))
		if r.c == nil || !r.c.ordered {
			if order := r.b.Bucket([]byte(bucketOrder)); order != nil && intents.Sequence() < order.Sequence() {
				// A run of format 1 numbered its intents in a bucket of
				// their own: go on after them.
				if err := intents.SetSequence(order.Sequence()); err != nil {
					return storeErr("run %s: creation order: %w", r.row.ID, err)
				}
			}
			if r.c != nil {
				r.c.ordered = true
			}
		}
		n, err := r.t.nextSeq(intents)
		if err != nil {
			return err
		}
		rec.Seq = n
	}
	if from != rec.State {
		pending := r.b.Bucket([]byte(bucketPending))
		switch was, is := isPending(from), isPending(rec.State); {
		case is && !was:
			if err := r.t.put(pending, u64(rec.Seq), []byte(rec.Key)); err != nil {
				return err
			}
		case was && !is:
			if err := r.t.del(pending, u64(rec.Seq)); err != nil {
				return err
			}
		}
	}
	return r.t.put(r.b.Bucket([]byte(bucketIntents)), []byte(rec.Key), encodeIntent(rec))
}

func (r *runTx) count(s state.IntentState, delta int) {
	if r.shared {
		r.row.Intents = maps.Clone(r.row.Intents)
		r.shared = false
	}
	n := r.row.Intents[s] + delta
	if n <= 0 {
		delete(r.row.Intents, s)
	} else {
		r.row.Intents[s] = n
	}
	r.dirty = true
}

// eachPending calls fn for every IN_FLIGHT or SCHEDULED intent in creation
// order. Keys are collected first: bbolt cursors must not outlive writes
// to their bucket.
func (r *runTx) eachPending(want state.IntentState, fn func(rec *intentRecord) error) error {
	if r.row.Intents[want] == 0 {
		return nil
	}
	var keys []string
	c := r.b.Bucket([]byte(bucketPending)).Cursor()
	for k, v := c.First(); k != nil; k, v = c.Next() {
		keys = append(keys, string(v))
	}
	for _, key := range keys {
		rec, ok, err := r.intent(key)
		if err != nil {
			return err
		}
		if !ok {
			return storeErr("run %s: pending index names missing intent %s", r.row.ID, key)
		}
		if rec.State != want {
			continue
		}
		if err := fn(rec); err != nil {
			return err
		}
	}
	return nil
}

// prune removes the run's intents and events (every bucket under it) and
// its retention entry; the row stays, with PrunedAt set.
func (r *runTx) prune() error {
	if r.b.Bucket([]byte(bucketOrder)) != nil {
		if err := r.b.DeleteBucket([]byte(bucketOrder)); err != nil {
			return storeErr("run %s: pruning %s: %w", r.row.ID, bucketOrder, err)
		}
	}
	for _, name := range []string{bucketIntents, bucketPending, bucketSeq, bucketEvents} {
		if err := r.b.DeleteBucket([]byte(name)); err != nil {
			return storeErr("run %s: pruning %s: %w", r.row.ID, name, err)
		}
		if _, err := r.b.CreateBucket([]byte(name)); err != nil {
			return storeErr("run %s: pruning %s: %w", r.row.ID, name, err)
		}
	}
	if r.retention != 0 {
		if err := r.t.del(r.t.tx.Bucket([]byte(bucketFinal)), retentionKey(r.retention, r.row.ID)); err != nil {
			return err
		}
	}
	r.retention = 0
	r.row.PrunedAt = r.t.now
	r.dirty = true
	return nil
}
