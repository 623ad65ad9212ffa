// Package statetest is the conformance suite every state.Store passes: the
// same behaviours, the same answers, whichever store is behind it.
package statetest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stopgate/stopgate/state"
)

// Open returns a new, empty store; the suite closes it.
type Open func(t *testing.T) state.Store

// Run runs the whole suite against the stores open makes.
func Run(t *testing.T, open Open) {
	tests := []struct {
		name string
		fn   func(t *testing.T, s state.Store)
	}{
		{"AdmitCreatesActiveAtVersionOne", testAdmit},
		{"AdmitRejectsBadRunIDs", testAdmitInvalid},
		{"CancelIsCompareAndSet", testCancel},
		{"CancelOfUnseenRunWritesTombstone", testTombstone},
		{"CompleteNeedsActiveAtObservedVersion", testComplete},
		{"GetAndListByStatus", testList},
		{"GuardAdmitsActiveAtObservedVersion", testGuardAdmits},
		{"GuardRefusesAndRecordsAfterCancel", testGuardRefusesAfterCancel},
		{"GuardRefusesStaleVersion", testGuardStale},
		{"GuardAutoAdmitsUnseenButNeverTombstones", testGuardAutoAdmit},
		{"DerivedKeysGiveEachDispatchItsOwnRecord", testDerivedKeys},
		{"ExplicitKeyFollowsIdempotencyRules", testExplicitKey},
		{"DeliveryMayReachCancellingRunOnly", testAllowCancelling},
		{"CancelRevokesScheduledRetries", testRetriesRevoked},
		{"ScheduledRetryIsDispatchedThroughTheGuard", testRetryDispatched},
		{"FinishRecordsOutcomeOfLatestAttempt", testFinish},
		{"TickTurnsExpiredLeasesUnknown", testLeaseExpiry},
		{"RenewKeepsLeaseAlive", testRenew},
		{"TickCancelsDrainedRun", testDrained},
		{"TickDrainTimeoutLeavesRunUnknown", testDrainTimeout},
		{"CarrierCutAtDeadlineIsADrainTimeout", testCarrierCutAtDeadline},
		{"ResolveReconcilesUnknownToCancelled", testResolve},
		{"LateResponseAfterDrainTimeoutIsRecorded", testLateResponse},
		{"EveryTransitionIsAudited", testAudit},
		{"CancelsAreBroadcast", testCancelsBroadcast},
		{"GuardRacingCancelNeverAdmitsAfterIt", testRace},
		{"GuardPastItsDeadlineRecordsNothing", testGuardFenced},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := open(t)
			t.Cleanup(func() { _ = s.Close() })
			tc.fn(t, s)
		})
	}
}

const lease = 30 * time.Second

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return c
}

func admit(t *testing.T, s state.Store, id string) state.Run {
	t.Helper()
	r, err := s.Admit(ctx(t), state.AdmitRequest{RunID: id, Actor: "test"})
	if err != nil {
		t.Fatalf("admit %s: %v", id, err)
	}
	return r.Run
}

func cancel(t *testing.T, s state.Store, id string, drain time.Duration) state.CancelResult {
	t.Helper()
	res, err := s.Cancel(ctx(t), state.CancelRequest{RunID: id, Actor: "operator:test", Reason: "stop pressed", DrainTimeout: drain})
	if err != nil {
		t.Fatalf("cancel %s: %v", id, err)
	}
	return res
}

func guard(t *testing.T, s state.Store, req state.GuardRequest) state.GuardResult {
	t.Helper()
	if req.Boundary == "" {
		req.Boundary = state.BoundaryHTTP
	}
	if req.LeaseTTL == 0 && req.NotBefore.IsZero() {
		req.LeaseTTL = lease
	}
	if req.Actor == "" {
		req.Actor = "proxy:test"
	}
	if req.LeaseOwner == "" {
		req.LeaseOwner = "proxy:test"
	}
	res, err := s.Guard(ctx(t), req)
	if err != nil {
		t.Fatalf("guard %+v: %v", req, err)
	}
	return res
}

func get(t *testing.T, s state.Store, id string) state.Run {
	t.Helper()
	r, err := s.Get(ctx(t), id)
	if err != nil {
		t.Fatalf("get %s: %v", id, err)
	}
	return r
}

func intent(t *testing.T, s state.Store, run, key string) state.Intent {
	t.Helper()
	in, err := s.Intent(ctx(t), run, key)
	if err != nil {
		t.Fatalf("intent %s/%s: %v", run, key, err)
	}
	return in
}

func finish(t *testing.T, s state.Store, in state.Intent, outcome state.IntentState, code int) state.Intent {
	t.Helper()
	out, err := s.Finish(ctx(t), state.FinishRequest{RunID: in.RunID, Key: in.Key, Attempt: in.Attempts, Outcome: outcome, StatusCode: code, Actor: "proxy:test"})
	if err != nil {
		t.Fatalf("finish %s as %s: %v", in.Key, outcome, err)
	}
	return out
}

func tick(t *testing.T, s state.Store, id string) state.Run {
	t.Helper()
	r, err := s.Tick(ctx(t), state.TickRequest{RunID: id, Actor: "sweeper:test"})
	if err != nil {
		t.Fatalf("tick %s: %v", id, err)
	}
	return r
}

func wantConflict(t *testing.T, err error, code string) *state.Conflict {
	t.Helper()
	var c *state.Conflict
	if !errors.As(err, &c) {
		t.Fatalf("got error %v, want a *state.Conflict %s", err, code)
	}
	if c.Code != code {
		t.Fatalf("got conflict %s, want %s (%v)", c.Code, code, err)
	}
	return c
}

