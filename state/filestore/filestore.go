// Package filestore is the embedded state.Store: one bbolt file on local
// disk, for a single machine with no server to run.
//
// Every write is one step of a bbolt transaction, and every committed
// transaction is fsynced before any of its steps returns, so a cancel that
// has been acknowledged survives kill -9 and power loss. Steps that arrive
// while a commit is under way share the next one (group commit). bbolt
// takes an exclusive flock on the file: a second process opening the same
// data file fails fast instead of corrupting it.
//
// Layout (all keys and values are bytes; records are binary, codec.go):
//
//	meta              "format" → "2"
//	runs              run id → row (with its intent counts)
//	status            "<STATUS>/<run id>" → "" (List, DrainingRuns, ActiveRuns without a full scan)
//	final             ms (big endian) + run id → "" (retention, oldest first)
//	totals            total's name (machine.TallyRuns, …) → count (big endian, two's complement)
//	run/<run id>/
//	    intents       key → intent record (creation ordinal: the bucket's sequence)
//	    order         sequence (big endian) → key, creation order of format 1 files only
//	    pending       sequence → key, for intents IN_FLIGHT or SCHEDULED only
//	    seq           derived key base → dispatch count (big endian), from the
//	                  base's second dispatch on (deriveKey)
//	    events        sequence → event, commit order
package filestore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime/debug"
	"sync"
	"syscall"
	"time"

	bolt "go.etcd.io/bbolt"
	berrors "go.etcd.io/bbolt/errors"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/machine"
)

// DefaultTimeout is how long Open waits for another process to release the
// data file before giving up.
const DefaultTimeout = time.Second

// formatVersion is written into every new file so that a later, different
// layout can refuse (or migrate) an old file instead of misreading it.
// Format 2 stores records in a binary form (codec.go) and has a retention
// index; a format 1 file is read as it is and becomes format 2 at Open (its
// JSON records stay readable), so an older stopgate refuses it afterwards
// rather than misread it.
const formatVersion = "2"

// subscriberBuffer is how many cancels a slow subscriber may fall behind
// before broadcasts to it are dropped. Dropping is safe: subscribers
// re-check rows periodically, so a lost message costs latency only.
const subscriberBuffer = 64

// Options configure Open.
type Options struct {
	// Logger receives the store's few log lines; nil means slog.Default().
	Logger *slog.Logger
	// Now is the store's clock; nil means time.Now. The store keeps times in
	// milliseconds, UTC, as the Redis store does.
	Now func() time.Time
	// Timeout bounds the wait for the file lock; 0 means DefaultTimeout.
	Timeout time.Duration
	// OutcomeDelay bounds how long an outcome queued by FinishLater waits
	// for a commit to ride with (state.OutcomeDelay when zero).
	OutcomeDelay time.Duration
}

// Store is the embedded state.Store. It is safe for concurrent use.
type Store struct {
	db   *bolt.DB
	path string
	log  *slog.Logger
	now  func() time.Time

	// last is the latest time handed to a write transaction. Writes are
	// serialized by bbolt, so only code inside db.Update touches it.
	last time.Time

	// w is the group commit (update).
	w writer

	// failed is the error of the last commit if it failed (a full disk, a
	// read-only or failing file system), until one succeeds: Ping.
	failMu sync.Mutex
	failed error

	mu     sync.Mutex
	closed bool
	subs   map[chan string]func() bool // subscriber → stops its context watch
}

var _ state.Store = (*Store)(nil)

// Open opens the data file at path, creating it (0600) and its directory
// (0700) when missing.
func Open(path string, opts Options) (*Store, error) {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Timeout <= 0 {
		opts.Timeout = DefaultTimeout
	}
	_, err := os.Stat(path)
	created := errors.Is(err, os.ErrNotExist)
	existing := filepath.Dir(path)
	for created && existing != filepath.Dir(existing) {
		if _, err := os.Stat(existing); err == nil {
			break
		}
		existing = filepath.Dir(existing)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("filestore: creating the directory of data file %s: %w", path, err)
	}
	removeStaleCreations(path)
	if created {
		if err := create(path, existing, opts.Timeout); err != nil {
			return nil, fmt.Errorf("filestore: creating data file %s: %w", path, err)
		}
	}
	db, err := openBolt(path, opts.Timeout)
	if err != nil {
		return nil, err
	}
	s := &Store{
		db:   db,
		path: path,
		log:  opts.Logger.With("store", "file", "path", path),
		now:  opts.Now,
		subs: make(map[chan string]func() bool),
		w:    writer{delay: cmp.Or(opts.OutcomeDelay, state.OutcomeDelay)},
	}
	return s, nil
}

