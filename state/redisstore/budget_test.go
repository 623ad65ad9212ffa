package redisstore_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
)

// Three instances on one Redis, each deciding its guards on what it last
// saw of the run (a lower bound of its counters), take exactly the
// budget's effects between them: the last one is taken once, and the
// guard that would cross the limit cancels the run for all.
func TestBudgetIsExactAcrossInstances(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	stores := []*redisstore.Store{
		open(t, srv.URL(), redisstore.Options{}), open(t, srv.URL(), redisstore.Options{}), open(t, srv.URL(), redisstore.Options{}),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for round, limit := range []int64{1, 7, 40} {
		run := fmt.Sprintf("fleet%d", round)
		if _, err := stores[0].Admit(ctx, state.AdmitRequest{RunID: run, Actor: "operator:test", Budget: state.Budget{MaxEffects: limit}}); err != nil {
			t.Fatal(err)
		}
		// Each instance sees the run ACTIVE first, so that the burst is
		// decided without reads.
		for i, s := range stores {
			if _, err := s.Guard(ctx, state.GuardRequest{RunID: run, Key: fmt.Sprintf("warm%d", i), ExplicitKey: true, Boundary: state.BoundaryHTTP,
				LeaseTTL: time.Minute, Refuse: "destination_denied"}); err != nil {
				t.Fatal(err)
			}
		}
		var admitted, budget atomic.Int64
		var wg sync.WaitGroup
		for i, s := range stores {
			for w := range 8 {
				wg.Go(func() {
					for n := range 10 {
						res, err := s.Guard(ctx, state.GuardRequest{RunID: run, Key: fmt.Sprintf("i%d-w%d-%d", i, w, n), ExplicitKey: true,
							Boundary: state.BoundaryHTTP, Target: "https://api.example/x", LeaseTTL: time.Minute, LeaseOwner: "p", Actor: "p"})
						if err != nil {
							t.Errorf("guard: %v", err)
							return
						}
						if res.Admitted {
							admitted.Add(1)
						}
						if res.Refusal == state.RefusalBudgetExceeded {
							budget.Add(1)
						}
					}
				})
			}
		}
		wg.Wait()
		if admitted.Load() != limit || budget.Load() != 1 {
			t.Fatalf("%s: %d admitted over three instances, %d refused for the budget: want exactly %d and 1", run, admitted.Load(), budget.Load(), limit)
		}
		row, err := stores[1].Get(ctx, run)
		if err != nil {
			t.Fatal(err)
		}
		if row.Status != state.StatusCancelling || row.Reason != "budget:max_effects" || row.Usage[state.CounterEffects] != limit {
			t.Fatalf("%s: %+v", run, row)
		}
		evs, err := stores[2].Events(ctx, run)
		if err != nil {
			t.Fatal(err)
		}
		cancelled := false
		for _, e := range evs {
			switch {
			case e.Kind == state.EventRunCancelled:
				cancelled = true
			case e.Kind == state.EventIntentAdmitted && cancelled:
				t.Fatalf("%s: %s admitted after the budget's cancel", run, e.Intent)
			}
		}
	}
}