func wantRun(t *testing.T, r state.Run, status state.Status, version int64) {
	t.Helper()
	if r.Status != status || r.CancelVersion != version {
		t.Fatalf("run %s is %s/%d, want %s/%d", r.ID, r.Status, r.CancelVersion, status, version)
	}
}

func wantCounts(t *testing.T, r state.Run, want map[state.IntentState]int) {
	t.Helper()
	got := map[state.IntentState]int{}
	for k, v := range r.Intents {
		if v != 0 {
			got[k] = v
		}
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("run %s intent counts %v, want %v", r.ID, got, want)
	}
}

func testAdmit(t *testing.T, s state.Store) {
	first, err := s.Admit(ctx(t), state.AdmitRequest{RunID: "run_1", Actor: "test"})
	if err != nil {
		t.Fatal(err)
	}
	r := first.Run
	wantRun(t, r, state.StatusActive, 1)
	if r.ID != "run_1" || r.CreatedAt.IsZero() || r.UpdatedAt.IsZero() {
		t.Fatalf("admitted row lacks id or times: %+v", r)
	}
	if !first.Created {
		t.Fatalf("the first admission of run_1 says it did not create the row")
	}
	second, err := s.Admit(ctx(t), state.AdmitRequest{RunID: "run_1", Actor: "test"})
	if err != nil {
		t.Fatal(err)
	}
	again := second.Run
	wantRun(t, again, state.StatusActive, 1)
	if second.Created {
		t.Fatalf("a repeated admission of an ACTIVE run says it created the row")
	}
	if !again.CreatedAt.Equal(r.CreatedAt) {
		t.Fatalf("re-admission rewrote created_at: %v then %v", r.CreatedAt, again.CreatedAt)
	}
	cancel(t, s, "run_1", time.Minute)
	_, err = s.Admit(ctx(t), state.AdmitRequest{RunID: "run_1", Actor: "test"})
	c := wantConflict(t, err, state.RefusalRunNotActive)
	wantRun(t, c.Run, state.StatusCancelling, 2)
}

func testAdmitInvalid(t *testing.T, s state.Store) {
	for _, id := range []string{"", "has space", "brace{tag}", string(make([]byte, 200)), "slash/run", ".", "..", "..."} {
		_, err := s.Admit(ctx(t), state.AdmitRequest{RunID: id, Actor: "test"})
		if !errors.Is(err, state.ErrInvalid) {
			t.Errorf("admit %q: got %v, want ErrInvalid", id, err)
		}
	}
}

func testCancel(t *testing.T, s state.Store) {
	admit(t, s, "r")
	before := time.Now()
	res := cancel(t, s, "r", time.Minute)
	if !res.Changed {
		t.Fatal("first cancel reported no change")
	}
	wantRun(t, res.Run, state.StatusCancelling, 2)
	if res.Run.Reason != "stop pressed" {
		t.Fatalf("reason %q not kept", res.Run.Reason)
	}
	if res.Run.CancelledAt.IsZero() {
		t.Fatal("cancelled_at not set")
	}
	if d := res.Run.DrainDeadline.Sub(before); d < 50*time.Second || d > 70*time.Second {
		t.Fatalf("drain deadline %v is %v after the cancel, want about a minute", res.Run.DrainDeadline, d)
	}
	again := cancel(t, s, "r", time.Minute)
	if again.Changed {
		t.Fatal("second cancel reported a change")
	}
	wantRun(t, again.Run, state.StatusCancelling, 2)
	wantRun(t, get(t, s, "r"), state.StatusCancelling, 2)

	admit(t, s, "done")
	if _, err := s.Complete(ctx(t), state.CompleteRequest{RunID: "done", Version: 1, Actor: "worker"}); err != nil {
		t.Fatal(err)
	}
	_, err := s.Cancel(ctx(t), state.CancelRequest{RunID: "done", Actor: "op"})
	wantConflict(t, err, state.RefusalRunNotActive)

	if _, err := s.Cancel(ctx(t), state.CancelRequest{RunID: "r", Actor: "op", DrainTimeout: -time.Second}); !errors.Is(err, state.ErrInvalid) {
		t.Fatalf("negative drain: got %v, want ErrInvalid", err)
	}
}

func testTombstone(t *testing.T, s state.Store) {
	res := cancel(t, s, "ghost", time.Minute)
	if !res.Changed {
		t.Fatal("tombstone reported no change")
	}
	wantRun(t, res.Run, state.StatusCancelled, 2)
	_, err := s.Admit(ctx(t), state.AdmitRequest{RunID: "ghost", Actor: "test"})
	wantConflict(t, err, state.RefusalRunNotActive)
	wantRun(t, get(t, s, "ghost"), state.StatusCancelled, 2)
}

func testComplete(t *testing.T, s state.Store) {
	admit(t, s, "c")
	_, err := s.Complete(ctx(t), state.CompleteRequest{RunID: "c", Version: 2, Actor: "worker"})
	wantConflict(t, err, state.RefusalStaleVersion)
	r, err := s.Complete(ctx(t), state.CompleteRequest{RunID: "c", Version: 1, Actor: "worker"})
	if err != nil {
		t.Fatal(err)
	}
	wantRun(t, r, state.StatusCompleted, 1)
	_, err = s.Complete(ctx(t), state.CompleteRequest{RunID: "c", Version: 1, Actor: "worker"})
	wantConflict(t, err, state.RefusalRunNotActive)
	_, err = s.Complete(ctx(t), state.CompleteRequest{RunID: "nobody", Version: 1, Actor: "worker"})
	if !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("complete unseen: got %v, want ErrNotFound", err)
	}
}

