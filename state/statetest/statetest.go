// Package statetest is the conformance suite every state.Store passes: the
// same behaviours, the same answers, whichever store is behind it.
package statetest

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"reflect"
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
		{"GuardRecordsTheEdgesRefusal", testGuardRefuse},
		{"DerivedKeysGiveEachDispatchItsOwnRecord", testDerivedKeys},
		{"ExplicitKeyFollowsIdempotencyRules", testExplicitKey},
		{"AnIntentsRecordIsWrittenOncePerDispatch", testRecordWrittenOncePerDispatch},
		{"DeliveryMayReachCancellingRunOnly", testAllowCancelling},
		{"CancelRevokesScheduledRetries", testRetriesRevoked},
		{"ScheduledRetryIsDispatchedThroughTheGuard", testRetryDispatched},
		{"FinishRecordsOutcomeOfLatestAttempt", testFinish},
		{"FinishLaterIsReadAndOrderedAsAFinish", testFinishLater},
		{"FinishLaterAnswersWhatFinishWould", testFinishLaterAnswers},
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
		{"FinishNotAppliedSettlesACutRequest", testFinishNotApplied},
		{"NoteAppendsAnEventAndChangesNothing", testNote},
		{"DrainingRunsAreCancellingAndUnknown", testDrainingRuns},
		{"ActiveRunsArePagedInIDOrder", testActiveRuns},
		{"PruneKeepsTheTombstoneAndDropsTheRecord", testPrune},
		{"PruneTakesRecordsWrittenAfterAPrune", testPruneAgain},
		{"TextsComeBackAsTheyWereWritten", testTexts},
		{"TotalsFollowEveryTransition", testTotals},
	}
	tests = append(tests, budgetTests...)
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
	draining, err := s.DrainingRuns(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(draining, []string{"b"}) {
		t.Fatalf("draining runs %v, want [b]", draining)
	}
	active, err := s.ActiveRuns(ctx(t), "", 10)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(active, []string{"a", "c"}) {
		t.Fatalf("active runs %v, want [a c]", active)
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
	first := guard(t, s, state.GuardRequest{RunID: "e", Key: "idem", ExplicitKey: true, Method: "POST", Target: "https://pay.example/charge", BodyDigest: "A"})
	dup := guard(t, s, state.GuardRequest{RunID: "e", Key: "idem", ExplicitKey: true, Method: "POST", Target: "https://pay.example/charge", BodyDigest: "A"})
	if dup.Admitted || dup.Refusal != state.RefusalInProgress || dup.Intent.State != state.IntentInFlight {
		t.Fatalf("duplicate while in flight: %+v", dup)
	}
	finish(t, s, first.Intent, state.IntentUnknown, 0)
	stuck := guard(t, s, state.GuardRequest{RunID: "e", Key: "idem", ExplicitKey: true, Method: "POST", Target: "https://pay.example/charge", BodyDigest: "A"})
	if stuck.Admitted || stuck.Refusal != state.RefusalInProgress {
		t.Fatalf("replay of an UNKNOWN: %+v", stuck)
	}
	cancel(t, s, "e", time.Minute)
	refused := guard(t, s, state.GuardRequest{RunID: "e", Key: "idem", ExplicitKey: true, Method: "POST", Target: "https://pay.example/charge", BodyDigest: "A"})
	if refused.Admitted || refused.Refusal != state.RefusalRunNotActive {
		t.Fatalf("replay after cancel: %+v", refused)
	}
	kept := intent(t, s, "e", "idem")
	if kept.State != state.IntentUnknown || kept.Attempts != 1 || kept.Refusals != 1 {
		t.Fatalf("a refused replay must not overwrite what happened: %+v", kept)
	}
}

// testRecordWrittenOncePerDispatch: an explicit key that names a record
// never dispatches over it. The same effect may be tried again only when
// it provably never left (NOT_SENT, CANCELLED_BEFORE_DISPATCH); an effect
// that happened or was settled answers with its record; another effect
// under the key is refused whatever the record's state. The record keeps
// every field it had, and the refusal is in the audit.
func testRecordWrittenOncePerDispatch(t *testing.T, s state.Store) {
	charge := state.GuardRequest{Key: "charge-1", ExplicitKey: true, Boundary: state.BoundaryHTTP, Method: "POST", Target: "https://pay.example/charge", BodyDigest: "sha256:aa"}
	other := func(f func(*state.GuardRequest)) state.GuardRequest { r := charge; f(&r); return r }
	dispatch := func(t *testing.T, run string) state.Intent {
		req := charge
		req.RunID = run
		res := guard(t, s, req)
		if !res.Admitted {
			t.Fatalf("first dispatch: %+v", res)
		}
		return res.Intent
	}
	inFlight := func(t *testing.T, run string) { dispatch(t, run) }
	responded := func(t *testing.T, run string) { finish(t, s, dispatch(t, run), state.IntentResponded, 200) }
	notSent := func(t *testing.T, run string) { finish(t, s, dispatch(t, run), state.IntentNotSent, 0) }
	reconciled := func(applied bool) func(t *testing.T, run string) {
		return func(t *testing.T, run string) {
			finish(t, s, dispatch(t, run), state.IntentUnknown, 0)
			if _, err := s.Resolve(ctx(t), state.ResolveRequest{RunID: run, Key: "charge-1", Applied: applied, Source: "operator", Note: "checked the provider's dashboard", Actor: "operator:alice"}); err != nil {
				t.Fatalf("resolve: %v", err)
			}
		}
	}
	deniedAtEdge := func(t *testing.T, run string) {
		req := charge
		req.RunID, req.Refuse = run, "destination_denied"
		if res := guard(t, s, req); res.Admitted || res.Intent.State != state.IntentCancelledBeforeDispatch {
			t.Fatalf("refused at the edge: %+v", res)
		}
	}
	for _, tc := range []struct {
		name string
		// to brings the record under charge-1 to the state under test.
		to     func(t *testing.T, run string)
		replay state.GuardRequest
		want   string // "" admits a new attempt
	}{
		{"the same effect after RESPONDED answers with its record", responded, charge, state.RefusalKeyReused},
		{"a GET over a RESPONDED POST", responded, other(func(r *state.GuardRequest) { r.Method, r.Target = "GET", "https://pay.example/harmless" }), state.RefusalKeyReused},
		{"a worker's custom effect over a proxy's RESPONDED", responded, other(func(r *state.GuardRequest) {
			r.Boundary, r.Method, r.Target, r.BodyDigest = state.BoundaryCustom, "NOOP", "", ""
		}), state.RefusalKeyReused},
		{"the same effect after an operator's APPLIED", reconciled(true), charge, state.RefusalKeyReused},
		{"the same effect after an operator's NOT_APPLIED", reconciled(false), charge, state.RefusalKeyReused},
		{"the same effect after NOT_SENT is tried again", notSent, charge, ""},
		{"another target after NOT_SENT", notSent, other(func(r *state.GuardRequest) { r.Target = "https://pay.example/refund" }), state.RefusalKeyReused},
		{"another body after NOT_SENT", notSent, other(func(r *state.GuardRequest) { r.BodyDigest = "sha256:bb" }), state.RefusalKeyReused},
		{"the same effect after CANCELLED_BEFORE_DISPATCH is tried again", deniedAtEdge, charge, ""},
		{"another method after CANCELLED_BEFORE_DISPATCH", deniedAtEdge, other(func(r *state.GuardRequest) { r.Method = "PUT" }), state.RefusalKeyReused},
		{"another body while IN_FLIGHT", inFlight, other(func(r *state.GuardRequest) { r.BodyDigest = "sha256:bb" }), state.RefusalInProgress},
	} {
		t.Run(tc.name, func(t *testing.T) {
			run := fmt.Sprintf("once-%x", sha256.Sum256([]byte(tc.name)))[:21]
			admit(t, s, run)
			tc.to(t, run)
			before := intent(t, s, run, "charge-1")
			replay := tc.replay
			replay.RunID = run
			got := guard(t, s, replay)
			after := intent(t, s, run, "charge-1")
			if tc.want == "" {
				if !got.Admitted || after.State != state.IntentInFlight || after.Attempts != before.Attempts+1 {
					t.Fatalf("replay of %s: %+v; record now %+v", before.State, got, after)
				}
				return
			}
			if got.Admitted || got.Refusal != tc.want {
				t.Fatalf("replay of %s: admitted=%v refusal=%q, want %q", before.State, got.Admitted, got.Refusal, tc.want)
			}
			if got.Intent.Key != "charge-1" || got.Intent.State != before.State || got.Intent.Method != before.Method ||
				got.Intent.Target != before.Target || got.Intent.StatusCode != before.StatusCode || got.Intent.Note != before.Note {
				t.Fatalf("the refusal answers with %+v, want the record as it stands %+v", got.Intent, before)
			}
			if !reflect.DeepEqual(after, before) {
				t.Fatalf("a refused replay rewrote the record:\nbefore %+v\nafter  %+v", before, after)
			}
			evs, err := s.Events(ctx(t), run)
			if err != nil {
				t.Fatal(err)
			}
			if last := evs[len(evs)-1]; last.Kind != state.EventIntentRefused || last.Intent != "charge-1" || last.Reason != tc.want {
				t.Fatalf("the refused replay is not in the audit: %+v", last)
			}
		})
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

// answer is what a FinishLater's done was called with.
type answer struct {
	err error
}

// finishLater queues an outcome and returns the channel its answer comes on.
func finishLater(s state.Store, req state.FinishRequest) <-chan answer {
	ch := make(chan answer, 2)
	s.FinishLater(context.Background(), req, func(err error) { ch <- answer{err} })
	return ch
}

// answered waits, bounded, for the one answer of a FinishLater.
func answered(t *testing.T, ch <-chan answer) answer {
	t.Helper()
	select {
	case a := <-ch:
		select {
		case again := <-ch:
			t.Fatalf("done called twice: %+v, then %+v", a, again)
		case <-time.After(20 * time.Millisecond):
		}
		return a
	case <-time.After(10 * time.Second):
		t.Fatal("FinishLater never called done")
		return answer{}
	}
}

// An outcome queued by FinishLater is, for every later step and read of
// the same store, as if Finish had returned: read back at once, counted,
// audited, and a replay of its key is a new attempt, not "in progress".
func testFinishLater(t *testing.T, s state.Store) {
	admit(t, s, "fl")
	first := guard(t, s, state.GuardRequest{RunID: "fl", Key: "idem", ExplicitKey: true, BodyDigest: "A"})
	done := finishLater(s, state.FinishRequest{RunID: "fl", Key: "idem", Attempt: first.Intent.Attempts, Outcome: state.IntentNotSent, Reason: "dial refused", Actor: "proxy:test"})
	again := guard(t, s, state.GuardRequest{RunID: "fl", Key: "idem", ExplicitKey: true, BodyDigest: "A"})
	if !again.Admitted || again.Intent.Attempts != 2 {
		t.Fatalf("a replay after a queued NOT_SENT: %+v, want a second attempt", again)
	}
	// The first attempt's NOT_SENT is in the audit log (below); its record
	// is the second attempt's now.
	if a := answered(t, done); a.err != nil {
		t.Fatalf("done got %v", a.err)
	}

	other := guard(t, s, state.GuardRequest{RunID: "fl", Key: "other", ExplicitKey: true})
	done = finishLater(s, state.FinishRequest{RunID: "fl", Key: "other", Attempt: other.Intent.Attempts, Outcome: state.IntentNotSent, Reason: "dial refused", Actor: "proxy:test"})
	if in := intent(t, s, "fl", "other"); in.State != state.IntentNotSent || in.Reason != "dial refused" {
		t.Fatalf("read right after FinishLater: %+v", in)
	}
	answered(t, done)
	wantCounts(t, get(t, s, "fl"), map[state.IntentState]int{state.IntentInFlight: 1, state.IntentNotSent: 1})
	evs, err := s.Events(ctx(t), "fl")
	if err != nil {
		t.Fatal(err)
	}
	var outcomes []string
	for _, e := range evs {
		if e.Kind == state.EventIntentOutcome {
			outcomes = append(outcomes, e.Intent+" "+e.To)
		}
	}
	if want := []string{"idem NOT_SENT", "other NOT_SENT"}; !slices.Equal(outcomes, want) {
		t.Fatalf("outcome events %q, want %q", outcomes, want)
	}
}

// FinishLater answers, through done, the error Finish would have: a
// request that is not valid before it returns, a conflict or a missing
// intent once the step has run, nil once it is recorded. An outcome with
// nothing else to ride with is written on its own.
func testFinishLaterAnswers(t *testing.T, s state.Store) {
	admit(t, s, "fa")
	res := guard(t, s, state.GuardRequest{RunID: "fa", Key: "k", ExplicitKey: true})

	var invalid error
	called := false
	s.FinishLater(ctx(t), state.FinishRequest{RunID: "fa", Key: "k", Attempt: 1, Outcome: state.IntentApplied, Actor: "p"},
		func(err error) { called, invalid = true, err })
	if !called || !errors.Is(invalid, state.ErrInvalid) {
		t.Fatalf("FinishLater as APPLIED: called %v with %v, want ErrInvalid before it returns", called, invalid)
	}

	stale := answered(t, finishLater(s, state.FinishRequest{RunID: "fa", Key: "k", Attempt: 2, Outcome: state.IntentResponded, StatusCode: 200, Actor: "p"}))
	wantConflict(t, stale.err, state.ConflictStaleAttempt)
	missing := answered(t, finishLater(s, state.FinishRequest{RunID: "fa", Key: "nope", Attempt: 1, Outcome: state.IntentNotSent, Actor: "p"}))
	if !errors.Is(missing.err, state.ErrNotFound) {
		t.Fatalf("FinishLater of a missing intent: %v, want ErrNotFound", missing.err)
	}
	alone := answered(t, finishLater(s, state.FinishRequest{RunID: "fa", Key: "k", Attempt: res.Intent.Attempts, Outcome: state.IntentResponded, StatusCode: 200, Actor: "p"}))
	if in := intent(t, s, "fa", "k"); alone.err != nil || in.State != state.IntentResponded {
		t.Fatalf("an outcome written on its own: %+v, %v", in, alone.err)
	}
}

// LaterRidesAlong is the spec for a store opened with an OutcomeDelay far
// longer than the test: an outcome queued by FinishLater is written by the
// next guard's step, by a read, or by Close, never left waiting for its
// delay. reopen opens the same store again after s is closed.
func LaterRidesAlong(t *testing.T, s state.Store, reopen func() state.Store) {
	admit(t, s, "ride")
	g := guard(t, s, state.GuardRequest{RunID: "ride", Key: "a", ExplicitKey: true})
	done := finishLater(s, state.FinishRequest{RunID: "ride", Key: "a", Attempt: g.Intent.Attempts, Outcome: state.IntentResponded, StatusCode: 200, Actor: "p"})
	select {
	case a := <-done:
		t.Fatalf("an outcome was written before anything else was asked of the store: %+v", a)
	case <-time.After(50 * time.Millisecond):
	}
	guard(t, s, state.GuardRequest{RunID: "ride", Key: "b", ExplicitKey: true})
	if a := answered(t, done); a.err != nil {
		t.Fatalf("the outcome that rode with a guard: %v", a.err)
	}
	if in := intent(t, s, "ride", "a"); in.State != state.IntentResponded {
		t.Fatalf("the outcome that rode with a guard: %+v", in)
	}

	done = finishLater(s, state.FinishRequest{RunID: "ride", Key: "b", Attempt: 1, Outcome: state.IntentResponded, StatusCode: 202, Actor: "p"})
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if a := answered(t, done); a.err != nil {
		t.Fatalf("the outcome Close wrote: %v", a.err)
	}
	s = reopen()
	defer s.Close()
	if in := intent(t, s, "ride", "b"); in.State != state.IntentResponded || in.StatusCode != 202 {
		t.Fatalf("after Close and Open: %+v", in)
	}
}

// ReadWaitsForAQueuedOutcome is the spec for a store opened with an
// OutcomeDelay far longer than the test: a read waits for an outcome
// queued by FinishLater even once it has left the queue for a write still
// under way. hold is called with the outcome queued; it starts a write that
// carries it and keeps that write from ending until the release it returns
// is called.
func ReadWaitsForAQueuedOutcome(t *testing.T, s state.Store, hold func() (release func())) {
	admit(t, s, "r")
	g := guard(t, s, state.GuardRequest{RunID: "r", Key: "k", ExplicitKey: true})
	done := finishLater(s, state.FinishRequest{RunID: "r", Key: "k", Attempt: g.Intent.Attempts, Outcome: state.IntentResponded, StatusCode: 200, Actor: "p"})
	var once sync.Once
	release := hold()
	defer once.Do(release) // a failure must not leave the write held for Close to wait on
	read := make(chan state.Intent, 1)
	go func() {
		in, err := s.Intent(context.Background(), "r", "k")
		if err != nil {
			t.Error(err)
		}
		read <- in
	}()
	select {
	case in := <-read:
		t.Fatalf("a read returned %s while the write carrying the outcome was held", in.State)
	case <-time.After(100 * time.Millisecond):
	}
	once.Do(release)
	if in := <-read; in.State != state.IntentResponded {
		t.Fatalf("the read after the write: %s, want RESPONDED", in.State)
	}
	if a := answered(t, done); a.err != nil {
		t.Fatal(a.err)
	}
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
	if in.State != state.IntentUnknown || in.Reason != state.ReasonLeaseExpired {
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
	draining, err := s.DrainingRuns(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(draining, "dr") {
		t.Fatalf("cancelled run still draining: %v", draining)
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
	if in := intent(t, s, "dt", "slow"); in.State != state.IntentUnknown || in.Reason != state.ReasonDrainTimeout {
		t.Fatalf("in-flight intent at the deadline: %+v", in)
	}
	evs, err := s.Events(ctx(t), "dt")
	if err != nil {
		t.Fatal(err)
	}
	last := evs[len(evs)-1]
	if last.Kind != state.EventRunTransition || last.To != string(state.StatusUnknown) || last.Reason != state.ReasonDrainTimeout {
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
	if r.Status != state.StatusUnknown || r.StatusReason != state.ReasonDrainTimeout {
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
	if r.StatusReason != state.ReasonUnresolved {
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
	if r.StatusReason != state.ReasonReconciled {
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

// testGuardRefuse: an effect the edge refused (a destination not allowed)
// is recorded as refused for the edge's reason in the guard's one step,
// whatever the run's state, and leaves the run as it was.
func testGuardRefuse(t *testing.T, s state.Store) {
	admit(t, s, "rf")
	res := guard(t, s, state.GuardRequest{RunID: "rf", ObservedVersion: 1, Key: "meta", ExplicitKey: true, Target: "http://169.254.169.254/", Refuse: "destination_denied"})
	if res.Admitted || res.Refusal != "destination_denied" {
		t.Fatalf("guard with an edge refusal: admitted %v refusal %q", res.Admitted, res.Refusal)
	}
	in := intent(t, s, "rf", "meta")
	if in.State != state.IntentCancelledBeforeDispatch || in.Reason != "destination_denied" || in.Attempts != 0 {
		t.Fatalf("refused intent %+v", in)
	}
	wantRun(t, get(t, s, "rf"), state.StatusActive, 1)
	// The next effect of the run is admitted as ever.
	if ok := guard(t, s, state.GuardRequest{RunID: "rf", ObservedVersion: 1, Key: "fine", ExplicitKey: true}); !ok.Admitted {
		t.Fatalf("the run refuses its next effect after an edge refusal: %q", ok.Refusal)
	}
	events, err := s.Events(ctx(t), "rf")
	if err != nil {
		t.Fatal(err)
	}
	var seen bool
	for _, e := range events {
		seen = seen || e.Kind == state.EventIntentRefused && e.Intent == "meta" && e.Reason == "destination_denied"
	}
	if !seen {
		t.Fatalf("no intent.refused event for the edge's refusal: %+v", events)
	}
	// Auto-admission still happens for an unseen run: the refusal is recorded against its row.
	res = guard(t, s, state.GuardRequest{RunID: "rf-new", Key: "meta", ExplicitKey: true, AutoAdmit: true, Refuse: "destination_denied"})
	if res.Admitted || res.Refusal != "destination_denied" || res.Run.Status != state.StatusActive {
		t.Fatalf("edge refusal of an unseen run: %+v", res)
	}
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

// testFinishNotApplied: a carrier that cut a request which provably had
// no effect (a safe method, or a destination the policy declares without
// effects) records NOT_APPLIED with its source, and that settles the
// intent: a cancelled run with nothing else open reaches CANCELLED.
func testFinishNotApplied(t *testing.T, s state.Store) {
	admit(t, s, "na")
	get1 := guard(t, s, state.GuardRequest{RunID: "na", Key: "read", ExplicitKey: true, Method: "GET", Target: "https://api.example/items"})
	infer := guard(t, s, state.GuardRequest{RunID: "na", Key: "infer", ExplicitKey: true, Method: "POST", Target: "https://llm.example/v1/chat"})
	cancel(t, s, "na", time.Minute)

	for _, tc := range []struct {
		outcome state.IntentState
		source  string
	}{
		{state.IntentNotApplied, ""},
		{state.IntentNotApplied, "operator"},
		{state.IntentResponded, state.SourceSafeMethod},
	} {
		_, err := s.Finish(ctx(t), state.FinishRequest{RunID: "na", Key: "read", Attempt: 1, Outcome: tc.outcome, Source: tc.source, Actor: "p"})
		if !errors.Is(err, state.ErrInvalid) {
			t.Errorf("finish %s with source %q: got %v, want ErrInvalid", tc.outcome, tc.source, err)
		}
	}

	out, err := s.Finish(ctx(t), state.FinishRequest{RunID: "na", Key: "read", Attempt: get1.Intent.Attempts, Outcome: state.IntentNotApplied,
		Source: state.SourceSafeMethod, Reason: state.ReasonRunCancelled, Actor: "proxy:test"})
	if err != nil {
		t.Fatal(err)
	}
	if out.State != state.IntentNotApplied || out.Source != state.SourceSafeMethod || out.Reason != state.ReasonRunCancelled || out.LeaseOwner != "" {
		t.Fatalf("cut safe-method request recorded as %+v", out)
	}
	wantRun(t, get(t, s, "na"), state.StatusCancelling, 2)
	finish(t, s, infer.Intent, state.IntentUnknown, 0)
	// NOT_APPLIED is for what is IN_FLIGHT: an UNKNOWN is reconciled.
	_, err = s.Finish(ctx(t), state.FinishRequest{RunID: "na", Key: "infer", Attempt: 1, Outcome: state.IntentNotApplied, Source: state.SourcePolicy, Actor: "p"})
	wantConflict(t, err, state.ConflictNotInFlight)

	admit(t, s, "na2")
	p := guard(t, s, state.GuardRequest{RunID: "na2", Key: "infer", ExplicitKey: true, Method: "POST", Target: "https://llm.example/v1/chat"})
	cancel(t, s, "na2", time.Minute)
	if _, err := s.Finish(ctx(t), state.FinishRequest{RunID: "na2", Key: "infer", Attempt: p.Intent.Attempts, Outcome: state.IntentNotApplied,
		Source: state.SourcePolicy, Reason: state.ReasonRunCancelled, Actor: "proxy:test"}); err != nil {
		t.Fatal(err)
	}
	// Settled by the Finish itself, no tick needed.
	r := get(t, s, "na2")
	wantRun(t, r, state.StatusCancelled, 2)
	wantCounts(t, r, map[state.IntentState]int{state.IntentNotApplied: 1})
	evs, err := s.Events(ctx(t), "na2")
	if err != nil {
		t.Fatal(err)
	}
	var outcome *state.Event
	for i := range evs {
		if evs[i].Kind == state.EventIntentOutcome {
			outcome = &evs[i]
		}
	}
	if outcome == nil || outcome.To != string(state.IntentNotApplied) || outcome.Reason != state.SourcePolicy+": "+state.ReasonRunCancelled {
		t.Fatalf("outcome event %+v, want IN_FLIGHT -> NOT_APPLIED for \"policy: run_cancelled\"", outcome)
	}
	// The effect is settled: a replay of its key answers with the record.
	admit(t, s, "na3")
	first := guard(t, s, state.GuardRequest{RunID: "na3", Key: "read", ExplicitKey: true, Method: "GET"})
	if _, err := s.Finish(ctx(t), state.FinishRequest{RunID: "na3", Key: "read", Attempt: first.Intent.Attempts, Outcome: state.IntentNotApplied,
		Source: state.SourceSafeMethod, Actor: "proxy:test"}); err != nil {
		t.Fatal(err)
	}
	again := guard(t, s, state.GuardRequest{RunID: "na3", Key: "read", ExplicitKey: true, Method: "GET"})
	if again.Admitted || again.Refusal != state.RefusalKeyReused || again.Intent.Source != state.SourceSafeMethod || again.Intent.Attempts != 1 {
		t.Fatalf("replay of a NOT_APPLIED key: %+v", again)
	}
}

// testNote: a note about an intent is one more line of the audit log,
// and nothing else moves: not the intent, not the row.
func testNote(t *testing.T, s state.Store) {
	admit(t, s, "nt")
	g := guard(t, s, state.GuardRequest{RunID: "nt", Key: "stream", ExplicitKey: true, Method: "GET", Target: "https://api.example/events"})
	finished := finish(t, s, g.Intent, state.IntentResponded, 200)
	row := get(t, s, "nt")
	before, err := s.Events(ctx(t), "nt")
	if err != nil {
		t.Fatal(err)
	}
	err = s.Note(ctx(t), state.NoteRequest{RunID: "nt", Key: "stream", Kind: state.EventIntentCut, Reason: state.ReasonRunCancelled, Actor: "proxy:test"})
	if err != nil {
		t.Fatal(err)
	}
	after, err := s.Events(ctx(t), "nt")
	if err != nil {
		t.Fatal(err)
	}
	if len(after) != len(before)+1 {
		t.Fatalf("%d events after a note, want %d", len(after), len(before)+1)
	}
	n := after[len(after)-1]
	if n.Kind != state.EventIntentCut || n.Intent != "stream" || n.Reason != state.ReasonRunCancelled || n.Actor != "proxy:test" || n.At.IsZero() || n.Version != 1 || n.From != "" || n.To != "" {
		t.Fatalf("note event %+v", n)
	}
	if in := intent(t, s, "nt", "stream"); in.State != finished.State || in.StatusCode != 200 || !in.UpdatedAt.Equal(finished.UpdatedAt) {
		t.Fatalf("a note changed the intent: %+v, was %+v", in, finished)
	}
	if r := get(t, s, "nt"); r.Status != row.Status || r.CancelVersion != row.CancelVersion || !r.UpdatedAt.Equal(row.UpdatedAt) || fmt.Sprint(r.Intents) != fmt.Sprint(row.Intents) {
		t.Fatalf("a note changed the row: %+v, was %+v", r, row)
	}

	for _, tc := range []struct {
		req  state.NoteRequest
		want error
	}{
		{state.NoteRequest{RunID: "nobody", Key: "stream", Kind: state.EventIntentCut, Actor: "p"}, state.ErrNotFound},
		{state.NoteRequest{RunID: "nt", Key: "nothing", Kind: state.EventIntentCut, Actor: "p"}, state.ErrNotFound},
		{state.NoteRequest{RunID: "nt", Key: "stream", Kind: "", Actor: "p"}, state.ErrInvalid},
		{state.NoteRequest{RunID: "nt", Key: "stream", Kind: "Intent Cut!", Actor: "p"}, state.ErrInvalid},
		{state.NoteRequest{RunID: "nt", Key: "stream", Kind: state.EventRunCancelled, Actor: "p"}, state.ErrInvalid},
		{state.NoteRequest{RunID: "nt", Key: "stream", Kind: state.EventIntentResolved, Actor: "p"}, state.ErrInvalid},
	} {
		if err := s.Note(ctx(t), tc.req); !errors.Is(err, tc.want) {
			t.Errorf("note %+v: got %v, want %v", tc.req, err, tc.want)
		}
	}
	if evs, _ := s.Events(ctx(t), "nt"); len(evs) != len(after) {
		t.Fatalf("refused notes were recorded: %d events, want %d", len(evs), len(after))
	}
}

// testDrainingRuns: CANCELLING and UNKNOWN runs, in id order; not ACTIVE,
// not final.
func testDrainingRuns(t *testing.T, s state.Store) {
	for _, id := range []string{"z-cancelling", "a-unknown", "m-active", "c-completed", "d-drained"} {
		admit(t, s, id)
	}
	guard(t, s, state.GuardRequest{RunID: "z-cancelling", Key: "k", ExplicitKey: true})
	cancel(t, s, "z-cancelling", time.Minute)
	u := guard(t, s, state.GuardRequest{RunID: "a-unknown", Key: "k", ExplicitKey: true})
	finish(t, s, u.Intent, state.IntentUnknown, 0)
	cancel(t, s, "a-unknown", time.Minute)
	wantRun(t, tick(t, s, "a-unknown"), state.StatusUnknown, 2)
	if _, err := s.Complete(ctx(t), state.CompleteRequest{RunID: "c-completed", Version: 1, Actor: "w"}); err != nil {
		t.Fatal(err)
	}
	cancel(t, s, "d-drained", time.Minute)
	tick(t, s, "d-drained")
	cancel(t, s, "tombstone", time.Minute)
	got, err := s.DrainingRuns(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, []string{"a-unknown", "z-cancelling"}) {
		t.Fatalf("draining runs %v, want [a-unknown z-cancelling]", got)
	}
}

// testActiveRuns: ACTIVE runs a page at a time, in id order, each page
// after the last id of the one before; a short page is the end.
func testActiveRuns(t *testing.T, s state.Store) {
	for _, id := range []string{"r5", "r1", "r3", "r2", "r4", "r6"} {
		admit(t, s, id)
	}
	cancel(t, s, "r3", time.Minute)
	if _, err := s.Complete(ctx(t), state.CompleteRequest{RunID: "r6", Version: 1, Actor: "w"}); err != nil {
		t.Fatal(err)
	}
	guard(t, s, state.GuardRequest{RunID: "r0", Key: "k", ExplicitKey: true, AutoAdmit: true})
	var pages [][]string
	after := ""
	for range 10 {
		page, err := s.ActiveRuns(ctx(t), after, 2)
		if err != nil {
			t.Fatal(err)
		}
		pages = append(pages, page)
		if len(page) < 2 {
			break
		}
		after = page[len(page)-1]
	}
	if fmt.Sprint(pages) != "[[r0 r1] [r2 r4] [r5]]" {
		t.Fatalf("pages of active runs %v, want [[r0 r1] [r2 r4] [r5]]", pages)
	}
	if page, err := s.ActiveRuns(ctx(t), "r2a", 10); err != nil || !slices.Equal(page, []string{"r4", "r5"}) {
		t.Fatalf("active runs after a cursor that is no run: %v %v, want [r4 r5]", page, err)
	}
	for _, bad := range []int{0, -1, state.MaxPage + 1} {
		if _, err := s.ActiveRuns(ctx(t), "", bad); !errors.Is(err, state.ErrInvalid) {
			t.Errorf("active runs with limit %d: got %v, want ErrInvalid", bad, err)
		}
	}
}

// finalRun leaves run id CANCELLED with one RESPONDED intent and a
// refusal, and returns when it became final.
func finalRun(t *testing.T, s state.Store, id string) time.Time {
	t.Helper()
	admit(t, s, id)
	g := guard(t, s, state.GuardRequest{RunID: id, Key: "k", ExplicitKey: true})
	finish(t, s, g.Intent, state.IntentResponded, 200)
	cancel(t, s, id, time.Minute)
	r := tick(t, s, id)
	wantRun(t, r, state.StatusCancelled, 2)
	guard(t, s, state.GuardRequest{RunID: id, Key: "late", ExplicitKey: true})
	return r.UpdatedAt
}

// testPrune: retention removes the intents and events of runs that
// became final before the limit, and nothing else; the row stays, so the
// run can never come back.
func testPrune(t *testing.T, s state.Store) {
	finalRun(t, s, "old-1")
	finalRun(t, s, "old-2")
	admit(t, s, "done")
	if _, err := s.Complete(ctx(t), state.CompleteRequest{RunID: "done", Version: 1, Actor: "w"}); err != nil {
		t.Fatal(err)
	}
	admit(t, s, "draining")
	guard(t, s, state.GuardRequest{RunID: "draining", Key: "k", ExplicitKey: true})
	cancel(t, s, "draining", time.Minute)
	admit(t, s, "active")
	guard(t, s, state.GuardRequest{RunID: "active", Key: "k", ExplicitKey: true})

	for _, bad := range []state.PruneRequest{{Limit: 10}, {FinalBefore: time.Now(), Limit: 0}, {FinalBefore: time.Now(), Limit: state.MaxPruneLimit + 1}} {
		if _, err := s.Prune(ctx(t), bad); !errors.Is(err, state.ErrInvalid) {
			t.Errorf("prune %+v: got %v, want ErrInvalid", bad, err)
		}
	}
	// Nothing became final before an hour ago.
	if n, err := s.Prune(ctx(t), state.PruneRequest{FinalBefore: time.Now().Add(-time.Hour), Limit: 10}); err != nil || n != 0 {
		t.Fatalf("prune before any run was final: %d %v, want 0", n, err)
	}
	// Runs on the same millisecond as the limit are not before it.
	time.Sleep(5 * time.Millisecond)
	limit := time.Now()
	time.Sleep(5 * time.Millisecond)
	n, err := s.Prune(ctx(t), state.PruneRequest{FinalBefore: limit, Limit: 2})
	if err != nil || n != 2 {
		t.Fatalf("prune with limit 2: %d %v, want 2", n, err)
	}
	n, err = s.Prune(ctx(t), state.PruneRequest{FinalBefore: limit, Limit: 10})
	if err != nil || n != 1 {
		t.Fatalf("prune of the rest: %d %v, want 1", n, err)
	}
	if n, err := s.Prune(ctx(t), state.PruneRequest{FinalBefore: limit, Limit: 10}); err != nil || n != 0 {
		t.Fatalf("prune with nothing left: %d %v, want 0", n, err)
	}

	for _, id := range []string{"old-1", "old-2", "done"} {
		r := get(t, s, id)
		if !r.Final() || r.PrunedAt.IsZero() {
			t.Fatalf("pruned run %s: %+v, want its final row with pruned_at", id, r)
		}
		ins, err := s.Intents(ctx(t), id)
		if err != nil || len(ins) != 0 {
			t.Fatalf("intents of pruned run %s: %+v %v, want none", id, ins, err)
		}
		evs, err := s.Events(ctx(t), id)
		if err != nil || len(evs) != 0 {
			t.Fatalf("events of pruned run %s: %+v %v, want none", id, evs, err)
		}
		if _, err := s.Intent(ctx(t), id, "k"); !errors.Is(err, state.ErrNotFound) {
			t.Fatalf("intent k of pruned run %s: %v, want ErrNotFound", id, err)
		}
		_, err = s.Admit(ctx(t), state.AdmitRequest{RunID: id, Actor: "test"})
		wantConflict(t, err, state.RefusalRunNotActive)
	}
	r := get(t, s, "old-1")
	wantRun(t, r, state.StatusCancelled, 2)
	wantCounts(t, r, map[state.IntentState]int{state.IntentResponded: 1, state.IntentCancelledBeforeDispatch: 1})
	if res := guard(t, s, state.GuardRequest{RunID: "old-1", Key: "k", ExplicitKey: true, AutoAdmit: true}); res.Admitted || res.Refusal != state.RefusalRunNotActive {
		t.Fatalf("guard of a pruned cancelled run: %+v", res)
	}
	for _, id := range []string{"draining", "active"} {
		if ins, err := s.Intents(ctx(t), id); err != nil || len(ins) != 1 {
			t.Fatalf("prune touched run %s that is not final: %+v %v", id, ins, err)
		}
		if r := get(t, s, id); !r.PrunedAt.IsZero() {
			t.Fatalf("run %s that is not final is marked pruned: %+v", id, r)
		}
	}
}

// testPruneAgain: what is recorded against a final run after its prune
// (an agent still trying) is kept for a retention from then, and then
// pruned in its turn.
func testPruneAgain(t *testing.T, s state.Store) {
	finalRun(t, s, "again")
	time.Sleep(5 * time.Millisecond)
	if n, err := s.Prune(ctx(t), state.PruneRequest{FinalBefore: time.Now(), Limit: 10}); err != nil || n != 1 {
		t.Fatalf("first prune: %d %v, want 1", n, err)
	}
	time.Sleep(5 * time.Millisecond)
	between := time.Now()
	time.Sleep(5 * time.Millisecond)
	res := guard(t, s, state.GuardRequest{RunID: "again", Key: "after-prune", ExplicitKey: true})
	if res.Admitted || res.Intent.State != state.IntentCancelledBeforeDispatch {
		t.Fatalf("guard after the prune: %+v", res)
	}
	// Not yet a retention since the refusal.
	if n, err := s.Prune(ctx(t), state.PruneRequest{FinalBefore: between, Limit: 10}); err != nil || n != 0 {
		t.Fatalf("prune before the refusal's time: %d %v, want 0", n, err)
	}
	if ins, _ := s.Intents(ctx(t), "again"); len(ins) != 1 || ins[0].Key != "after-prune" {
		t.Fatalf("the refusal after the prune is not kept: %+v", ins)
	}
	time.Sleep(5 * time.Millisecond)
	if n, err := s.Prune(ctx(t), state.PruneRequest{FinalBefore: time.Now(), Limit: 10}); err != nil || n != 1 {
		t.Fatalf("prune after the refusal's retention: %d %v, want 1", n, err)
	}
	if ins, _ := s.Intents(ctx(t), "again"); len(ins) != 0 {
		t.Fatalf("the refusal after the prune was never pruned: %+v", ins)
	}
	wantRun(t, get(t, s, "again"), state.StatusCancelled, 2)
}

// testTexts: whatever bytes a text holds (newlines, backslashes, spaces,
// separators a store may use inside its records) comes back as written, in
// the intent and in the audit log.
func testTexts(t *testing.T, s state.Store) {
	odd := "a b\\n\nc:1|2\\\\ \t\x00\x1f end\\"
	admit(t, s, "tx")
	g := guard(t, s, state.GuardRequest{RunID: "tx", Key: "k:1|x\\n", ExplicitKey: true, Method: "PO ST\n" + odd,
		Target: "https://api.example/p a\\th?" + odd, BodyDigest: odd, LeaseOwner: "proxy:" + odd, Actor: "actor " + odd})
	if !g.Admitted {
		t.Fatalf("guard with odd texts: %+v", g)
	}
	in := intent(t, s, "tx", "k:1|x\\n")
	if in.Method != "PO ST\n"+odd || in.Target != "https://api.example/p a\\th?"+odd || in.BodyDigest != odd || in.LeaseOwner != "proxy:"+odd {
		t.Fatalf("intent texts came back as %q %q %q %q", in.Method, in.Target, in.BodyDigest, in.LeaseOwner)
	}
	out, err := s.Finish(ctx(t), state.FinishRequest{RunID: "tx", Key: in.Key, Attempt: in.Attempts, Outcome: state.IntentUnknown,
		Reason: "reason " + odd, Actor: "actor " + odd})
	if err != nil || out.Reason != "reason "+odd {
		t.Fatalf("finish with an odd reason: %+v %v", out, err)
	}
	if err := s.Note(ctx(t), state.NoteRequest{RunID: "tx", Key: in.Key, Kind: state.EventIntentCut, Reason: "note " + odd, Actor: "actor " + odd}); err != nil {
		t.Fatal(err)
	}
	res, err := s.Resolve(ctx(t), state.ResolveRequest{RunID: "tx", Key: in.Key, Applied: true, Source: "src " + odd, Note: "n " + odd, Actor: "actor " + odd})
	if err != nil || res.Source != "src "+odd || res.Note != "n "+odd {
		t.Fatalf("resolve with odd texts: %+v %v", res, err)
	}
	if got := intent(t, s, "tx", in.Key); got.Reason != "reason "+odd || got.Source != "src "+odd || got.Note != "n "+odd || got.Method != in.Method {
		t.Fatalf("intent after resolve: %+v", got)
	}
	evs, err := s.Events(ctx(t), "tx")
	if err != nil {
		t.Fatal(err)
	}
	var reasons []string
	for _, e := range evs {
		if e.Actor != "actor "+odd && e.Kind != state.EventRunAdmitted {
			t.Errorf("event %s has actor %q", e.Kind, e.Actor)
		}
		if e.Kind != state.EventRunAdmitted && e.Intent != in.Key {
			t.Errorf("event %s names intent %q", e.Kind, e.Intent)
		}
		reasons = append(reasons, e.Reason)
	}
	want := []string{"", "", "reason " + odd, "note " + odd, "src " + odd + ": n " + odd}
	if !slices.Equal(reasons, want) {
		t.Fatalf("event reasons %q, want %q", reasons, want)
	}
}

// testTotals: the totals move with each transition as the rows do, on
// every kind of step that changes a run's status or its UNKNOWN intents,
// and count each reconciliation by its source.
func testTotals(t *testing.T, s state.Store) {
	check := func(when string, resolved map[string]int64) {
		t.Helper()
		got, err := s.Totals(ctx(t))
		if err != nil {
			t.Fatalf("%s: totals: %v", when, err)
		}
		if want := TotalsOfRows(t, s, resolved); !reflect.DeepEqual(got, want) {
			t.Fatalf("%s: totals %+v, want (from the rows) %+v", when, got, want)
		}
	}
	check("empty", nil)
	admit(t, s, "tot-a")
	admit(t, s, "tot-b")
	guard(t, s, state.GuardRequest{RunID: "tot-auto", Key: "k", ExplicitKey: true, AutoAdmit: true})
	check("three admitted", nil)
	a1 := guard(t, s, state.GuardRequest{RunID: "tot-a", Key: "a1", ExplicitKey: true})
	a2 := guard(t, s, state.GuardRequest{RunID: "tot-a", Key: "a2", ExplicitKey: true})
	a3 := guard(t, s, state.GuardRequest{RunID: "tot-a", Key: "a3", ExplicitKey: true})
	finish(t, s, a1.Intent, state.IntentUnknown, 0)
	check("an outcome UNKNOWN", nil)
	cancel(t, s, "tot-a", 40*time.Millisecond)
	cancel(t, s, "tot-never-seen", time.Minute)
	check("cancelled, and a tombstone", nil)
	time.Sleep(80 * time.Millisecond)
	wantRun(t, tick(t, s, "tot-a"), state.StatusUnknown, 2)
	check("the drain timed out", nil)
	if _, err := s.Resolve(ctx(t), state.ResolveRequest{RunID: "tot-a", Key: a1.Intent.Key, Applied: true, Source: "operator", Actor: "op:alice"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Resolve(ctx(t), state.ResolveRequest{RunID: "tot-a", Key: a2.Intent.Key, Applied: false, Source: "stripe", Actor: "webhook:stripe"}); err != nil {
		t.Fatal(err)
	}
	check("two reconciled", map[string]int64{state.ResolutionOperator: 1, state.ResolutionWebhook: 1})
	if _, err := s.Finish(ctx(t), state.FinishRequest{RunID: "tot-a", Key: a3.Intent.Key, Attempt: a3.Intent.Attempts, Outcome: state.IntentResponded, StatusCode: 200, Actor: "proxy:t"}); err != nil {
		t.Fatal(err)
	}
	resolved := map[string]int64{state.ResolutionOperator: 1, state.ResolutionWebhook: 1, state.ResolutionResponse: 1}
	check("a late answer", resolved)
	if r := get(t, s, "tot-a"); r.Status != state.StatusCancelled {
		t.Fatalf("run with every effect reconciled: %s", r.Status)
	}
	if _, err := s.Complete(ctx(t), state.CompleteRequest{RunID: "tot-b", Version: 1, Actor: "w"}); err != nil {
		t.Fatal(err)
	}
	check("completed", resolved)
	n, err := s.Prune(ctx(t), state.PruneRequest{FinalBefore: time.Now().Add(time.Hour), Limit: 10})
	if err != nil || n == 0 {
		t.Fatalf("prune: %d %v", n, err)
	}
	check("pruned (the rows stay)", resolved)
}

// TotalsOfRows are the totals s should answer, counted from its rows one
// by one, with the reconciliations resolved by source.
func TotalsOfRows(t testing.TB, s state.Store, resolved map[string]int64) state.Totals {
	t.Helper()
	rows, err := s.List(context.Background(), "")
	if err != nil {
		t.Fatal(err)
	}
	want := state.Totals{Runs: map[state.Status]int64{}, Resolutions: map[string]int64{}}
	for _, st := range state.Statuses {
		want.Runs[st] = 0
	}
	for _, src := range state.ResolutionSources {
		want.Resolutions[src] = resolved[src]
	}
	for _, r := range rows {
		want.Runs[r.Status]++
		want.UnknownIntents += int64(r.Intents[state.IntentUnknown])
	}
	return want
}

// SomeRuns puts runs in every status into s (two effects UNKNOWN among
// them), as a store written before it kept totals would hold, and
// returns their ids.
func SomeRuns(t testing.TB, s state.Store) []string {
	t.Helper()
	c := context.Background()
	do := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	ids := []string{"old-active", "old-cancelling", "old-unknown", "old-completed", "old-tombstone"}
	for _, id := range ids[:4] {
		_, err := s.Admit(c, state.AdmitRequest{RunID: id, Actor: "t"})
		do(err)
	}
	for _, key := range []string{"u1", "u2"} {
		res, err := s.Guard(c, state.GuardRequest{RunID: "old-unknown", Key: key, ExplicitKey: true, Boundary: state.BoundaryHTTP,
			Method: "POST", Target: "https://a.example/x", LeaseOwner: "p", LeaseTTL: time.Minute, Actor: "p"})
		do(err)
		_, err = s.Finish(c, state.FinishRequest{RunID: "old-unknown", Key: key, Attempt: res.Intent.Attempts, Outcome: state.IntentUnknown, Actor: "p"})
		do(err)
	}
	for _, id := range []string{"old-cancelling", "old-unknown", "old-tombstone"} {
		_, err := s.Cancel(c, state.CancelRequest{RunID: id, Actor: "op", DrainTimeout: time.Hour})
		do(err)
	}
	_, err := s.Tick(c, state.TickRequest{RunID: "old-unknown", Actor: "sweeper"})
	do(err)
	_, err = s.Complete(c, state.CompleteRequest{RunID: "old-completed", Version: 1, Actor: "w"})
	do(err)
	return ids
}