// creating is the suffix of a data file being created, before it takes
// its name.
const creating = ".creating-"

// create makes a new, initialized data file at path, atomically: it is
// built and fsynced under a temporary name in the same directory, then
// linked to its name, and the directories are fsynced. A first start that
// fails half-way (a full disk, a crash) leaves no file at path, so it never
// blocks a later start; the temporary file is removed (or, after a crash,
// by a later Open). A link never replaces a file: if another process
// created path meanwhile, its file is the one used.
func create(path, existing string, timeout time.Duration) error {
	dir := filepath.Dir(path)
	tmp, err := os.CreateTemp(dir, filepath.Base(path)+creating+"*")
	if err != nil {
		return err
	}
	name := tmp.Name()
	defer os.Remove(name)
	if err := tmp.Close(); err != nil {
		return err
	}
	db, err := openBolt(name, timeout)
	if err != nil {
		return err
	}
	// bbolt fsynced the pages it wrote; close, and the file is whole.
	if err := db.Close(); err != nil {
		return err
	}
	if err := os.Link(name, path); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("naming the new file: %w", err)
	}
	// bbolt fsyncs the file, not the directory entries that name it: a
	// cancel acknowledged just after the first start must not vanish with a
	// directory entry lost in a power cut.
	return syncDirs(dir, existing)
}

// removeStaleCreations removes what creations that never finished (the
// process died between the temporary file and its name) left beside path.
// Only old ones: a younger one may be another process's creation under way.
func removeStaleCreations(path string) {
	stale, _ := filepath.Glob(path + creating + "*")
	for _, name := range stale {
		if fi, err := os.Stat(name); err == nil && time.Since(fi.ModTime()) > 10*time.Minute {
			_ = os.Remove(name)
		}
	}
}

// syncDirs fsyncs dir and each parent up to and including top.
func syncDirs(dir, top string) error {
	for {
		d, err := os.Open(dir)
		if err != nil {
			return err
		}
		err = d.Sync()
		_ = d.Close()
		if err != nil {
			return fmt.Errorf("syncing directory %s: %w", dir, err)
		}
		if dir == top || dir == filepath.Dir(dir) {
			return nil
		}
		dir = filepath.Dir(dir)
	}
}

func openBolt(path string, timeout time.Duration) (db *bolt.DB, err error) {
	if err := checkTruncated(path); err != nil {
		return nil, err
	}
	// bbolt trusts the pages it maps: a damaged file can still fault
	// (SIGBUS) or panic inside Open. That must end in an error that names
	// the file, not in a crash of the whole server. The mapping a fault
	// leaves behind keeps the file locked in this process, which is about
	// to exit on the error anyway.
	var file *os.File // only while Open runs: a fault leaves no *bolt.DB to close
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if p := recover(); p != nil {
			if file != nil {
				_ = file.Close()
			}
			db, err = nil, fmt.Errorf("filestore: data file %s is corrupt or truncated (reading it failed: %v)", path, p)
		}
	}()
	db, err = bolt.Open(path, 0o600, &bolt.Options{
		Timeout: timeout,
		// The free-page list is not written with every commit (it is
		// rebuilt from the pages at Open): with one commit per step, or
		// per group of steps, writing it cost more than the step.
		NoFreelistSync: true,
		FreelistType:   bolt.FreelistMapType,
		OpenFile: func(name string, flag int, perm os.FileMode) (*os.File, error) {
			f, err := os.OpenFile(name, flag, perm)
			file = f
			return f, err
		},
	})
	switch {
	case err == nil:
		if err := initialize(db, path); err != nil {
			_ = db.Close()
			return nil, err
		}
		return db, nil
	case errors.Is(err, berrors.ErrTimeout):
		return nil, fmt.Errorf("filestore: data file %s is in use by another stopgate process (no lock within %s); stop it or use another data dir: %w", path, timeout, err)
	case errors.Is(err, berrors.ErrInvalid), errors.Is(err, berrors.ErrChecksum), errors.Is(err, berrors.ErrVersionMismatch):
		return nil, fmt.Errorf("filestore: data file %s is corrupt or not a stopgate store: %w", path, err)
	default:
		return nil, fmt.Errorf("filestore: opening data file %s: %w", path, err)
	}
}