func testList(t *testing.T, s state.Store) {
	if _, err := s.Get(ctx(t), "missing"); !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("get missing: got %v, want ErrNotFound", err)
	}
	admit(t, s, "b")
	admit(t, s, "a")
	admit(t, s, "c")
	cancel(t, s, "b", time.Minute)
	cancel(t, s, "t", time.Minute)
	ids := func(rs []state.Run) []string {
		var out []string
		for _, r := range rs {
			out = append(out, r.ID)
		}
		return out
	}
	for _, tc := range []struct {
		status state.Status
		want   []string
	}{
		{"", []string{"a", "b", "c", "t"}},
		{state.StatusActive, []string{"a", "c"}},
		{state.StatusCancelling, []string{"b"}},
		{state.StatusCancelled, []string{"t"}},
		{state.StatusCompleted, nil},
	} {
		rs, err := s.List(ctx(t), tc.status)
		if err != nil {
			t.Fatal(err)
		}
		if got := ids(rs); !slices.Equal(got, tc.want) {
			t.Errorf("list %q = %v, want %v", tc.status, got, tc.want)
		}
	}
	live, err := s.LiveRuns(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(live)
	if !slices.Equal(live, []string{"a", "b", "c"}) {
		t.Fatalf("live runs %v, want [a b c]", live)
	}
}

func testGuardAdmits(t *testing.T, s state.Store) {
	admit(t, s, "g")
	res := guard(t, s, state.GuardRequest{RunID: "g", ObservedVersion: 1, Key: "k1", ExplicitKey: true, Method: "POST", Target: "https://api.example/charge", BodyDigest: "d1"})
	if !res.Admitted || res.Refusal != "" {
		t.Fatalf("guard refused an ACTIVE run at its version: %+v", res)
	}
	in := res.Intent
	if in.State != state.IntentInFlight || in.Attempts != 1 || in.Key != "k1" || in.Method != "POST" || in.Target != "https://api.example/charge" || in.BodyDigest != "d1" || in.Boundary != state.BoundaryHTTP {
		t.Fatalf("intent as written: %+v", in)
	}
	if in.LeaseOwner != "proxy:test" || in.LeaseExpires.Before(time.Now().Add(20*time.Second)) {
		t.Fatalf("intent lease: owner %q expires %v", in.LeaseOwner, in.LeaseExpires)
	}
	if got := intent(t, s, "g", "k1"); got.State != state.IntentInFlight || got.Attempts != 1 {
		t.Fatalf("stored intent %+v", got)
	}
	noVersion := guard(t, s, state.GuardRequest{RunID: "g", Key: "k2", ExplicitKey: true})
	if !noVersion.Admitted {
		t.Fatalf("guard without observed version refused an ACTIVE run: %+v", noVersion)
	}
	wantCounts(t, get(t, s, "g"), map[state.IntentState]int{state.IntentInFlight: 2})
	if _, err := s.Guard(ctx(t), state.GuardRequest{RunID: "g", Key: "", Boundary: state.BoundaryHTTP, LeaseTTL: lease}); !errors.Is(err, state.ErrInvalid) {
		t.Fatalf("empty key: got %v, want ErrInvalid", err)
	}
	if _, err := s.Guard(ctx(t), state.GuardRequest{RunID: "g", Key: "k", Boundary: "carrier-pigeon", LeaseTTL: lease}); !errors.Is(err, state.ErrInvalid) {
		t.Fatalf("bad boundary: got %v, want ErrInvalid", err)
	}
}

func testGuardRefusesAfterCancel(t *testing.T, s state.Store) {
	admit(t, s, "x")
	cancel(t, s, "x", time.Minute)
	res := guard(t, s, state.GuardRequest{RunID: "x", ObservedVersion: 1, Key: "late", ExplicitKey: true, Method: "POST", Target: "https://api.example/x"})
	if res.Admitted || res.Refusal != state.RefusalRunNotActive {
		t.Fatalf("guard after cancel: %+v", res)
	}
	wantRun(t, res.Run, state.StatusCancelling, 2)
	if res.Intent.State != state.IntentCancelledBeforeDispatch || res.Intent.Key != "late" || res.Intent.ObservedVersion != 1 {
		t.Fatalf("refused intent %+v", res.Intent)
	}
	wantCounts(t, get(t, s, "x"), map[state.IntentState]int{state.IntentCancelledBeforeDispatch: 1})
}

func testGuardStale(t *testing.T, s state.Store) {
	admit(t, s, "v")
	res := guard(t, s, state.GuardRequest{RunID: "v", ObservedVersion: 7, Key: "k", ExplicitKey: true})
	if res.Admitted || res.Refusal != state.RefusalStaleVersion || res.Intent.State != state.IntentCancelledBeforeDispatch {
		t.Fatalf("guard at a version the run never had: %+v", res)
	}
	cancel(t, s, "v", time.Minute)
	res = guard(t, s, state.GuardRequest{RunID: "v", ObservedVersion: 2, Key: "k2", ExplicitKey: true})
	if res.Admitted || res.Refusal != state.RefusalRunNotActive {
		t.Fatalf("guard at the cancelled version: %+v", res)
	}
}

