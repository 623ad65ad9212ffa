package intents

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/stopgate/stopgate/state"
)

// Sweeper ticks every live run: expired leases become UNKNOWN, drained
// cancels become CANCELLED, and drain deadlines that pass with work in
// flight leave the run UNKNOWN. Any number of instances may sweep the same
// store: every tick is one atomic, repeatable step.
type Sweeper struct {
	Store    state.Store
	Interval time.Duration
	// Actor names the sweeper in the audit log.
	Actor        string
	StoreTimeout time.Duration
	Logger       *slog.Logger
}

// Run sweeps every Interval (1s if unset) until ctx ends.
func (s *Sweeper) Run(ctx context.Context) { every(ctx, s.Interval, s.Sweep) }

// every calls f every interval (1s if unset) until ctx ends.
func every(ctx context.Context, interval time.Duration, f func(context.Context)) {
	if interval <= 0 {
		interval = time.Second
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

// Sweep ticks every live run once.
func (s *Sweeper) Sweep(ctx context.Context) {
	log := s.Logger
	if log == nil {
		log = slog.Default()
	}
	runs, err := storeCall(ctx, s.StoreTimeout, s.Store.LiveRuns)
	if err != nil {
		log.Warn("sweep: cannot list live runs", "err", err)
		return
	}
	for _, id := range runs {
		if ctx.Err() != nil {
			return
		}
		_, err := storeCall(ctx, s.StoreTimeout, func(ctx context.Context) (state.Run, error) {
			return s.Store.Tick(ctx, state.TickRequest{RunID: id, Actor: s.Actor})
		})
		if err != nil && !errors.Is(err, state.ErrNotFound) {
			log.Warn("sweep: tick failed", "run", id, "err", err)
		}
	}
}