func initialize(db *bolt.DB, path string) error {
	err := db.Update(func(tx *bolt.Tx) error {
		meta, err := tx.CreateBucketIfNotExists([]byte(bucketMeta))
		if err != nil {
			return err
		}
		switch v := meta.Get([]byte(keyFormat)); {
		case v == nil, string(v) == "1":
			if err := meta.Put([]byte(keyFormat), []byte(formatVersion)); err != nil {
				return err
			}
		case string(v) != formatVersion:
			return fmt.Errorf("format %q, this stopgate reads formats 1 and %s", v, formatVersion)
		}
		for _, name := range []string{bucketRuns, bucketStatus, bucketRun} {
			if _, err := tx.CreateBucketIfNotExists([]byte(name)); err != nil {
				return err
			}
		}
		if tx.Bucket([]byte(bucketFinal)) == nil {
			if err := indexFinalRuns(tx); err != nil {
				return err
			}
		}
		if tx.Bucket([]byte(bucketTotals)) == nil {
			return tallyRuns(tx)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("filestore: preparing data file %s: %w", path, err)
	}
	return nil
}

// indexFinalRuns creates the retention index of a file written before it
// existed: every final run enters it dated by its last transition.
func indexFinalRuns(tx *bolt.Tx) error {
	idx, err := tx.CreateBucket([]byte(bucketFinal))
	if err != nil {
		return err
	}
	for _, st := range []state.Status{state.StatusCancelled, state.StatusCompleted} {
		for _, id := range idsWithStatus(tx, st) {
			rec, _, found, err := loadRecord(tx, id)
			if err != nil || !found {
				return fmt.Errorf("indexing final run %s for retention: %v", id, err)
			}
			rec.Retention = rec.UpdatedAt.UnixMilli()
			if err := tx.Bucket([]byte(bucketRuns)).Put([]byte(id), encodeRow(rec)); err != nil {
				return err
			}
			if err := idx.Put(retentionKey(rec.Retention, id), nil); err != nil {
				return err
			}
		}
	}
	return nil
}

// tallyRuns creates the totals of a file written before they were kept:
// every row counts once, as it stands (the reconciliations made before
// are not known, and count from zero).
func tallyRuns(tx *bolt.Tx) error {
	b, err := tx.CreateBucket([]byte(bucketTotals))
	if err != nil {
		return err
	}
	totals := map[string]int64{}
	err = tx.Bucket([]byte(bucketRuns)).ForEach(func(k, raw []byte) error {
		rec, err := decodeRow(string(k), raw)
		if err != nil {
			return fmt.Errorf("tallying run %s: %w", k, err)
		}
		for _, d := range machine.TallyOf(rec.Run) {
			totals[d.Name] += d.N
		}
		return nil
	})
	if err != nil {
		return err
	}
	for name, n := range totals {
		if err := b.Put([]byte(name), u64(uint64(n))); err != nil {
			return err
		}
	}
	return nil
}

// Path returns the data file's path.
func (s *Store) Path() string { return s.path }

// Close commits the outcomes queued by FinishLater, ends every Cancels
// subscription and closes the file. Calls after the first return nil.
func (s *Store) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), state.DefaultTimeout)
	s.settle(ctx)
	cancel()
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	for ch, stop := range s.subs {
		stop()
		close(ch)
		delete(s.subs, ch)
	}
	s.mu.Unlock()
	if err := s.db.Close(); err != nil {
		return fmt.Errorf("filestore: closing data file %s: %w", s.path, err)
	}
	return nil
}

// stRdonly is ST_RDONLY of statfs(2): the file system is mounted
// read-only (or was made so, after an error).
const stRdonly = 0x1

// minFree is the free space below which the store says it cannot write:
// a commit writes a few pages, a file that grows asks for more.
const minFree = 256 << 10