func testGuardAutoAdmit(t *testing.T, s state.Store) {
	res := guard(t, s, state.GuardRequest{RunID: "new", Key: "k", ExplicitKey: true})
	if res.Admitted || res.Refusal != state.RefusalRunNotAdmitted {
		t.Fatalf("guard of unseen run without auto-admit: %+v", res)
	}
	if _, err := s.Get(ctx(t), "new"); !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("refusal of an unseen run wrote a row: %v", err)
	}
	res = guard(t, s, state.GuardRequest{RunID: "new", ObservedVersion: 1, Key: "k", ExplicitKey: true, AutoAdmit: true})
	if !res.Admitted {
		t.Fatalf("auto-admit refused: %+v", res)
	}
	wantRun(t, get(t, s, "new"), state.StatusActive, 1)

	cancel(t, s, "tomb", time.Minute)
	res = guard(t, s, state.GuardRequest{RunID: "tomb", Key: "k", ExplicitKey: true, AutoAdmit: true})
	if res.Admitted || res.Refusal != state.RefusalRunNotActive {
		t.Fatalf("auto-admit resurrected a tombstone: %+v", res)
	}
	wantRun(t, get(t, s, "tomb"), state.StatusCancelled, 2)
}

func testDerivedKeys(t *testing.T, s state.Store) {
	admit(t, s, "d")
	var keys []string
	for range 3 {
		res := guard(t, s, state.GuardRequest{RunID: "d", Key: "base", Method: "GET", Target: "http://x/"})
		if !res.Admitted {
			t.Fatalf("identical derived request refused: %+v", res)
		}
		keys = append(keys, res.Intent.Key)
		if res.Intent.Attempts != 1 {
			t.Fatalf("derived record %s has %d attempts, want 1", res.Intent.Key, res.Intent.Attempts)
		}
	}
	if !slices.Equal(keys, []string{"base", "base.2", "base.3"}) {
		t.Fatalf("derived keys %v, want [base base.2 base.3]", keys)
	}
	cancel(t, s, "d", time.Minute)
	res := guard(t, s, state.GuardRequest{RunID: "d", Key: "base"})
	if res.Admitted || res.Intent.Key != "base.4" || res.Intent.State != state.IntentCancelledBeforeDispatch {
		t.Fatalf("refused derived request: %+v", res)
	}
}

func testExplicitKey(t *testing.T, s state.Store) {
	admit(t, s, "e")
	first := guard(t, s, state.GuardRequest{RunID: "e", Key: "idem", ExplicitKey: true, BodyDigest: "A"})
	dup := guard(t, s, state.GuardRequest{RunID: "e", Key: "idem", ExplicitKey: true, BodyDigest: "A"})
	if dup.Admitted || dup.Refusal != state.RefusalInProgress || dup.Intent.State != state.IntentInFlight {
		t.Fatalf("duplicate while in flight: %+v", dup)
	}
	finish(t, s, first.Intent, state.IntentResponded, 201)
	other := guard(t, s, state.GuardRequest{RunID: "e", Key: "idem", ExplicitKey: true, BodyDigest: "B"})
	if other.Admitted || other.Refusal != state.RefusalKeyReused {
		t.Fatalf("same key, other body: %+v", other)
	}
	again := guard(t, s, state.GuardRequest{RunID: "e", Key: "idem", ExplicitKey: true, BodyDigest: "A"})
	if !again.Admitted || again.Intent.Attempts != 2 || again.Intent.State != state.IntentInFlight {
		t.Fatalf("replay after RESPONDED: %+v", again)
	}
	finish(t, s, again.Intent, state.IntentUnknown, 0)
	stuck := guard(t, s, state.GuardRequest{RunID: "e", Key: "idem", ExplicitKey: true, BodyDigest: "A"})
	if stuck.Admitted || stuck.Refusal != state.RefusalInProgress {
		t.Fatalf("replay of an UNKNOWN: %+v", stuck)
	}
	cancel(t, s, "e", time.Minute)
	refused := guard(t, s, state.GuardRequest{RunID: "e", Key: "idem", ExplicitKey: true, BodyDigest: "A"})
	if refused.Admitted || refused.Refusal != state.RefusalRunNotActive {
		t.Fatalf("replay after cancel: %+v", refused)
	}
	kept := intent(t, s, "e", "idem")
	if kept.State != state.IntentUnknown || kept.Attempts != 2 || kept.Refusals != 1 {
		t.Fatalf("a refused replay must not overwrite what happened: %+v", kept)
	}
}

func testAllowCancelling(t *testing.T, s state.Store) {
	admit(t, s, "w")
	cancel(t, s, "w", time.Minute)
	res := guard(t, s, state.GuardRequest{RunID: "w", ObservedVersion: 1, Key: "hook", ExplicitKey: true, Boundary: state.BoundaryDelivery, AllowCancelling: true})
	if !res.Admitted {
		t.Fatalf("delivery of a CANCELLING run refused: %+v", res)
	}
	finish(t, s, res.Intent, state.IntentResponded, 200)
	if r := tick(t, s, "w"); r.Status != state.StatusCancelled {
		t.Fatalf("drained run is %s", r.Status)
	}
	res = guard(t, s, state.GuardRequest{RunID: "w", Key: "hook2", ExplicitKey: true, Boundary: state.BoundaryDelivery, AllowCancelling: true})
	if res.Admitted || res.Refusal != state.RefusalRunNotActive {
		t.Fatalf("delivery of a CANCELLED run: %+v", res)
	}
}

