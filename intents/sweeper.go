package intents

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/stopgate/stopgate/state"
)

// DefaultSweepPage is how many ACTIVE runs one sweep ticks when
// Sweeper.PageSize is zero.
const DefaultSweepPage = 256

// DefaultPruneLimit is how many final runs one sweep prunes at most when
// Sweeper.PruneLimit is zero.
const DefaultPruneLimit = 100

// Sweeper moves the store on by itself, so that nothing waits for a
// carrier that is gone:
//
//   - every sweep ticks every draining run (CANCELLING, UNKNOWN): drained
//     cancels become CANCELLED, drain deadlines that pass with work in
//     flight leave the run UNKNOWN, and expired leases become UNKNOWN;
//   - every sweep ticks one page of ACTIVE runs (PageSize), walking them in
//     id order and starting over at the end, so that the leases of a dead
//     carrier expire into UNKNOWN on ACTIVE runs too. A sweep's cost
//     follows the draining runs and the page, never the runs stored; the
//     price is latency: with A active runs an expired lease of an ACTIVE
//     run is found within ceil(A/PageSize) intervals (10 000 runs, pages
//     of 256, 1s: within 40s);
//   - with a Retention, every sweep prunes up to PruneLimit final runs
//     whose intents and events are older than it (the rows stay).
//
// Any number of instances may sweep the same store: every tick and every
// prune is one atomic, repeatable step.
type Sweeper struct {
	Store    state.Store
	Interval time.Duration
	// Actor names the sweeper in the audit log.
	Actor        string
	StoreTimeout time.Duration
	Logger       *slog.Logger
	// PageSize is how many ACTIVE runs a sweep ticks (DefaultSweepPage
	// when zero).
	PageSize int
	// Retention is how long the intents and events of a run that became
	// final (CANCELLED, COMPLETED) are kept; zero or less keeps them
	// forever. Rows are never removed.
	Retention time.Duration
	// PruneLimit bounds the runs one sweep prunes (DefaultPruneLimit when
	// zero).
	PruneLimit int

	// Drained, if set, is told of every run this sweeper saw CANCELLING,
	// or was told of by Watch, and then saw leave it (CANCELLED or
	// UNKNOWN), whoever moved it on, once: the operator's measure of how
	// long drains take.
	Drained func(run state.Run)

	runs runWalk
	mu   sync.Mutex
	// cancelling are the runs the last sweeps saw CANCELLING.
	cancelling map[string]struct{}
}

// DefaultSweepInterval is the time between sweeps (and between the
// reconciler's passes) when none is set: a lease that expires, a drain
// deadline that passes, is acted on within it.
const DefaultSweepInterval = time.Second

// Run sweeps every Interval (DefaultSweepInterval if unset) until ctx ends.
func (s *Sweeper) Run(ctx context.Context) { every(ctx, s.Interval, s.Sweep) }

// every calls f every interval (DefaultSweepInterval if unset) until ctx ends.
func every(ctx context.Context, interval time.Duration, f func(context.Context)) {
	if interval <= 0 {
		interval = DefaultSweepInterval
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			f(ctx)
		}
	}
}

// Sweep ticks every draining run and one page of ACTIVE runs, then prunes.
func (s *Sweeper) Sweep(ctx context.Context) {
	log := s.logger()
	runs := s.runs.pass(ctx, s.Store, s.StoreTimeout, s.PageSize, log, "sweep")
	ticked := make(map[string]state.Run, len(runs))
	for _, id := range runs {
		if ctx.Err() != nil {
			return
		}
		row, err := storeCall(ctx, s.StoreTimeout, func(ctx context.Context) (state.Run, error) {
			return s.Store.Tick(ctx, state.TickRequest{RunID: id, Actor: s.Actor})
		})
		if err != nil && !errors.Is(err, state.ErrNotFound) {
			log.Warn("sweep: tick failed", "run", id, "err", err)
		}
		if err == nil {
			ticked[id] = row
		}
	}
	s.noteDrains(ctx, ticked)
	s.prune(ctx)
}

// Watch follows run to the end of its drain: Drained is told when it has
// left CANCELLING, however fast that was. The cancel broadcast calls it,
// so that a drain shorter than a sweep's interval (the last outcome came
// in before the next sweep) is not missed.
func (s *Sweeper) Watch(run string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cancelling == nil {
		s.cancelling = map[string]struct{}{}
	}
	s.cancelling[run] = struct{}{}
}

