// Package runwatch carries the rows of runs to the parts of one process that
// hold something open for them — the egress proxy's connections, the browser
// guard's CDP sessions, the launched browsers — so that a cancel reaches all
// of them from one subscription to the store's cancel broadcast, with one
// read of the row shared by all.
//
// A broadcast is best effort (a message published while the subscription is
// down is lost), so every held run's row is also read again periodically,
// and once more at its drain deadline: a lost message costs latency, never
// safety. A run also leaves CANCELLING without a broadcast (the sweeper
// moves it on), which the periodic read is for as well.
//
// It never decides what a row means for what is held: each Holder does, in
// Enforce. It never writes to the store.
package runwatch

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/stopgate/stopgate/state"
)

// Holder is a part of the process that holds something open for runs.
type Holder interface {
	// Holds reports whether something is open for run now.
	Holds(run string) bool
	// Runs lists the runs something is open for now.
	Runs() []string
	// Enforce is handed a fresh row of a run the holder holds. It is
	// called from the watcher's goroutine and must not block: cutting is
	// cancelling a context or closing a connection, not waiting for it.
	Enforce(row state.Run)
}

// Options tune a Watcher.
type Options struct {
	// Interval is how often the rows of held runs are read again (2s when
	// zero); it bounds how late a cancel whose broadcast was lost arrives.
	Interval time.Duration
	// StoreTimeout bounds each read (state.DefaultTimeout when zero).
	StoreTimeout time.Duration
	Logger       *slog.Logger
	// Heard, if set, is told of every run the cancel broadcast names, held
	// here or not (the sweeper follows each cancel to its end with it).
	// It is called from the watcher's goroutine and must not block.
	Heard func(run string)
}

// Watcher is the process's one watch on runs. Add every Holder before Run.
type Watcher struct {
	store    state.Store
	interval time.Duration
	timeout  time.Duration
	log      *slog.Logger
	heard    func(run string)

	mu      sync.Mutex
	holders []Holder
	// deadlines are timers that read a run again at its drain deadline,
	// when what a holder was allowed to finish must be cut.
	deadlines map[string]*time.Timer
}

// DefaultInterval is the time between re-reads of the rows of runs with
// open connections when none is set: a cancel whose message was lost is
// seen within it.
const DefaultInterval = 2 * time.Second

// New returns a watcher on store.
func New(store state.Store, opts Options) *Watcher {
	if opts.Interval <= 0 {
		opts.Interval = DefaultInterval
	}
	if opts.StoreTimeout <= 0 {
		opts.StoreTimeout = state.DefaultTimeout
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	return &Watcher{store: store, interval: opts.Interval, timeout: opts.StoreTimeout, log: opts.Logger, heard: opts.Heard, deadlines: map[string]*time.Timer{}}
}

// Add registers a holder.
func (w *Watcher) Add(h Holder) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.holders = append(w.holders, h)
}

// Run watches until ctx ends: every broadcast cancel of a held run, and
// every Interval each held run, is read once and handed to its holders. A
// subscription that cannot be made (or ends) is tried again every Interval.
func (w *Watcher) Run(ctx context.Context) {
	defer w.stopDeadlines()
	t := time.NewTicker(w.interval)
	defer t.Stop()
	cancels := w.subscribe(ctx)
	for {
		select {
		case <-ctx.Done():
			return
		case run, ok := <-cancels:
			if !ok {
				cancels = nil
				continue
			}
			if w.heard != nil {
				w.heard(run)
			}
			if w.held(run) {
				w.Check(ctx, run)
			}
		case <-t.C:
			if cancels == nil {
				cancels = w.subscribe(ctx)
			}
			for _, run := range w.runs() {
				w.Check(ctx, run)
			}
		}
	}
}

func (w *Watcher) subscribe(ctx context.Context) <-chan string {
	cancels, err := w.store.Cancels(ctx)
	if err != nil {
		if ctx.Err() == nil {
			w.log.Warn("no cancel broadcast; held runs learn of cancels by re-reading their rows until it is back",
				"interval", w.interval, "err", err)
		}
		return nil
	}
	return cancels
}

// Check reads run's row once and hands it to the holders that hold it.
func (w *Watcher) Check(ctx context.Context, run string) {
	if ctx.Err() != nil {
		return
	}
	rctx, cancel := context.WithTimeout(ctx, w.timeout)
	row, err := w.store.Get(rctx, run)
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			w.log.Warn("cannot read a run to enforce it on what is open for it; trying again at the next re-check", "run", run, "err", err)
		}
		return
	}
	w.Observe(ctx, row)
}

// Observe hands a row already read (by a guard, a lease renewal) to the
// holders of its run, as Check would.
func (w *Watcher) Observe(ctx context.Context, row state.Run) {
	held := false
	for _, h := range w.snapshot() {
		if h.Holds(row.ID) {
			held = true
			h.Enforce(row)
		}
	}
	if held && time.Now().Before(row.DrainDeadline) {
		w.armDeadline(ctx, row.ID, row.DrainDeadline)
	}
}

func (w *Watcher) snapshot() []Holder {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.holders
}

func (w *Watcher) held(run string) bool {
	for _, h := range w.snapshot() {
		if h.Holds(run) {
			return true
		}
	}
	return false
}

func (w *Watcher) runs() []string {
	seen := map[string]struct{}{}
	var out []string
	for _, h := range w.snapshot() {
		for _, run := range h.Runs() {
			if _, ok := seen[run]; !ok {
				seen[run] = struct{}{}
				out = append(out, run)
			}
		}
	}
	return out
}

// armDeadline reads run again just after its drain deadline, once.
func (w *Watcher) armDeadline(ctx context.Context, run string, at time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, ok := w.deadlines[run]; ok || ctx.Err() != nil {
		return
	}
	// A little past it: the store compares its own clock with the deadline.
	w.deadlines[run] = time.AfterFunc(time.Until(at)+10*time.Millisecond, func() {
		w.mu.Lock()
		delete(w.deadlines, run)
		w.mu.Unlock()
		w.Check(ctx, run)
	})
}

func (w *Watcher) stopDeadlines() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for run, t := range w.deadlines {
		t.Stop()
		delete(w.deadlines, run)
	}
}