func testRetriesRevoked(t *testing.T, s state.Store) {
	admit(t, s, "rt")
	when := time.Now().Add(time.Hour)
	for _, k := range []string{"retry:s1:2", "retry:s2:2"} {
		res := guard(t, s, state.GuardRequest{RunID: "rt", ObservedVersion: 1, Key: k, ExplicitKey: true, Boundary: state.BoundaryRetry, NotBefore: when})
		if !res.Admitted || res.Intent.State != state.IntentScheduled || res.Intent.NotBefore.Sub(when).Abs() > time.Millisecond {
			t.Fatalf("scheduled retry: %+v", res)
		}
	}
	wantCounts(t, get(t, s, "rt"), map[state.IntentState]int{state.IntentScheduled: 2})
	res := cancel(t, s, "rt", time.Minute)
	wantCounts(t, res.Run, map[state.IntentState]int{state.IntentRevoked: 2})
	for _, k := range []string{"retry:s1:2", "retry:s2:2"} {
		if in := intent(t, s, "rt", k); in.State != state.IntentRevoked {
			t.Fatalf("retry %s after cancel: %s", k, in.State)
		}
	}
	late := guard(t, s, state.GuardRequest{RunID: "rt", ObservedVersion: 1, Key: "retry:s3:2", ExplicitKey: true, Boundary: state.BoundaryRetry, NotBefore: when})
	if late.Admitted || late.Intent.State != state.IntentCancelledBeforeDispatch {
		t.Fatalf("retry scheduled after cancel: %+v", late)
	}
}

func testRetryDispatched(t *testing.T, s state.Store) {
	admit(t, s, "rd")
	retry := state.GuardRequest{RunID: "rd", ObservedVersion: 1, Key: "retry:s1:2", ExplicitKey: true, Boundary: state.BoundaryRetry, NotBefore: time.Now().Add(time.Minute)}
	guard(t, s, retry)
	if again := guard(t, s, retry); again.Admitted || again.Refusal != state.RefusalInProgress {
		t.Fatalf("scheduling the same retry twice: %+v", again)
	}
	// Its time has come: the same key, guarded without a time, is its dispatch.
	dispatch := retry
	dispatch.NotBefore = time.Time{}
	res := guard(t, s, dispatch)
	if !res.Admitted || res.Intent.State != state.IntentInFlight || res.Intent.LeaseOwner == "" {
		t.Fatalf("dispatching a scheduled retry: %+v", res)
	}
	wantCounts(t, get(t, s, "rd"), map[state.IntentState]int{state.IntentInFlight: 1})
	finish(t, s, res.Intent, state.IntentResponded, 200)
	// A cancel revokes nothing that already ran.
	guard(t, s, state.GuardRequest{RunID: "rd", ObservedVersion: 1, Key: "retry:s2:2", ExplicitKey: true, Boundary: state.BoundaryRetry, NotBefore: time.Now().Add(time.Minute)})
	r := cancel(t, s, "rd", time.Minute).Run
	wantCounts(t, r, map[state.IntentState]int{state.IntentResponded: 1, state.IntentRevoked: 1})
	late := dispatch
	late.Key = "retry:s2:2"
	if res := guard(t, s, late); res.Admitted || res.Refusal != state.RefusalRunNotActive {
		t.Fatalf("dispatching a revoked retry: %+v", res)
	}
	if in := intent(t, s, "rd", "retry:s2:2"); in.State != state.IntentRevoked || in.Refusals != 1 {
		t.Fatalf("the revoked retry after a refused dispatch: %+v", in)
	}
}

func testFinish(t *testing.T, s state.Store) {
	admit(t, s, "f")
	res := guard(t, s, state.GuardRequest{RunID: "f", Key: "k", ExplicitKey: true})
	_, err := s.Finish(ctx(t), state.FinishRequest{RunID: "f", Key: "k", Attempt: 2, Outcome: state.IntentResponded, StatusCode: 200, Actor: "p"})
	wantConflict(t, err, state.ConflictStaleAttempt)
	out := finish(t, s, res.Intent, state.IntentResponded, 204)
	if out.State != state.IntentResponded || out.StatusCode != 204 || out.LeaseOwner != "" {
		t.Fatalf("finished intent %+v", out)
	}
	_, err = s.Finish(ctx(t), state.FinishRequest{RunID: "f", Key: "k", Attempt: 1, Outcome: state.IntentNotSent, Actor: "p"})
	wantConflict(t, err, state.ConflictNotInFlight)
	_, err = s.Finish(ctx(t), state.FinishRequest{RunID: "f", Key: "nope", Attempt: 1, Outcome: state.IntentNotSent, Actor: "p"})
	if !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("finish of missing intent: %v", err)
	}
	_, err = s.Finish(ctx(t), state.FinishRequest{RunID: "f", Key: "k", Attempt: 1, Outcome: state.IntentApplied, Actor: "p"})
	if !errors.Is(err, state.ErrInvalid) {
		t.Fatalf("finish as APPLIED: got %v, want ErrInvalid", err)
	}
	ns := guard(t, s, state.GuardRequest{RunID: "f", Key: "k2", ExplicitKey: true})
	finish(t, s, ns.Intent, state.IntentNotSent, 0)
	wantCounts(t, get(t, s, "f"), map[state.IntentState]int{state.IntentResponded: 1, state.IntentNotSent: 1})
}

func testLeaseExpiry(t *testing.T, s state.Store) {
	admit(t, s, "l")
	short := guard(t, s, state.GuardRequest{RunID: "l", Key: "short", ExplicitKey: true, LeaseTTL: 50 * time.Millisecond})
	guard(t, s, state.GuardRequest{RunID: "l", Key: "long", ExplicitKey: true})
	time.Sleep(120 * time.Millisecond)
	r := tick(t, s, "l")
	wantRun(t, r, state.StatusActive, 1)
	wantCounts(t, r, map[state.IntentState]int{state.IntentUnknown: 1, state.IntentInFlight: 1})
	in := intent(t, s, "l", "short")
	if in.State != state.IntentUnknown || in.Reason != "lease_expired" {
		t.Fatalf("expired intent %+v", in)
	}
	_, err := s.Finish(ctx(t), state.FinishRequest{RunID: "l", Key: "short", Attempt: short.Intent.Attempts, Outcome: state.IntentNotSent, Actor: "p"})
	wantConflict(t, err, state.ConflictNotInFlight)
}