// Ping reports whether the store can take writes: the data file's file
// system is writable and has room, no commit has failed since the last
// that succeeded, and a write transaction commits now. A store that can
// still be read but not written is as good as down for the guard, and
// readiness must say so before a request finds out.
func (s *Store) Ping(ctx context.Context) error {
	var fs syscall.Statfs_t
	if err := syscall.Statfs(filepath.Dir(s.path), &fs); err != nil {
		return fmt.Errorf("filestore: ping: %w: data file %s: %w", state.ErrUnavailable, s.path, err)
	}
	if fs.Flags&stRdonly != 0 {
		return fmt.Errorf("filestore: ping: %w: data file %s is on a read-only file system", state.ErrUnavailable, s.path)
	}
	if free := fs.Bavail * uint64(fs.Bsize); free < minFree {
		return fmt.Errorf("filestore: ping: %w: the disk of data file %s is full (%d bytes free)", state.ErrUnavailable, s.path, free)
	}
	if err := s.writeFailure(); err != nil {
		return fmt.Errorf("filestore: ping: %w: the last commit to data file %s failed: %w", state.ErrUnavailable, s.path, err)
	}
	return s.update(ctx, "ping", func(t *txn) error {
		return t.put(t.tx.Bucket([]byte(bucketMeta)), []byte(keyPing), u64(uint64(t.now.UnixMilli())))
	})
}

// writeFailure is the error of the last commit if it failed and none has
// succeeded since.
func (s *Store) writeFailure() error {
	s.failMu.Lock()
	defer s.failMu.Unlock()
	return s.failed
}

func (s *Store) noteCommit(err error) {
	s.failMu.Lock()
	defer s.failMu.Unlock()
	s.failed = err
}

// Backup writes a consistent copy of the whole data file to w while the
// store keeps serving (a bbolt read transaction: writers are not blocked).
// The copy is itself a data file that Open accepts.
func (s *Store) Backup(ctx context.Context, w io.Writer) (int64, error) {
	var n int64
	err := s.view(ctx, "backup", func(tx *bolt.Tx) error {
		var err error
		n, err = tx.WriteTo(w)
		if err != nil {
			return fmt.Errorf("%w: writing backup of %s: %w", state.ErrUnavailable, s.path, err)
		}
		return nil
	})
	return n, err
}

// Cancels delivers the id of every run whose cancel commits in this
// process, until ctx ends or the store closes. Only one process can hold
// the file, so every cancel of this store is seen here.
func (s *Store) Cancels(ctx context.Context) (<-chan string, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("filestore: cancels: %w: %w", state.ErrUnavailable, err)
	}
	ch := make(chan string, subscriberBuffer)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, fmt.Errorf("filestore: cancels: %w: data file %s is closed", state.ErrUnavailable, s.path)
	}
	s.subs[ch] = context.AfterFunc(ctx, func() { s.unsubscribe(ch) })
	return ch, nil
}

func (s *Store) unsubscribe(ch chan string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.subs[ch]; ok {
		delete(s.subs, ch)
		close(ch)
	}
}

// publish runs after the cancel's transaction committed, never inside it:
// a subscriber must not hear of a cancel that could still roll back, and
// the single writer must not wait on anyone's channel.
func (s *Store) publish(runID string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for ch := range s.subs {
		select {
		case ch <- runID:
		default:
			s.log.Warn("cancel broadcast dropped: subscriber is not keeping up; it will see the cancel on its next re-check", "run_id", runID)
		}
	}
}

// errNoChange rolls back a write transaction that wrote nothing, so that a
// no-op (an idempotent admit, a tick with nothing to do) costs no fsync.
var errNoChange = errors.New("filestore: nothing to commit")

// errWroteThenFailed rolls back a shared transaction in which a step failed
// after it had written: the others are then committed one by one.
var errWroteThenFailed = errors.New("filestore: a step failed after writing")

// maxGroup bounds the steps one commit carries, so that a commit stays a
// short transaction.
const maxGroup = 256

// write is one step waiting for a commit.
type write struct {
	op  string
	ctx context.Context
	fn  func(t *txn) error
	err error
	// wake is closed once: when err is set, or, if lead is set first,
	// when this step's caller is to commit the queue (its step among it).
	// One channel, not two, is one allocation less for every step.
	wake chan struct{}
	lead bool
	// later is set on a step nobody waits for (FinishLater): answered is
	// then called with its outcome, and it is never handed the lead.
	later    bool
	answered func(error)
}