// noteDrains tells Drained of the runs that left CANCELLING since the last
// sweep: by this sweep's tick, or elsewhere (the last outcome of a run
// settles it in the same step), then read once more. A run whose row could
// not be read this time (a tick or a read that failed) stays watched, so a
// passing store error does not lose its drain.
func (s *Sweeper) noteDrains(ctx context.Context, ticked map[string]state.Run) {
	if s.Drained == nil {
		return
	}
	s.mu.Lock()
	was := s.cancelling
	s.cancelling = map[string]struct{}{}
	for id, row := range ticked {
		if row.Status == state.StatusCancelling {
			s.cancelling[id] = struct{}{}
		}
	}
	s.mu.Unlock()
	var watch []string
	for id := range was {
		row, ok := ticked[id]
		if !ok {
			var err error
			row, err = storeCall(ctx, s.StoreTimeout, func(ctx context.Context) (state.Run, error) { return s.Store.Get(ctx, id) })
			if err != nil {
				if !errors.Is(err, state.ErrNotFound) {
					watch = append(watch, id)
				}
				continue
			}
		}
		switch row.Status {
		case state.StatusCancelling:
			watch = append(watch, id)
		case state.StatusActive:
		default:
			s.Drained(row)
		}
	}
	s.mu.Lock()
	for _, id := range watch {
		s.cancelling[id] = struct{}{}
	}
	s.mu.Unlock()
}

// runWalk is what each pass of the Sweeper and of the Reconciler looks
// at: every draining run, and the next page of ACTIVE runs, which it walks
// in id order, starting over after the last page.
type runWalk struct {
	mu sync.Mutex
	// after is the ACTIVE run id the next page starts after ("" from the
	// start).
	after string
}

// pass lists the runs of the next pass: the draining ones, then the next
// page of ACTIVE ones (of pageSize, DefaultSweepPage when zero). A list the
// store did not give is logged, under who ("sweep", "reconcile"), and left
// out.
func (w *runWalk) pass(ctx context.Context, store state.Store, timeout time.Duration, pageSize int, log *slog.Logger, who string) []string {
	draining, err := storeCall(ctx, timeout, store.DrainingRuns)
	if err != nil {
		log.Warn(who+": cannot list draining runs", "err", err)
	}
	active, err := w.page(ctx, store, timeout, pageSize)
	if err != nil {
		log.Warn(who+": cannot list active runs", "err", err)
	}
	return append(draining, active...)
}

// page reads the next page of ACTIVE runs, of size (DefaultSweepPage when
// zero), and moves the walk on.
func (w *runWalk) page(ctx context.Context, store state.Store, timeout time.Duration, size int) ([]string, error) {
	w.mu.Lock()
	after := w.after
	w.mu.Unlock()
	if size <= 0 {
		size = DefaultSweepPage
	}
	ids, err := storeCall(ctx, timeout, func(ctx context.Context) ([]string, error) {
		return store.ActiveRuns(ctx, after, size)
	})
	if err != nil {
		return nil, err
	}
	next := ""
	if len(ids) == size {
		next = ids[len(ids)-1]
	}
	w.mu.Lock()
	w.after = next
	w.mu.Unlock()
	return ids, nil
}

func (s *Sweeper) prune(ctx context.Context) {
	if s.Retention <= 0 || ctx.Err() != nil {
		return
	}
	limit := s.PruneLimit
	if limit <= 0 {
		limit = DefaultPruneLimit
	}
	n, err := storeCall(ctx, s.StoreTimeout, func(ctx context.Context) (int, error) {
		return s.Store.Prune(ctx, state.PruneRequest{FinalBefore: time.Now().Add(-s.Retention), Limit: limit})
	})
	if err != nil {
		s.logger().Warn("sweep: prune failed; the records of finished runs stay until a later sweep", "err", err)
		return
	}
	if n > 0 {
		s.logger().Info("sweep: pruned the intents and events of finished runs past retention", "runs", n, "retention", s.Retention)
	}
}

func (s *Sweeper) logger() *slog.Logger {
	if s.Logger == nil {
		return slog.Default()
	}
	return s.Logger
}