func testRenew(t *testing.T, s state.Store) {
	admit(t, s, "n")
	res := guard(t, s, state.GuardRequest{RunID: "n", Key: "k", ExplicitKey: true, LeaseTTL: 150 * time.Millisecond, LeaseOwner: "me"})
	other := guard(t, s, state.GuardRequest{RunID: "n", Key: "k2", ExplicitKey: true, LeaseTTL: 150 * time.Millisecond, LeaseOwner: "them"})
	renewed, err := s.Renew(ctx(t), state.RenewRequest{Owner: "me", TTL: time.Minute,
		Refs: []state.IntentRef{{RunID: "n", Key: "k"}, {RunID: "n", Key: "k2"}, {RunID: "n", Key: "missing"}, {RunID: "unseen", Key: "k"}}})
	if err != nil {
		t.Fatal(err)
	}
	if in, ok := renewed.Holds(state.IntentRef{RunID: "n", Key: "k"}); !ok || !in.LeaseExpires.After(res.Intent.LeaseExpires) {
		t.Fatalf("the owner's lease is not reported renewed: %+v", renewed)
	}
	for _, ref := range []state.IntentRef{{RunID: "n", Key: other.Intent.Key}, {RunID: "n", Key: "missing"}, {RunID: "unseen", Key: "k"}} {
		if _, ok := renewed.Holds(ref); ok {
			t.Fatalf("renewal reports %v renewed: %+v", ref, renewed)
		}
	}
	if len(renewed.Renewed) != 1 {
		t.Fatalf("renewal reports %d leases renewed, want 1: %+v", len(renewed.Renewed), renewed.Renewed)
	}
	if row, ok := renewed.Runs["n"]; !ok || row.Status != state.StatusActive || row.CancelVersion != 1 {
		t.Fatalf("renewal does not report the run's row: %+v", renewed.Runs)
	}
	if _, ok := renewed.Runs["unseen"]; ok {
		t.Fatalf("renewal reports a row for a run never seen: %+v", renewed.Runs)
	}
	cancel(t, s, "n", time.Minute)
	renewed, err = s.Renew(ctx(t), state.RenewRequest{Owner: "me", TTL: time.Minute, Refs: []state.IntentRef{{RunID: "n", Key: "k"}}})
	if err != nil {
		t.Fatal(err)
	}
	if row := renewed.Runs["n"]; row.Status != state.StatusCancelling || row.CancelVersion != 2 {
		t.Fatalf("after the cancel, renewal reports the row %+v, want CANCELLING at 2", row)
	}
	time.Sleep(250 * time.Millisecond)
	tick(t, s, "n")
	if in := intent(t, s, "n", "k"); in.State != state.IntentInFlight || !in.LeaseExpires.After(res.Intent.LeaseExpires) {
		t.Fatalf("renewed intent %+v", in)
	}
	if in := intent(t, s, "n", "k2"); in.State != state.IntentUnknown {
		t.Fatalf("another owner's lease was renewed: %+v", in)
	}
}