// finish sets a step's outcome and wakes its caller, unless that caller
// leads this commit and is awake already; a step nobody waits for is
// answered instead.
func (s *Store) finish(w *write, err error) {
	w.err = err
	if !w.lead {
		close(w.wake)
	}
	if w.later {
		w.answered(err)
		s.w.mu.Lock()
		delete(s.w.later, w)
		s.w.mu.Unlock()
	}
}

// writer is the group commit: steps that arrive while a commit is under
// way wait in queue, and the next commit carries all of them, in arrival
// order, in one bbolt transaction and one fsync. Leader takes what is
// queued, no timer: a step that finds no commit under way commits at
// once, alone; a lone request never waits for a batch to fill.
//
// A step nobody waits for (FinishLater) is the one exception: it queues
// without leading, and goes with the next commit, or on its own once
// Options.OutcomeDelay has passed. One connection's outcome then shares its
// next request's commit and fsync.
type writer struct {
	mu      sync.Mutex
	queue   []*write
	leading bool
	// timer commits the queue once its first unled step has waited
	// delay (Options.OutcomeDelay).
	timer *time.Timer
	delay time.Duration
	// later holds the steps queued by updateLater and not yet committed,
	// queued or in the commit under way, for settle to wait on.
	later map[*write]struct{}
}

// update runs fn as one step of a write transaction and returns once that
// transaction is durable (or rolled back). Errors fn returns (conflicts,
// not found) pass through as they are; failures of the file itself wrap
// state.ErrUnavailable. Every step decides before it writes: one that
// returns an error after writing rolls the shared transaction back, and
// the steps of that commit are then committed one by one, so that no step
// is lost or applied twice because of another.
//
// The caller waits for its step's outcome even past ctx's deadline: once
// queued, a step may be committed at any moment, and its caller must learn
// whether it was. A step whose ctx has ended before its commit begins is
// not applied (a guard's own deadline, NotAfter, is checked inside the
// transaction with the store's clock).
func (s *Store) update(ctx context.Context, op string, fn func(t *txn) error) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("filestore: %s: %w: %w", op, state.ErrUnavailable, err)
	}
	w := &write{op: op, ctx: ctx, fn: fn, wake: make(chan struct{})}
	s.w.mu.Lock()
	s.w.queue = append(s.w.queue, w)
	if s.w.leading {
		s.w.mu.Unlock()
		<-w.wake
		if !w.lead {
			return w.err
		}
		// Handed the lead: this caller's step is in the queue it takes.
	} else {
		s.startLead()
		w.lead = true
		s.w.mu.Unlock()
	}
	s.commitQueued()
	return w.err
}

// updateLater queues fn as one step of a write transaction without
// waiting for it; answered is called with its outcome once committed (or
// rolled back).
func (s *Store) updateLater(ctx context.Context, op string, fn func(t *txn) error, answered func(error)) {
	if err := ctx.Err(); err != nil {
		answered(fmt.Errorf("filestore: %s: %w: %w", op, state.ErrUnavailable, err))
		return
	}
	w := &write{op: op, ctx: ctx, fn: fn, wake: make(chan struct{}), later: true, answered: answered}
	s.w.mu.Lock()
	s.w.queue = append(s.w.queue, w)
	if s.w.later == nil {
		s.w.later = map[*write]struct{}{}
	}
	s.w.later[w] = struct{}{}
	if !s.w.leading && s.w.timer == nil {
		s.w.timer = time.AfterFunc(s.w.delay, s.lead)
	}
	s.w.mu.Unlock()
}

// startLead makes the caller the one committing, the timer of queued
// outcomes done with. The writer's lock is held.
func (s *Store) startLead() {
	s.w.leading = true
	if s.w.timer != nil {
		s.w.timer.Stop()
		s.w.timer = nil
	}
}

// lead commits the queue if nobody is committing it: a queued outcome's
// delay has passed, or a reader waits for it.
func (s *Store) lead() {
	s.w.mu.Lock()
	if s.w.leading || len(s.w.queue) == 0 {
		s.w.mu.Unlock()
		return
	}
	s.startLead()
	s.w.mu.Unlock()
	s.commitQueued()
}

