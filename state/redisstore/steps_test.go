package redisstore

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/statetest"
)

// TestDecidedOnWhatWasSeenOrRead: a step decided on what this process saw
// of its run (one round trip) answers as a step decided on a read of it:
// the differential histories on a store that reads every run before every
// step give the same answers as on one that does not, and as the model.
func TestDecidedOnWhatWasSeenOrRead(t *testing.T) {
	s0, addr := testStore(t)
	_ = s0.Close()
	db := 0
	open := func(forget bool) statetest.OpenClocked {
		return func(t *testing.T, clock func() time.Time) state.Store {
			db++
			c := redis.NewClient(&redis.Options{Addr: addr, DB: db % 16})
			defer c.Close()
			if err := c.FlushDB(context.Background()).Err(); err != nil {
				t.Fatal(err)
			}
			s, err := Open(context.Background(), fmt.Sprintf("redis://%s/%d", addr, db%16), Options{Clock: clock, Logger: quiet()})
			if err != nil {
				t.Fatal(err)
			}
			s.seen.off = forget
			return s
		}
	}
	statetest.Differential(t, map[string]statetest.OpenClocked{
		"redis, deciding on what it saw": open(false),
		"redis, reading every run first": open(true),
	})
}

// TestAFailingRunKeepsToItself: a run whose keys cannot be read or written
// (its hash is a string) fails its own steps alone; the other runs of the
// same calls are answered as if alone.
func TestAFailingRunKeepsToItself(t *testing.T) {
	s, _ := testStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, run := range []string{"before", "after", "broken"} {
		if _, err := s.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "t"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.rdb.Del(ctx, keysOf("broken").row).Err(); err != nil {
		t.Fatal(err)
	}
	if err := s.rdb.Set(ctx, keysOf("broken").row, "not a hash", 0).Err(); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{"decided on what was seen", "read first"} {
		t.Run(path, func(t *testing.T) {
			if path == "read first" {
				s.seen.c.Purge()
			}
			var steps []*step
			answers := map[string]*state.GuardResult{}
			for _, run := range []string{"before", "broken", "after"} {
				req := state.GuardRequest{RunID: run, Key: "k-" + strconv.Itoa(len(path)), ExplicitKey: true, Boundary: state.BoundaryHTTP, Method: "POST",
					Target: "https://api.example/x", LeaseOwner: "p", LeaseTTL: time.Minute, Actor: "p"}
				out := new(state.GuardResult)
				answers[run] = out
				steps = append(steps, s.guardStep(req, out))
			}
			s.runSteps(ctx, steps)
			for i, run := range []string{"before", "broken", "after"} {
				err := steps[i].err
				if run == "broken" {
					if err == nil || !strings.Contains(err.Error(), "WRONGTYPE") {
						t.Errorf("the broken run answered %v; want its WRONGTYPE error", err)
					}
					continue
				}
				if err != nil || !answers[run].Admitted {
					t.Errorf("%s: %+v, %v; want admitted", run, answers[run], err)
				}
			}
		})
	}
}

// TestGuardsOfManyRunsShareCalls: guards of many runs made at the same
// time share calls on one Redis: the fleet's case, one agent per run,
// costs Redis fewer calls than steps.
func TestGuardsOfManyRunsShareCalls(t *testing.T) {
	s, _ := testStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const runs = 64
	for i := range runs {
		if _, err := s.Admit(ctx, state.AdmitRequest{RunID: fmt.Sprintf("run-%d", i), Actor: "t"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.rdb.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	start := make(chan struct{})
	errs := make(chan error, runs)
	for i := range runs {
		go func() {
			<-start
			res, err := s.Guard(ctx, state.GuardRequest{RunID: fmt.Sprintf("run-%d", i), Key: "k", ExplicitKey: true,
				Boundary: state.BoundaryHTTP, Method: "GET", Target: "https://api.example/x", LeaseOwner: "p",
				LeaseTTL: time.Minute, Actor: "p"})
			if err == nil && !res.Admitted {
				err = fmt.Errorf("run-%d refused: %s", i, res.Refusal)
			}
			errs <- err
		}()
	}
	close(start)
	for range runs {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	stats, err := s.rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	calls := 0
	for _, line := range strings.Split(stats, "\n") {
		if rest, ok := strings.CutPrefix(line, "cmdstat_fcall:calls="); ok {
			calls, _ = strconv.Atoi(rest[:strings.IndexByte(rest, ',')])
		}
	}
	if calls == 0 || calls > runs/2 {
		t.Errorf("%d guards of %d runs took %d calls; want them to share calls (at most %d)", runs, runs, calls, runs/2)
	}
}

// TestALeaseAnOlderLayoutKeptInTheRowStillExpires: a run written by the
// layout that kept a lone lease in the row's field l (not in the lease
// set) still has it read: a tick past its expiry turns it UNKNOWN, and a
// drain deadline cuts it.
func TestALeaseAnOlderLayoutKeptInTheRowStillExpires(t *testing.T) {
	s, _ := testStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, run := range []string{"lone", "lone-cut"} {
		g, err := s.Guard(ctx, state.GuardRequest{RunID: run, Key: "k", ExplicitKey: true, Boundary: state.BoundaryHTTP, AutoAdmit: true,
			Method: "POST", Target: "https://api.example/x", LeaseOwner: "p", LeaseTTL: time.Second, Actor: "p"})
		if err != nil || !g.Admitted {
			t.Fatal(g, err)
		}
		// As the older layout left it: the lease in l, not in the set.
		k := keysOf(run)
		if err := s.rdb.ZRem(ctx, k.inflight, "k").Err(); err != nil {
			t.Fatal(err)
		}
		if err := s.rdb.HSet(ctx, k.row, "l", "k").Err(); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Cancel(ctx, state.CancelRequest{RunID: "lone-cut", Actor: "t", Reason: "stop", DrainTimeout: time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond)
	for run, want := range map[string]string{"lone": state.ReasonLeaseExpired, "lone-cut": state.ReasonLeaseExpired} {
		if _, err := s.Tick(ctx, state.TickRequest{RunID: run, Actor: "sweeper"}); err != nil {
			t.Fatal(err)
		}
		in, err := s.Intent(ctx, run, "k")
		if err != nil || in.State != state.IntentUnknown || in.Reason != want {
			t.Errorf("%s: the lone lease after its expiry: %+v %v; want UNKNOWN, %s", run, in, err, want)
		}
	}
}