func testDrained(t *testing.T, s state.Store) {
	admit(t, s, "dr")
	res := guard(t, s, state.GuardRequest{RunID: "dr", Key: "k", ExplicitKey: true})
	cancel(t, s, "dr", time.Minute)
	wantRun(t, tick(t, s, "dr"), state.StatusCancelling, 2)
	finish(t, s, res.Intent, state.IntentResponded, 200)
	r := get(t, s, "dr")
	if r.Status == state.StatusCancelling {
		r = tick(t, s, "dr")
	}
	wantRun(t, r, state.StatusCancelled, 2)
	if r.Reason != "stop pressed" {
		t.Fatalf("the cancel's reason was replaced: %q", r.Reason)
	}
	live, err := s.LiveRuns(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(live, "dr") {
		t.Fatalf("cancelled run still live: %v", live)
	}
}

func testDrainTimeout(t *testing.T, s state.Store) {
	admit(t, s, "dt")
	guard(t, s, state.GuardRequest{RunID: "dt", Key: "slow", ExplicitKey: true})
	cancel(t, s, "dt", 50*time.Millisecond)
	time.Sleep(120 * time.Millisecond)
	r := tick(t, s, "dt")
	wantRun(t, r, state.StatusUnknown, 2)
	wantCounts(t, r, map[state.IntentState]int{state.IntentUnknown: 1})
	if in := intent(t, s, "dt", "slow"); in.State != state.IntentUnknown || in.Reason != "drain_timeout" {
		t.Fatalf("in-flight intent at the deadline: %+v", in)
	}
	evs, err := s.Events(ctx(t), "dt")
	if err != nil {
		t.Fatal(err)
	}
	last := evs[len(evs)-1]
	if last.Kind != state.EventRunTransition || last.To != string(state.StatusUnknown) || last.Reason != "drain_timeout" {
		t.Fatalf("last event %+v, want the run's move to UNKNOWN for drain_timeout", last)
	}
}

func testCarrierCutAtDeadline(t *testing.T, s state.Store) {
	admit(t, s, "cc")
	res := guard(t, s, state.GuardRequest{RunID: "cc", Key: "slow", ExplicitKey: true})
	cancel(t, s, "cc", 30*time.Millisecond)
	time.Sleep(60 * time.Millisecond)
	// The carrier saw the deadline before any tick did.
	finish(t, s, res.Intent, state.IntentUnknown, 0)
	r := get(t, s, "cc")
	if r.Status != state.StatusUnknown || r.StatusReason != "drain_timeout" {
		t.Fatalf("run %s (%s), want UNKNOWN (drain_timeout)", r.Status, r.StatusReason)
	}
}

func testResolve(t *testing.T, s state.Store) {
	admit(t, s, "rs")
	a := guard(t, s, state.GuardRequest{RunID: "rs", Key: "a", ExplicitKey: true})
	b := guard(t, s, state.GuardRequest{RunID: "rs", Key: "b", ExplicitKey: true})
	finish(t, s, a.Intent, state.IntentUnknown, 0)
	_, err := s.Resolve(ctx(t), state.ResolveRequest{RunID: "rs", Key: "b", Applied: true, Source: "operator", Actor: "op"})
	wantConflict(t, err, state.ConflictNotUnknown)
	finish(t, s, b.Intent, state.IntentResponded, 200)
	cancel(t, s, "rs", time.Minute)
	r := tick(t, s, "rs")
	wantRun(t, r, state.StatusUnknown, 2)
	if r.StatusReason != "unresolved_intents" {
		t.Fatalf("status reason %q, want unresolved_intents", r.StatusReason)
	}
	if _, err := s.Resolve(ctx(t), state.ResolveRequest{RunID: "rs", Key: "a", Applied: false, Actor: "op"}); !errors.Is(err, state.ErrInvalid) {
		t.Fatalf("resolve without source: got %v, want ErrInvalid", err)
	}
	in, err := s.Resolve(ctx(t), state.ResolveRequest{RunID: "rs", Key: "a", Applied: false, Source: "operator", Note: "provider shows no charge", Actor: "op:alice"})
	if err != nil {
		t.Fatal(err)
	}
	if in.State != state.IntentNotApplied || in.Source != "operator" || in.Note != "provider shows no charge" {
		t.Fatalf("resolved intent %+v", in)
	}
	r = get(t, s, "rs")
	if r.Status == state.StatusUnknown {
		r = tick(t, s, "rs")
	}
	wantRun(t, r, state.StatusCancelled, 2)
	if r.StatusReason != "reconciled" {
		t.Fatalf("status reason %q, want reconciled", r.StatusReason)
	}
}

func testLateResponse(t *testing.T, s state.Store) {
	admit(t, s, "lr")
	res := guard(t, s, state.GuardRequest{RunID: "lr", Key: "k", ExplicitKey: true})
	cancel(t, s, "lr", 10*time.Millisecond)
	time.Sleep(50 * time.Millisecond)
	wantRun(t, tick(t, s, "lr"), state.StatusUnknown, 2)
	out := finish(t, s, res.Intent, state.IntentResponded, 200)
	if out.State != state.IntentResponded {
		t.Fatalf("late response: %+v", out)
	}
	r := get(t, s, "lr")
	if r.Status == state.StatusUnknown {
		r = tick(t, s, "lr")
	}
	wantRun(t, r, state.StatusCancelled, 2)
}

func testAudit(t *testing.T, s state.Store) {
	admit(t, s, "au")
	g := guard(t, s, state.GuardRequest{RunID: "au", Key: "k", ExplicitKey: true})
	finish(t, s, g.Intent, state.IntentResponded, 200)
	cancel(t, s, "au", time.Minute)
	guard(t, s, state.GuardRequest{RunID: "au", Key: "k2", ExplicitKey: true})
	tick(t, s, "au")
	evs, err := s.Events(ctx(t), "au")
	if err != nil {
		t.Fatal(err)
	}
	var kinds []string
	for i, e := range evs {
		kinds = append(kinds, e.Kind)
		if e.At.IsZero() || e.Actor == "" || e.RunID != "au" {
			t.Errorf("event %d lacks time, actor or run: %+v", i, e)
		}
		if i > 0 && e.At.Before(evs[i-1].At) {
			t.Errorf("event %d is older than the one before it", i)
		}
	}
	want := []string{state.EventRunAdmitted, state.EventIntentAdmitted, state.EventIntentOutcome, state.EventRunCancelled, state.EventIntentRefused, state.EventRunTransition}
	if !slices.Equal(kinds, want) {
		t.Fatalf("events %v, want %v", kinds, want)
	}
	c := evs[3]
	if c.Actor != "operator:test" || c.Reason != "stop pressed" || c.From != "ACTIVE" || c.To != "CANCELLING" || c.Version != 2 {
		t.Fatalf("cancel event %+v", c)
	}
	if evs[4].Intent != "k2" || evs[4].To != string(state.IntentCancelledBeforeDispatch) || evs[4].Reason != state.RefusalRunNotActive {
		t.Fatalf("refusal event %+v", evs[4])
	}
	ins, err := s.Intents(ctx(t), "au")
	if err != nil {
		t.Fatal(err)
	}
	if len(ins) != 2 || ins[0].Key != "k" || ins[1].Key != "k2" {
		t.Fatalf("intents %+v, want k then k2", ins)
	}
	if _, err := s.Events(ctx(t), "nobody"); !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("events of an unseen run: got %v, want ErrNotFound", err)
	}
}

