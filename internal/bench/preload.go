package bench

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
	"github.com/stopgate/stopgate/state/redisstore"
)

// This file is the instrument's only dependency on stopgate's Go packages:
// filling a store with a million runs through the proxy or the control API
// would take longer than the whole benchmark, so stored rows are written
// by stopgate's own store code, called in process, with the rows and
// records the running proxy would write. Everything measured still goes
// through the built binary.

// openRedisStore opens the Redis store at url as stopgate serve does.
func openRedisStore(ctx context.Context, url string) (state.Store, error) {
	return redisstore.Open(ctx, url, redisstore.Options{})
}

// openEmbeddedStore opens the embedded store's data file at path.
func openEmbeddedStore(path string) (state.Store, error) {
	return filestore.Open(path, filestore.Options{})
}

// preloadRuns writes n finished runs, prefix-0 … prefix-(n-1), as cancel
// tombstones (CANCELLED, one audit event each): the shape every finished
// run keeps once its intents and events are gone, and the cheapest honest
// row to write (one store step).
func preloadRuns(ctx context.Context, st state.Store, prefix string, n, workers int) error {
	return parallel(ctx, n, workers, func(ctx context.Context, i int) error {
		id := fmt.Sprintf("%s-%d", prefix, i)
		if _, err := st.Cancel(ctx, state.CancelRequest{RunID: id, Actor: "bench-preload", Reason: "stored run"}); err != nil {
			return fmt.Errorf("tombstone %s: %w", id, err)
		}
		return nil
	})
}

// preloadIntents records n answered GETs in run, as the proxy records them:
// the guard (through the same ledger), then the outcome RESPONDED 200.
func preloadIntents(ctx context.Context, st state.Store, run, target string, n, workers int) error {
	ledger := intents.NewLedger(st, intents.LedgerOptions{Owner: "bench-preload", LeaseTTL: time.Minute, StoreTimeout: 30 * time.Second})
	return parallel(ctx, n, workers, func(ctx context.Context, i int) error {
		full := fmt.Sprintf("%s?i=%d", target, i)
		res, err := ledger.Begin(ctx, state.GuardRequest{
			RunID: run, Key: intents.DerivedKey(run, "GET", full, ""), Boundary: state.BoundaryHTTP,
			Method: "GET", Target: target, AutoAdmit: true,
		})
		if err != nil {
			return fmt.Errorf("guard %d in %s: %w", i, run, err)
		}
		if !res.Admitted {
			return fmt.Errorf("guard %d in %s refused: %s", i, run, res.Refusal)
		}
		if _, err := ledger.Finish(ctx, state.FinishRequest{RunID: res.Intent.RunID, Key: res.Intent.Key, Attempt: res.Intent.Attempts, Outcome: state.IntentResponded, StatusCode: 200}); err != nil {
			return fmt.Errorf("outcome %d in %s: %w", i, run, err)
		}
		return nil
	})
}

// parallel calls fn for 0 … n-1 from workers goroutines, stopping at the
// first error or when ctx ends.
func parallel(ctx context.Context, n, workers int, fn func(context.Context, int) error) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var next atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for ctx.Err() == nil {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				if err := fn(ctx, i); err != nil {
					cancel(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if err := context.Cause(ctx); err != nil && err != context.Canceled {
		return err
	}
	return ctx.Err()
}
