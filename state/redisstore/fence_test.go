package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
)

// A guard sent while redis-server is stopped (SIGSTOP) reaches the server
// only when it resumes, long after the caller answered "store unavailable,
// nothing sent". The fence (NotAfter, set by the ledger) makes that late
// script refuse: no IN_FLIGHT record, no lease, no event, and the same
// Idempotency-Key is admitted once the store is back.
func TestGuardQueuedBehindPausedRedisNeverTakesEffect(t *testing.T) {
	const storeTimeout = 400 * time.Millisecond
	srv := redisserver.Start(t, redisserver.Options{})
	s := open(t, srv.URL(), redisstore.Options{})
	admin := raw(t, srv.Addr())
	ctx := tctx(t)
	ledger := warmLedger(t, ctx, s, "run_7", storeTimeout)
	req := state.GuardRequest{RunID: "run_7", ObservedVersion: 1, Key: "pay-1", ExplicitKey: true, Boundary: state.BoundaryHTTP,
		Method: "POST", Target: "https://api.example/pay", BodyDigest: "d"}
	before := programCalls(t, admin)
	srv.Pause()
	_, err := ledger.Begin(ctx, req)
	srv.Resume()
	if !errors.Is(err, state.ErrUnavailable) {
		t.Fatalf("guard with redis stopped: got %v, want ErrUnavailable", err)
	}

	// The guard's script did reach the server and ran once it resumed:
	// wait until the server counts it, then look at what it left.
	awaitProgramCalls(t, admin, before, "the guard")
	if in, err := s.Intent(ctx, "run_7", "pay-1"); !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("the abandoned guard took effect after the resume: %+v (%v)", in, err)
	}
	evs := must(s.Events(ctx, "run_7"))(t)
	for _, e := range evs {
		if e.Intent == "pay-1" {
			t.Fatalf("the abandoned guard left an event: %+v", e)
		}
	}
	// The warm-up holds the run's one lease, in the lease set or as the
	// row's lone lease (field l).
	leases := must(admin.ZRange(ctx, redisstore.KeysOf("run_7")[4], 0, -1).Result())(t)
	if lone := admin.HGet(ctx, redisstore.KeysOf("run_7")[0], "l").Val(); lone != "" {
		leases = append(leases, lone)
	}
	if fmt.Sprint(leases) != "[warm-up]" {
		t.Fatalf("leases after the abandoned guard: %v, want the warm-up's alone", leases)
	}

	res, err := ledger.Begin(ctx, req)
	if err != nil || !res.Admitted || res.Intent.State != state.IntentInFlight || res.Intent.Attempts != 1 {
		t.Fatalf("the same key once the store is back: %+v %v, want admitted (attempt 1)", res, err)
	}
}

// programCalls is how many FCALL, EVALSHA and EVAL the server has run.
func programCalls(t *testing.T, c *redis.Client) int {
	t.Helper()
	info := must(c.Info(context.Background(), "commandstats").Result())(t)
	total := 0
	for _, line := range strings.Split(info, "\n") {
		for _, cmd := range []string{"cmdstat_fcall:", "cmdstat_evalsha:", "cmdstat_eval:"} {
			rest, ok := strings.CutPrefix(strings.TrimSpace(line), cmd+"calls=")
			if !ok {
				continue
			}
			n, err := strconv.Atoi(rest[:strings.IndexByte(rest, ',')])
			if err != nil {
				t.Fatalf("commandstats line %q: %v", line, err)
			}
			total += n
		}
	}
	return total
}

// warmLedger admits run and guards its key warm-up through a new ledger
// with the given store timeout, so that the server knows the guard
// script: a guard queued behind a pause must run, not fail with NOSCRIPT.
func warmLedger(t *testing.T, ctx context.Context, s *redisstore.Store, run string, storeTimeout time.Duration) *intents.Ledger {
	t.Helper()
	must(s.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "test"}))(t)
	ledger := intents.NewLedger(s, intents.LedgerOptions{Owner: "proxy:1", StoreTimeout: storeTimeout, Logger: quiet(t)})
	if res, err := ledger.Begin(ctx, state.GuardRequest{RunID: run, Key: "warm-up", ExplicitKey: true, Boundary: state.BoundaryHTTP}); err != nil || !res.Admitted {
		t.Fatalf("warm-up guard: %+v %v", res, err)
	}
	return ledger
}

// awaitProgramCalls waits (5s at most) until the server has run more
// scripts than before: what was sent during the pause ran after SIGCONT.
func awaitProgramCalls(t *testing.T, admin *redis.Client, before int, what string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for programCalls(t, admin) <= before {
		if time.Now().After(deadline) {
			t.Fatal(what + " sent during the pause never ran after SIGCONT; the test proves nothing")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Many guards of one run queued behind a stopped redis-server (one call in
// flight, the rest waiting for it in the run's batch): every caller hears
// ErrUnavailable within its store timeout, and none of the guards takes
// effect after SIGCONT.
func TestGuardsQueuedTogetherBehindPausedRedisNeverTakeEffect(t *testing.T) {
	const storeTimeout = 400 * time.Millisecond
	srv := redisserver.Start(t, redisserver.Options{})
	s := open(t, srv.URL(), redisstore.Options{})
	admin := raw(t, srv.Addr())
	ctx := tctx(t)
	ledger := warmLedger(t, ctx, s, "run_8", storeTimeout)
	before := programCalls(t, admin)
	srv.Pause()
	const n = 16
	errs := make(chan error, n)
	took := make(chan time.Duration, n)
	for i := range n {
		go func() {
			start := time.Now()
			_, err := ledger.Begin(ctx, state.GuardRequest{RunID: "run_8", Key: fmt.Sprintf("pay-%d", i), ExplicitKey: true, Boundary: state.BoundaryHTTP})
			took <- time.Since(start)
			errs <- err
		}()
	}
	for range n {
		if err := <-errs; !errors.Is(err, state.ErrUnavailable) {
			srv.Resume()
			t.Fatalf("a guard with redis stopped: got %v, want ErrUnavailable", err)
		}
		if d := <-took; d > storeTimeout+2*time.Second {
			t.Errorf("a queued guard waited %v, past its store timeout %v", d, storeTimeout)
		}
	}
	srv.Resume()
	awaitProgramCalls(t, admin, before, "the call")
	for _, in := range must(s.Intents(ctx, "run_8"))(t) {
		if in.Key != "warm-up" {
			t.Fatalf("an abandoned guard took effect after the resume: %+v", in)
		}
	}
}