func testCancelsBroadcast(t *testing.T, s state.Store) {
	c, stop := context.WithCancel(ctx(t))
	defer stop()
	ch, err := s.Cancels(c)
	if err != nil {
		t.Fatal(err)
	}
	admit(t, s, "bc")
	cancel(t, s, "bc", time.Minute)
	select {
	case id := <-ch:
		if id != "bc" {
			t.Fatalf("broadcast %q, want bc", id)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no cancel broadcast within 5s")
	}
}

// testRace guards dispatches from many goroutines while a cancel lands. The
// store's own order (the audit log) must show every admitted guard before the
// cancel and every refused one after it, and a guard that started after the
// cancel returned must be refused.
func testRace(t *testing.T, s state.Store) {
	const workers, perWorker = 8, 12
	rounds := 5
	if v := os.Getenv("STOPGATE_RACE_ROUNDS"); v != "" {
		if _, err := fmt.Sscan(v, &rounds); err != nil || rounds < 1 {
			t.Fatalf("STOPGATE_RACE_ROUNDS=%q: want a whole number of 1 or more", v)
		}
	}
	for round := range rounds {
		run := fmt.Sprintf("race%d", round)
		admit(t, s, run)
		var wg sync.WaitGroup
		var mu sync.Mutex
		var cancelReturned time.Time
		type outcome struct {
			admitted bool
			started  time.Time
		}
		var outcomes []outcome
		for w := range workers {
			wg.Go(func() {
				for i := range perWorker {
					started := time.Now()
					res, err := s.Guard(ctx(t), state.GuardRequest{RunID: run, ObservedVersion: 1, Key: fmt.Sprintf("w%d-%d", w, i), ExplicitKey: true, Boundary: state.BoundaryHTTP, LeaseTTL: lease, LeaseOwner: "p", Actor: "p"})
					if err != nil {
						t.Errorf("guard: %v", err)
						return
					}
					mu.Lock()
					outcomes = append(outcomes, outcome{res.Admitted, started})
					mu.Unlock()
				}
			})
		}
		wg.Go(func() {
			time.Sleep(time.Duration(round%10) * 2 * time.Millisecond)
			cancel(t, s, run, time.Minute)
			mu.Lock()
			cancelReturned = time.Now()
			mu.Unlock()
		})
		wg.Wait()
		admitted := 0
		for _, o := range outcomes {
			if o.admitted {
				admitted++
				if o.started.After(cancelReturned) {
					t.Fatalf("%s: a guard that started after the cancel returned was admitted", run)
				}
			}
		}
		evs, err := s.Events(ctx(t), run)
		if err != nil {
			t.Fatal(err)
		}
		seenCancel, admittedEvents, refusedEvents := false, 0, 0
		for _, e := range evs {
			switch e.Kind {
			case state.EventRunCancelled:
				seenCancel = true
			case state.EventIntentAdmitted:
				admittedEvents++
				if seenCancel {
					t.Fatalf("%s: intent %s admitted after the cancel committed", run, e.Intent)
				}
			case state.EventIntentRefused:
				refusedEvents++
				if !seenCancel {
					t.Fatalf("%s: intent %s refused before the cancel committed", run, e.Intent)
				}
			}
		}
		if admittedEvents != admitted || admittedEvents+refusedEvents != workers*perWorker {
			t.Fatalf("%s: %d admitted and %d refused in the log, %d admitted to callers, %d calls", run, admittedEvents, refusedEvents, admitted, workers*perWorker)
		}
		r := get(t, s, run)
		wantCounts(t, r, nonZero(map[state.IntentState]int{state.IntentInFlight: admitted, state.IntentCancelledBeforeDispatch: workers*perWorker - admitted}))
	}
}

func nonZero(m map[state.IntentState]int) map[state.IntentState]int {
	for k, v := range m {
		if v == 0 {
			delete(m, k)
		}
	}
	return m
}

// testGuardFenced: a guard whose caller's deadline (NotAfter) has passed by
// the store's clock is refused as the store being unavailable, and leaves
// no intent, no lease, no event and no row behind; the same key is then
// admitted by a guard in time.
func testGuardFenced(t *testing.T, s state.Store) {
	admit(t, s, "fence")
	late := state.GuardRequest{RunID: "fence", ObservedVersion: 1, Key: "pay-1", ExplicitKey: true, Boundary: state.BoundaryHTTP,
		Method: "POST", Target: "https://api.example/pay", LeaseTTL: lease, LeaseOwner: "p", Actor: "p",
		NotAfter: time.Now().Add(-time.Second)}
	res, err := s.Guard(ctx(t), late)
	if !errors.Is(err, state.ErrUnavailable) {
		t.Fatalf("guard past its deadline: got %+v, %v; want an error wrapping ErrUnavailable", res, err)
	}
	if _, err := s.Intent(ctx(t), "fence", "pay-1"); !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("a late guard left an intent (%v)", err)
	}
	wantCounts(t, get(t, s, "fence"), map[state.IntentState]int{})
	evs, err := s.Events(ctx(t), "fence")
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 1 || evs[0].Kind != state.EventRunAdmitted {
		t.Fatalf("a late guard left events: %+v", evs)
	}
	derived := late
	derived.ExplicitKey, derived.Key = false, "base"
	if _, err := s.Guard(ctx(t), derived); !errors.Is(err, state.ErrUnavailable) {
		t.Fatalf("derived guard past its deadline: %v, want ErrUnavailable", err)
	}
	auto := late
	auto.RunID, auto.AutoAdmit = "fence-new", true
	if _, err := s.Guard(ctx(t), auto); !errors.Is(err, state.ErrUnavailable) {
		t.Fatalf("auto-admitting guard past its deadline: %v, want ErrUnavailable", err)
	}
	if _, err := s.Get(ctx(t), "fence-new"); !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("a late auto-admitting guard created the run (%v)", err)
	}

	inTime := late
	inTime.NotAfter = time.Now().Add(time.Minute)
	ok := guard(t, s, inTime)
	if !ok.Admitted || ok.Intent.Key != "pay-1" || ok.Intent.Attempts != 1 {
		t.Fatalf("the same key guarded in time: %+v", ok)
	}
	// The derived base was never used: the first dispatch in time is base.
	derived.NotAfter = inTime.NotAfter
	if d := guard(t, s, derived); !d.Admitted || d.Intent.Key != "base" {
		t.Fatalf("derived guard in time after a late one: %+v", d)
	}
}