// settle returns once every step queued by updateLater before it was
// called is committed (or ctx ends), committing the queue if nobody is.
func (s *Store) settle(ctx context.Context) {
	s.w.mu.Lock()
	waits := make([]chan struct{}, 0, len(s.w.later))
	for w := range s.w.later {
		waits = append(waits, w.wake)
	}
	s.w.mu.Unlock()
	if len(waits) == 0 {
		return
	}
	s.lead()
	for _, wake := range waits {
		select {
		case <-wake:
		case <-ctx.Done():
			return
		}
	}
}

// commitQueued commits what is queued now (this leader's step among it),
// then hands the lead to the first step queued meanwhile, if any.
func (s *Store) commitQueued() {
	s.w.mu.Lock()
	n := min(len(s.w.queue), maxGroup)
	batch := s.w.queue[:n:n]
	s.w.queue = s.w.queue[n:]
	s.w.mu.Unlock()

	s.commit(batch)

	s.w.mu.Lock()
	if len(s.w.queue) == 0 {
		s.w.queue = nil
		s.w.leading = false
		s.w.mu.Unlock()
		return
	}
	next := s.w.queue[0]
	s.w.mu.Unlock()
	if next.later {
		// Nobody waits on a queued outcome to take the lead.
		go s.commitQueued()
		return
	}
	next.lead = true
	close(next.wake)
}

// commit runs the steps of batch in one transaction, or, if one of them
// failed after writing, each in its own. Every step is finished with its
// outcome.
func (s *Store) commit(batch []*write) {
	var live []*write
	for _, w := range batch {
		if err := w.ctx.Err(); err != nil {
			s.finish(w, fmt.Errorf("filestore: %s: %w: %w", w.op, state.ErrUnavailable, err))
			continue
		}
		live = append(live, w)
	}
	if len(live) == 0 {
		return
	}
	if len(live) > 1 {
		if errs, ok := s.transaction(live); ok {
			for i, w := range live {
				s.finish(w, errs[i])
			}
			return
		}
	}
	for _, w := range live {
		errs, _ := s.transaction([]*write{w})
		s.finish(w, errs[0])
	}
}

// transaction runs steps in one bbolt transaction and returns each step's
// error. ok is false when a step failed after writing and the transaction
// was rolled back for that (with a single step, its error is then returned
// as is).
func (s *Store) transaction(steps []*write) (errs []error, ok bool) {
	errs = make([]error, len(steps))
	poisoned := false
	err := s.db.Update(func(tx *bolt.Tx) error {
		clock := s.now().UTC().Truncate(time.Millisecond)
		// The audit log must read in order even if the wall clock steps
		// back between two commits.
		now := clock
		if now.Before(s.last) {
			now = s.last
		}
		wrote := false
		rows := newRowCache()
		for i, w := range steps {
			t := &txn{tx: tx, now: now, clock: clock, rows: rows}
			errs[i] = w.fn(t)
			switch {
			case errs[i] != nil && t.wrote:
				if len(steps) > 1 {
					poisoned = true
					return errWroteThenFailed
				}
				return errs[i]
			case errs[i] == nil && t.wrote:
				wrote = true
			}
		}
		if !wrote {
			return errNoChange
		}
		if err := rows.flush(tx); err != nil {
			return err
		}
		s.last = now
		return nil
	})
	if poisoned {
		return nil, false
	}
	switch {
	case errors.Is(err, errNoChange):
	case err != nil && len(steps) == 1 && errs[0] != nil:
		// The step's own error, its writes rolled back.
	case err != nil:
		// The file failed: every step of the commit with it.
		s.noteCommit(err)
		for i, w := range steps {
			errs[i] = fmt.Errorf("filestore: %s: %w: data file %s: %w", w.op, state.ErrUnavailable, s.path, err)
		}
	default:
		s.noteCommit(nil)
	}
	return errs, true
}

// view runs fn in one read transaction, with update's error rules.
// A read comes after the outcomes queued before it, as it would after a
// Finish.
func (s *Store) view(ctx context.Context, op string, fn func(tx *bolt.Tx) error) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("filestore: %s: %w: %w", op, state.ErrUnavailable, err)
	}
	s.settle(ctx)
	var fnErr error
	err := s.db.View(func(tx *bolt.Tx) error {
		fnErr = fn(tx)
		return fnErr
	})
	switch {
	case fnErr != nil:
		return fnErr
	case err != nil:
		return fmt.Errorf("filestore: %s: %w: data file %s: %w", op, state.ErrUnavailable, s.path, err)
	}
	return nil
}
