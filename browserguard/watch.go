package browserguard

import (
	"context"
	"log/slog"
	"slices"
	"time"

	"github.com/stopgate/stopgate/state"
)

// over reports whether a run will never have work admitted or carried
// again: CANCELLED and COMPLETED are final, and an UNKNOWN run's in-flight
// work was already cut (drain deadline) or lost; only reconciliation of its
// record remains. Its browser connections and its browser have no more use.
func over(r state.Run) bool { return r.Final() || r.Status == state.StatusUnknown }

// watcher carries a run's row to what a component holds for it: at once
// when a cancel is broadcast, and every interval from the rows themselves,
// so that a lost broadcast costs latency, never safety. A run leaves
// CANCELLING without a broadcast (the sweeper moves it on), which the
// periodic read is also for.
type watcher struct {
	store    state.Store
	interval time.Duration
	timeout  time.Duration
	log      *slog.Logger
	// held lists the runs the component holds something for now.
	held func() []string
	// enforce is given the row of a held run.
	enforce func(state.Run)
}

func (w watcher) run(ctx context.Context) {
	cancels, err := w.store.Cancels(ctx)
	if err != nil {
		w.log.Warn("no cancel broadcast; runs are re-read periodically only", "interval", w.interval, "err", err)
	}
	t := time.NewTicker(w.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case id, ok := <-cancels:
			if !ok {
				cancels = nil
				continue
			}
			if slices.Contains(w.held(), id) {
				w.check(ctx, id)
			}
		case <-t.C:
			for _, id := range w.held() {
				w.check(ctx, id)
			}
		}
	}
}

func (w watcher) check(ctx context.Context, id string) {
	gctx, cancel := context.WithTimeout(ctx, w.timeout)
	row, err := w.store.Get(gctx, id)
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			w.log.Warn("cannot read run to enforce it; trying again at the next re-check", "run", id, "err", err)
		}
		return
	}
	w.enforce(row)
}
