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

// TestARunItsBudgetCancelledIsFoundToDrain: the step that cancels a run
// for its budget cannot be preceded by the draining set's index step (a
// round trip on every effect); the index step comes after it, and if it
// is lost (a process gone between the two) the walk of the active set,
// which still holds the run, moves it into the draining set: a run's drain
// is never forgotten.
func TestARunItsBudgetCancelledIsFoundToDrain(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	s := open(t, srv.URL(), redisstore.Options{})
	admin := raw(t, srv.Addr())
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := s.Admit(ctx, state.AdmitRequest{RunID: "lost", Actor: "t", Budget: state.Budget{MaxEffects: 1}}); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if _, err := s.Guard(ctx, state.GuardRequest{RunID: "lost", Key: fmt.Sprintf("k%d", i), ExplicitKey: true, Boundary: state.BoundaryHTTP, LeaseTTL: time.Minute}); err != nil {
			t.Fatal(err)
		}
	}
	draining := func() []string {
		ids, err := s.DrainingRuns(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return ids
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(draining()) == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := draining(); len(got) != 1 || got[0] != "lost" {
		t.Fatalf("after the budget's cancel the draining set holds %v", got)
	}
	// The index step lost: the walk of the active set finds the run.
	if err := admin.ZRem(ctx, "sg:{index}:draining", "lost").Err(); err != nil {
		t.Fatal(err)
	}
	if got := draining(); len(got) != 0 {
		t.Fatalf("%v", got)
	}
	if active, err := s.ActiveRuns(ctx, "", 10); err != nil || len(active) != 0 {
		t.Fatalf("active runs %v %v", active, err)
	}
	if got := draining(); len(got) != 1 || got[0] != "lost" {
		t.Fatalf("after the walk of the active set the draining set holds %v", got)
	}
}
