package control_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
)

// The boundaries that do not travel through the egress proxy, each before
// and after the cancel, on both stores: the API must give the same answers
// whichever store is behind it.

func serveOpts(t *testing.T, opts control.Options) *httptest.Server {
	t.Helper()
	opts.DrainTimeout = time.Hour
	if opts.Token == "" && !opts.Open {
		opts.Token = testToken
	}
	opts.Logger = slog.New(slog.DiscardHandler)
	h, err := control.New(opts)
	if err != nil {
		t.Fatalf("control.New: %v", err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

// wantAdmitted checks a 201 of the guard.
func wantAdmitted(key string, boundary state.Boundary, st state.IntentState, attempts int) func(t *testing.T, r reply) {
	return func(t *testing.T, r reply) {
		t.Helper()
		var g control.GuardResponse
		r.json(t, &g)
		in := g.Intent
		if !g.Admitted || in.Key != key || in.Boundary != boundary || in.State != st || in.Attempts != attempts {
			t.Fatalf("admitted %v intent %s/%s %s attempts %d, want %s/%s %s attempts %d: %s",
				g.Admitted, in.Key, in.Boundary, in.State, in.Attempts, key, boundary, st, attempts, r.body)
		}
		if g.Run.ID == "" || g.Run.Intents == nil {
			t.Errorf("answer lacks the run: %s", r.body)
		}
	}
}

// wantRefusal checks a guard refusal: the egress proxy's 409 shape.
func wantRefusal(key string, status state.Status, version, observed int64, recorded state.IntentState) func(t *testing.T, r reply) {
	return func(t *testing.T, r reply) {
		t.Helper()
		var ref refusal.Refusal
		r.json(t, &ref)
		if ref.Run == nil {
			t.Fatalf("refusal lacks the row: %s", r.body)
		}
		if ref.Intent != key || ref.Run.Status != status || ref.Run.CancelVersion != version || ref.ObservedVersion != observed || ref.Recorded != recorded {
			t.Fatalf("refusal of %s: %s/%d observed %d recorded %q, want %s/%d observed %d recorded %q: %s",
				ref.Intent, ref.Run.Status, ref.Run.CancelVersion, ref.ObservedVersion, ref.Recorded, status, version, observed, recorded, r.body)
		}
		for _, field := range []string{`"run_id":`, `"observed_version":`, `"status":`, `"cancel_version":`} {
			if !strings.Contains(string(r.body), field) {
				t.Errorf("refusal lacks %s: %s", field, r.body)
			}
		}
		if ref.Run == nil || ref.Run.Status != status {
			t.Errorf("refusal lacks the row: %s", r.body)
		}
	}
}

// wantIntent checks an answer that is one intent.
func wantIntent(key string, st state.IntentState, check ...func(t *testing.T, in state.Intent)) func(t *testing.T, r reply) {
	return func(t *testing.T, r reply) {
		t.Helper()
		var in state.Intent
		r.json(t, &in)
		if in.Key != key || in.State != st {
			t.Fatalf("intent %s %s, want %s %s: %s", in.Key, in.State, key, st, r.body)
		}
		for _, c := range check {
			c(t, in)
		}
	}
}

func intentState(t *testing.T, store state.Store, runID, key string) state.Intent {
	t.Helper()
	in, err := store.Intent(context.Background(), runID, key)
	if err != nil {
		t.Fatalf("read intent %s of %s: %v", key, runID, err)
	}
	return in
}

func tick(t *testing.T, store state.Store, runID string) state.Run {
	t.Helper()
	run, err := store.Tick(context.Background(), state.TickRequest{RunID: runID, Actor: "sweeper:test"})
	if err != nil {
		t.Fatalf("tick %s: %v", runID, err)
	}
	return run
}

func eventKinds(t *testing.T, store state.Store, runID string) []string {
	t.Helper()
	evs, err := store.Events(context.Background(), runID)
	if err != nil {
		t.Fatalf("events of %s: %v", runID, err)
	}
	var kinds []string
	for _, e := range evs {
		kinds = append(kinds, e.Kind+">"+e.To)
	}
	return kinds
}

func TestClaimRefusedOnceTheRunIsCancelled(t *testing.T) {
	testkit.OnBothStores(t, func(t *testing.T, store state.Store) {
		srv := serve(t, store, "")
		run(t, srv, []spec{
			{name: "Admit", method: "POST", path: "/v1/runs", body: `{"run_id":"c1"}`, status: 201},
			{name: "ClaimAtVersion", method: "POST", path: "/v1/runs/c1/claims", header: operator,
				body: `{"step_id":"s1","cancel_version":1,"worker":"worker-7","lease_ttl":"5m"}`, status: 201,
				check: func(t *testing.T, r reply) {
					wantAdmitted("claim:s1", state.BoundaryClaim, state.IntentInFlight, 1)(t, r)
					var g control.GuardResponse
					r.json(t, &g)
					if g.Intent.LeaseOwner != "worker-7" || g.Intent.ObservedVersion != 1 {
						t.Errorf("lease owner %q observed %d, want worker-7 at 1", g.Intent.LeaseOwner, g.Intent.ObservedVersion)
					}
					if ttl := g.Intent.LeaseExpires.Sub(g.Intent.UpdatedAt); ttl < 5*time.Minute-time.Second || ttl > 5*time.Minute+time.Second {
						t.Errorf("lease of %s, want 5m: %s", ttl, r.body)
					}
				}},
			{name: "ClaimedTwiceRefused", method: "POST", path: "/v1/runs/c1/claims", body: `{"step_id":"s1"}`, status: 409,
				code: state.RefusalInProgress, message: "IN_FLIGHT", check: func(t *testing.T, r reply) {
					var ref refusal.Refusal
					r.json(t, &ref)
					if ref.IntentState != state.IntentInFlight || ref.Recorded != "" {
						t.Fatalf("in-progress refusal: %s", r.body)
					}
				}},
			{name: "WorkerReleases", method: "PATCH", path: "/v1/runs/c1/intents/claim:s1", body: `{"outcome":"not_sent","reason":"worker shutting down"}`,
				status: 200, check: wantIntent("claim:s1", state.IntentNotSent)},
			{name: "ReleasedClaimTakenAgainWhileActive", method: "POST", path: "/v1/runs/c1/claims", header: operator,
				body: `{"step_id":"s1","cancel_version":1,"lease_ttl":600}`, status: 201,
				check: func(t *testing.T, r reply) {
					wantAdmitted("claim:s1", state.BoundaryClaim, state.IntentInFlight, 2)(t, r)
					var g control.GuardResponse
					r.json(t, &g)
					if g.Intent.LeaseOwner != operatorAlice {
						t.Errorf("lease owner %q, want the actor when no worker is named", g.Intent.LeaseOwner)
					}
				}},
			{name: "ReleasedAgain", method: "PATCH", path: "/v1/runs/c1/intents/claim:s1", body: `{"outcome":"not_sent"}`, status: 200,
				check: wantIntent("claim:s1", state.IntentNotSent)},
			{name: "StaleVersion", method: "POST", path: "/v1/runs/c1/claims", body: `{"step_id":"s2","cancel_version":7}`, status: 409,
				code: state.RefusalStaleVersion, message: "CANCELLED_BEFORE_DISPATCH",
				check: wantRefusal("claim:s2", state.StatusActive, 1, 7, state.IntentCancelledBeforeDispatch)},
			{name: "StaleRecorded", method: "GET", path: "/v1/runs/c1/intents/claim:s2", status: 200,
				check: wantIntent("claim:s2", state.IntentCancelledBeforeDispatch)},
			{name: "Cancel", method: "POST", path: "/v1/runs/c1/cancel", status: 202},
			{name: "ReleasedClaimNeverAfterCancel", method: "POST", path: "/v1/runs/c1/claims", body: `{"step_id":"s1","cancel_version":1}`, status: 409,
				code: state.RefusalRunNotActive, message: "CANCELLING",
				check: wantRefusal("claim:s1", state.StatusCancelling, 2, 1, state.IntentCancelledBeforeDispatch)},
			{name: "ReleasedClaimStaysAsItWas", method: "GET", path: "/v1/runs/c1/intents/claim:s1", status: 200,
				check: wantIntent("claim:s1", state.IntentNotSent, func(t *testing.T, in state.Intent) {
					if in.Attempts != 2 || in.Refusals != 1 {
						t.Errorf("attempts %d refusals %d, want 2 and 1", in.Attempts, in.Refusals)
					}
				})},
			{name: "NewClaimAfterCancelWithoutVersion", method: "POST", path: "/v1/runs/c1/claims", body: `{"step_id":"s3"}`, status: 409,
				code: state.RefusalRunNotActive, check: wantRefusal("claim:s3", state.StatusCancelling, 2, 0, state.IntentCancelledBeforeDispatch)},
			{name: "NewClaimRecorded", method: "GET", path: "/v1/runs/c1/intents/claim:s3", status: 200,
				check: wantIntent("claim:s3", state.IntentCancelledBeforeDispatch)},
			{name: "ClaimOnUnadmittedRun", method: "POST", path: "/v1/runs/nope/claims", body: `{"step_id":"s1"}`, status: 409,
				code: state.RefusalRunNotAdmitted, message: "never admitted"},
		})
		if got := tick(t, store, "c1"); got.Status != state.StatusCancelled {
			t.Errorf("nothing in flight, yet the run is %s after a tick", got.Status)
		}
	})
}

func TestExpiredClaimBecomesUnknownNeverRedispatched(t *testing.T) {
	testkit.OnBothStores(t, func(t *testing.T, store state.Store) {
		srv := serve(t, store, "")
		run(t, srv, []spec{
			{name: "Admit", method: "POST", path: "/v1/runs", body: `{"run_id":"x1"}`, status: 201},
			{name: "ShortLease", method: "POST", path: "/v1/runs/x1/claims", body: `{"step_id":"s1","worker":"w1","lease_ttl":"50ms"}`, status: 201,
				check: wantAdmitted("claim:s1", state.BoundaryClaim, state.IntentInFlight, 1)},
		})
		time.Sleep(120 * time.Millisecond)
		tick(t, store, "x1") // what the sweeper does on every live run
		run(t, srv, []spec{
			{name: "ExpiredIsUnknown", method: "GET", path: "/v1/runs/x1/intents/claim:s1", status: 200,
				check: wantIntent("claim:s1", state.IntentUnknown, func(t *testing.T, in state.Intent) {
					if in.Reason != state.ReasonLeaseExpired {
						t.Errorf("reason %q, want lease_expired", in.Reason)
					}
				})},
			{name: "NotClaimedAgain", method: "POST", path: "/v1/runs/x1/claims", body: `{"step_id":"s1","worker":"w2"}`, status: 409,
				code: state.RefusalInProgress, message: "UNKNOWN"},
		})
	})
}

func TestRetryScheduledThenRevokedByCancel(t *testing.T) {
	testkit.OnBothStores(t, func(t *testing.T, store state.Store) {
		srv := serve(t, store, "")
		at := time.Now().Add(time.Hour).UTC().Truncate(time.Second)
		retry := func(attempt int, version int64) string {
			return fmt.Sprintf(`{"step_id":"s1","attempt":%d,"not_before":%q,"cancel_version":%d}`, attempt, at.Format(time.RFC3339), version)
		}
		run(t, srv, []spec{
			{name: "Admit", method: "POST", path: "/v1/runs", body: `{"run_id":"t1"}`, status: 201},
			{name: "Schedule", method: "POST", path: "/v1/runs/t1/retries", body: retry(1, 1), status: 201,
				check: func(t *testing.T, r reply) {
					wantAdmitted("retry:s1:1", state.BoundaryRetry, state.IntentScheduled, 1)(t, r)
					var g control.GuardResponse
					r.json(t, &g)
					if !g.Intent.NotBefore.Equal(at) || g.Intent.LeaseOwner != "" {
						t.Errorf("not_before %s lease %q, want %s and no lease", g.Intent.NotBefore, g.Intent.LeaseOwner, at)
					}
				}},
			{name: "ScheduledTwiceRefused", method: "POST", path: "/v1/runs/t1/retries", body: retry(1, 1), status: 409, code: state.RefusalInProgress, message: "SCHEDULED"},
			{name: "NextAttempt", method: "POST", path: "/v1/runs/t1/retries", body: retry(2, 0), status: 201,
				check: wantAdmitted("retry:s1:2", state.BoundaryRetry, state.IntentScheduled, 1)},
			{name: "Cancel", method: "POST", path: "/v1/runs/t1/cancel", status: 202},
			{name: "FirstRevoked", method: "GET", path: "/v1/runs/t1/intents/retry:s1:1", status: 200, check: wantIntent("retry:s1:1", state.IntentRevoked)},
			{name: "SecondRevoked", method: "GET", path: "/v1/runs/t1/intents/retry:s1:2", status: 200, check: wantIntent("retry:s1:2", state.IntentRevoked)},
			{name: "ScheduleAfterCancel", method: "POST", path: "/v1/runs/t1/retries", body: retry(3, 1), status: 409,
				code: state.RefusalRunNotActive, message: "CANCELLED_BEFORE_DISPATCH",
				check: wantRefusal("retry:s1:3", state.StatusCancelling, 2, 1, state.IntentCancelledBeforeDispatch)},
			{name: "RefusalRecorded", method: "GET", path: "/v1/runs/t1/intents/retry:s1:3", status: 200,
				check: wantIntent("retry:s1:3", state.IntentCancelledBeforeDispatch)},
		})
		want := "run.admitted>ACTIVE intent.admitted>SCHEDULED intent.refused> intent.admitted>SCHEDULED run.cancel>CANCELLING " +
			"intent.revoked>REVOKED intent.revoked>REVOKED intent.refused>CANCELLED_BEFORE_DISPATCH"
		if got := strings.Join(eventKinds(t, store, "t1"), " "); got != want {
			t.Errorf("events\n got %s\nwant %s", got, want)
		}
	})
}

func TestScheduledRetryIsDispatchedUntilTheCancel(t *testing.T) {
	testkit.OnBothStores(t, func(t *testing.T, store state.Store) {
		srv := serve(t, store, "")
		at := time.Now().Add(time.Minute).UTC().Format(time.RFC3339)
		run(t, srv, []spec{
			{name: "Admit", method: "POST", path: "/v1/runs", body: `{"run_id":"rd"}`, status: 201},
			{name: "Schedule1", method: "POST", path: "/v1/runs/rd/retries", body: `{"step_id":"s1","attempt":2,"not_before":"` + at + `"}`, status: 201},
			{name: "Schedule2", method: "POST", path: "/v1/runs/rd/retries", body: `{"step_id":"s2","attempt":2,"not_before":"` + at + `"}`, status: 201},
			{name: "Dispatch", method: "POST", path: "/v1/runs/rd/retries/s1/2/dispatch", body: `{"cancel_version":1,"worker":"w1"}`, status: 201,
				check: wantAdmitted("retry:s1:2", state.BoundaryRetry, state.IntentInFlight, 2)},
			{name: "DispatchedTwiceRefused", method: "POST", path: "/v1/runs/rd/retries/s1/2/dispatch", body: `{}`, status: 409, code: state.RefusalInProgress},
			{name: "BadAttempt", method: "POST", path: "/v1/runs/rd/retries/s1/zero/dispatch", body: `{}`, status: 400, code: "invalid_request", message: "attempt \"zero\" in the path"},
			{name: "Cancel", method: "POST", path: "/v1/runs/rd/cancel", status: 202},
			{name: "RevokedNotDispatched", method: "POST", path: "/v1/runs/rd/retries/s2/2/dispatch", body: `{"cancel_version":1}`, status: 409,
				code: state.RefusalRunNotActive},
			{name: "StaysRevoked", method: "GET", path: "/v1/runs/rd/intents/retry:s2:2", status: 200, check: wantIntent("retry:s2:2", state.IntentRevoked)},
			{name: "DispatchedStillInFlight", method: "GET", path: "/v1/runs/rd/intents/retry:s1:2", status: 200, check: wantIntent("retry:s1:2", state.IntentInFlight)},
		})
	})
}

// TestRenewIsTheWorkersHeartbeat: renewing a claim extends its lease and
// tells the worker the run's state, so a cooperative worker learns of the
// cancel at its next checkpoint; a lease that is not the worker's any more
// is a 409.
func TestRenewIsTheWorkersHeartbeat(t *testing.T) {
	testkit.OnBothStores(t, func(t *testing.T, store state.Store) {
		srv := serve(t, store, "")
		renewed := func(status state.Status) func(t *testing.T, r reply) {
			return func(t *testing.T, r reply) {
				t.Helper()
				var got control.RenewResponse
				r.json(t, &got)
				if got.Run.Status != status || got.Intent.State != state.IntentInFlight || time.Until(got.Intent.LeaseExpires) < 50*time.Minute {
					t.Fatalf("renewed: run %s, intent %s leased until %s; want run %s, IN_FLIGHT for about an hour: %s",
						got.Run.Status, got.Intent.State, got.Intent.LeaseExpires, status, r.body)
				}
			}
		}
		run(t, srv, []spec{
			{name: "Admit", method: "POST", path: "/v1/runs", body: `{"run_id":"hb"}`, status: 201},
			{name: "Claim", method: "POST", path: "/v1/runs/hb/claims", body: `{"step_id":"s1","worker":"w1","lease_ttl":"1m"}`, status: 201},
			{name: "Renew", method: "POST", path: "/v1/runs/hb/intents/claim:s1/renew", body: `{"worker":"w1","lease_ttl":"1h"}`, status: 200,
				check: renewed(state.StatusActive)},
			{name: "Cancel", method: "POST", path: "/v1/runs/hb/cancel", status: 202},
			{name: "RenewTellsOfTheCancel", method: "POST", path: "/v1/runs/hb/intents/claim:s1/renew", body: `{"worker":"w1","lease_ttl":"1h"}`, status: 200,
				check: renewed(state.StatusCancelling)},
			{name: "AnotherWorker", method: "POST", path: "/v1/runs/hb/intents/claim:s1/renew", body: `{"worker":"w2"}`, status: 409,
				code: state.ConflictNotInFlight, message: "leased to \"w1\""},
			{name: "Release", method: "PATCH", path: "/v1/runs/hb/intents/claim:s1", body: `{"outcome":"not_sent"}`, status: 200},
			{name: "RenewAfterRelease", method: "POST", path: "/v1/runs/hb/intents/claim:s1/renew", body: `{"worker":"w1"}`, status: 409,
				code: state.ConflictNotInFlight, message: "NOT_SENT"},
			{name: "UnknownIntent", method: "POST", path: "/v1/runs/hb/intents/claim:nope/renew", body: `{}`, status: 404, code: "not_found", message: "no intent claim:nope"},
			{name: "BadTTL", method: "POST", path: "/v1/runs/hb/intents/claim:s1/renew", body: `{"lease_ttl":"-1s"}`, status: 400, code: "invalid_request", message: "lease_ttl"},
		})
	})
}

func TestIntentGuardedBeforeAndAfterCancel(t *testing.T) {
	testkit.OnBothStores(t, func(t *testing.T, store state.Store) {
		srv := serve(t, store, "")
		run(t, srv, []spec{
			{name: "Admit", method: "POST", path: "/v1/runs", body: `{"run_id":"g1"}`, status: 201},
			{name: "Send", method: "POST", path: "/v1/runs/g1/intents", header: operator,
				body:   `{"key":"mail-1","method":"SMTP","target":"smtp://mx.example.com/ops@example.com","body_digest":"sha256:aa","cancel_version":1,"carrier":"mailer-1"}`,
				status: 201, check: func(t *testing.T, r reply) {
					wantAdmitted("mail-1", state.BoundaryCustom, state.IntentInFlight, 1)(t, r)
					var g control.GuardResponse
					r.json(t, &g)
					if g.Intent.LeaseOwner != "mailer-1" || g.Intent.Method != "SMTP" || g.Intent.Target != "smtp://mx.example.com/ops@example.com" {
						t.Errorf("intent %+v", g.Intent)
					}
				}},
			{name: "ReplayWhileInFlight", method: "POST", path: "/v1/runs/g1/intents", body: `{"key":"mail-1","body_digest":"sha256:aa"}`, status: 409,
				code: state.RefusalInProgress},
			{name: "Get", method: "GET", path: "/v1/runs/g1/intents/mail-1", status: 200, check: wantIntent("mail-1", state.IntentInFlight)},
			{name: "Responded", method: "PATCH", path: "/v1/runs/g1/intents/mail-1", body: `{"outcome":"responded","status_code":250}`, status: 200,
				check: wantIntent("mail-1", state.IntentResponded, func(t *testing.T, in state.Intent) {
					if in.StatusCode != 250 || in.LeaseOwner != "" {
						t.Errorf("status code %d lease %q", in.StatusCode, in.LeaseOwner)
					}
				})},
			{name: "KeyReusedWithOtherBody", method: "POST", path: "/v1/runs/g1/intents", body: `{"key":"mail-1","body_digest":"sha256:bb"}`, status: 409,
				code: state.RefusalKeyReused, message: "mail-1"},
			{name: "Publish", method: "POST", path: "/v1/runs/g1/intents", body: `{"key":"pub/orders#1","method":"PUBLISH","target":"amqp://mq/orders"}`, status: 201,
				check: wantAdmitted("pub/orders#1", state.BoundaryCustom, state.IntentInFlight, 1)},
			{name: "EscapedKeyInPath", method: "PATCH", path: "/v1/runs/g1/intents/pub%2Forders%231", body: `{"outcome":"responded"}`, status: 200,
				check: wantIntent("pub/orders#1", state.IntentResponded)},
			{name: "Cancel", method: "POST", path: "/v1/runs/g1/cancel", status: 202},
			{name: "NewEffectAfterCancel", method: "POST", path: "/v1/runs/g1/intents", body: `{"key":"mail-2","cancel_version":1}`, status: 409,
				code: state.RefusalRunNotActive, check: wantRefusal("mail-2", state.StatusCancelling, 2, 1, state.IntentCancelledBeforeDispatch)},
			{name: "BrowserAfterCancel", method: "POST", path: "/v1/runs/g1/intents", body: `{"key":"click-1","boundary":"browser"}`, status: 409,
				code: state.RefusalRunNotActive, check: wantRefusal("click-1", state.StatusCancelling, 2, 0, state.IntentCancelledBeforeDispatch)},
			{name: "RecordedNeverDispatched", method: "GET", path: "/v1/runs/g1/intents/mail-2", status: 200,
				check: wantIntent("mail-2", state.IntentCancelledBeforeDispatch)},
		})
	})
}

func TestDeliveryAdmittedWhileCancellingRefusedOnceCancelled(t *testing.T) {
	testkit.OnBothStores(t, func(t *testing.T, store state.Store) {
		srv := serve(t, store, "")
		delivery := func(key string) string {
			return `{"key":"` + key + `","boundary":"delivery","method":"POST","target":"https://hooks.example.com/status","allow_cancelling":true}`
		}
		run(t, srv, []spec{
			{name: "Admit", method: "POST", path: "/v1/runs", body: `{"run_id":"d1"}`, status: 201},
			{name: "WorkInFlight", method: "POST", path: "/v1/runs/d1/intents", body: `{"key":"work-1"}`, status: 201},
			{name: "Cancel", method: "POST", path: "/v1/runs/d1/cancel", body: `{"drain_timeout":"1h"}`, status: 202},
			{name: "DeliveryWhileCancelling", method: "POST", path: "/v1/runs/d1/intents", body: delivery("status-1"), status: 201,
				check: wantAdmitted("status-1", state.BoundaryDelivery, state.IntentInFlight, 1)},
			{name: "DeliveryWithoutAllowRefused", method: "POST", path: "/v1/runs/d1/intents", body: `{"key":"status-x","boundary":"delivery"}`, status: 409,
				code: state.RefusalRunNotActive, check: wantRefusal("status-x", state.StatusCancelling, 2, 0, state.IntentCancelledBeforeDispatch)},
			{name: "OtherEffectRefused", method: "POST", path: "/v1/runs/d1/intents", body: `{"key":"work-2"}`, status: 409, code: state.RefusalRunNotActive},
			{name: "DeliveryDone", method: "PATCH", path: "/v1/runs/d1/intents/status-1", body: `{"outcome":"responded","status_code":204}`, status: 200,
				check: wantIntent("status-1", state.IntentResponded)},
			{name: "WorkDone", method: "PATCH", path: "/v1/runs/d1/intents/work-1", body: `{"outcome":"responded"}`, status: 200},
		})
		if got := tick(t, store, "d1"); got.Status != state.StatusCancelled {
			t.Fatalf("run %s after its intents finished and a tick, want CANCELLED", got.Status)
		}
		run(t, srv, []spec{
			{name: "DeliveryOnceCancelled", method: "POST", path: "/v1/runs/d1/intents", body: delivery("status-2"), status: 409,
				code: state.RefusalRunNotActive, message: "CANCELLED",
				check: wantRefusal("status-2", state.StatusCancelled, 2, 0, state.IntentCancelledBeforeDispatch)},
			{name: "RecordedNeverDispatched", method: "GET", path: "/v1/runs/d1/intents/status-2", status: 200,
				check: wantIntent("status-2", state.IntentCancelledBeforeDispatch)},
		})
	})
}

func TestOutcomeReports(t *testing.T) {
	store := testkit.FileStore(t)
	srv := serve(t, store, "")
	run(t, srv, []spec{
		{name: "Admit", method: "POST", path: "/v1/runs", body: `{"run_id":"o1"}`, status: 201},
		{name: "Begin", method: "POST", path: "/v1/runs/o1/intents", body: `{"key":"k1"}`, status: 201},
		{name: "UnknownKey", method: "PATCH", path: "/v1/runs/o1/intents/nope", body: `{"outcome":"responded"}`, status: 404,
			code: string(refusal.NotFound), message: "no intent nope"},
		{name: "UnknownRun", method: "PATCH", path: "/v1/runs/ghost/intents/k1", body: `{"outcome":"responded"}`, status: 404, code: string(refusal.NotFound)},
		{name: "BadOutcome", method: "PATCH", path: "/v1/runs/o1/intents/k1", body: `{"outcome":"done"}`, status: 400,
			code: string(refusal.InvalidRequest), message: `outcome "done"`},
		{name: "MissingOutcome", method: "PATCH", path: "/v1/runs/o1/intents/k1", body: `{}`, status: 400, code: string(refusal.InvalidRequest), message: "outcome is required"},
		{name: "AttemptZero", method: "PATCH", path: "/v1/runs/o1/intents/k1", body: `{"outcome":"responded","attempt":0}`, status: 400,
			code: string(refusal.InvalidRequest), message: "attempt 0"},
		{name: "BadStatusCode", method: "PATCH", path: "/v1/runs/o1/intents/k1", body: `{"outcome":"responded","status_code":1000}`, status: 400,
			code: string(refusal.InvalidRequest), message: "status code"},
		{name: "ReleasedNotSent", method: "PATCH", path: "/v1/runs/o1/intents/k1", body: `{"outcome":"NOT_SENT","attempt":1}`, status: 200,
			check: wantIntent("k1", state.IntentNotSent)},
		{name: "NotInFlight", method: "PATCH", path: "/v1/runs/o1/intents/k1", body: `{"outcome":"responded"}`, status: 409,
			code: state.ConflictNotInFlight, message: "NOT_SENT"},
		{name: "SecondAttempt", method: "POST", path: "/v1/runs/o1/intents", body: `{"key":"k1"}`, status: 201,
			check: wantAdmitted("k1", state.BoundaryCustom, state.IntentInFlight, 2)},
		{name: "StaleAttempt", method: "PATCH", path: "/v1/runs/o1/intents/k1", body: `{"outcome":"responded","attempt":1}`, status: 409,
			code: state.ConflictStaleAttempt, message: "attempt 1"},
		{name: "StillInFlight", method: "GET", path: "/v1/runs/o1/intents/k1", status: 200, check: wantIntent("k1", state.IntentInFlight)},
		{name: "CurrentAttemptByDefault", method: "PATCH", path: "/v1/runs/o1/intents/k1", header: operator, body: `{"outcome":"unknown","reason":"socket closed after write"}`,
			status: 200, check: wantIntent("k1", state.IntentUnknown, func(t *testing.T, in state.Intent) {
				if in.Attempts != 2 || in.Reason != "socket closed after write" {
					t.Errorf("attempts %d reason %q", in.Attempts, in.Reason)
				}
			})},
		{name: "NeverDispatchedIsNotInFlight", method: "POST", path: "/v1/runs/o1/intents", body: `{"key":"k2","cancel_version":9}`, status: 409, code: state.RefusalStaleVersion},
		{name: "PatchNeverDispatched", method: "PATCH", path: "/v1/runs/o1/intents/k2", body: `{"outcome":"responded"}`, status: 409, code: state.ConflictNotInFlight},
		{name: "GetUnknownKey", method: "GET", path: "/v1/runs/o1/intents/nope", status: 404, code: string(refusal.NotFound), message: "no intent nope"},
		{name: "PutNotAllowed", method: "PUT", path: "/v1/runs/o1/intents/k1", status: 405, code: string(refusal.MethodNotAllowed), check: func(t *testing.T, r reply) {
			if allow := r.header.Get("Allow"); allow != "GET, HEAD, PATCH" {
				t.Errorf("Allow %q", allow)
			}
		}},
	})
	events, err := store.Events(context.Background(), "o1")
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(events, func(e state.Event) bool {
		return e.Kind == state.EventIntentOutcome && e.To == string(state.IntentUnknown)
	})
	if i < 0 || events[i].Actor != operatorAlice || events[i].Intent != "k1" {
		t.Errorf("events %+v, want the UNKNOWN outcome recorded by the request's actor", events)
	}
}

// TestBoundaryBadInput: every field is checked before the store is asked,
// and the message names it.
func TestBoundaryBadInput(t *testing.T) {
	store := testkit.FileStore(t)
	srv := serve(t, store, "")
	do(t, srv, "POST", "/v1/runs", `{"run_id":"b1"}`, nil)
	long := strings.Repeat("s", control.MaxStepIDLen+1)
	tests := []struct {
		name, path, body, code, message string
	}{
		{"ClaimNoStep", "claims", `{}`, string(refusal.InvalidRequest), "step_id is required"},
		{"ClaimStepWithSpace", "claims", `{"step_id":"a b"}`, string(refusal.InvalidRequest), "step_id"},
		{"ClaimStepTooLong", "claims", `{"step_id":"` + long + `"}`, string(refusal.InvalidRequest), "step_id"},
		{"ClaimLeaseNotDuration", "claims", `{"step_id":"s","lease_ttl":"soon"}`, string(refusal.InvalidJSON), "lease_ttl"},
		{"ClaimLeaseWrongType", "claims", `{"step_id":"s","lease_ttl":true}`, string(refusal.InvalidJSON), "lease_ttl"},
		{"ClaimLeaseZero", "claims", `{"step_id":"s","lease_ttl":0}`, string(refusal.InvalidRequest), "lease_ttl"},
		{"ClaimLeaseTooLong", "claims", `{"step_id":"s","lease_ttl":"25h"}`, string(refusal.InvalidRequest), "lease_ttl"},
		{"ClaimNegativeVersion", "claims", `{"step_id":"s","cancel_version":-1}`, string(refusal.InvalidRequest), "cancel_version"},
		{"ClaimVersionAsString", "claims", `{"step_id":"s","cancel_version":"1"}`, string(refusal.InvalidJSON), "cancel_version"},
		{"ClaimWorkerTooLong", "claims", `{"step_id":"s","worker":"` + strings.Repeat("w", state.MaxTextLen+1) + `"}`, string(refusal.InvalidRequest), "worker"},
		{"ClaimUnknownField", "claims", `{"step_id":"s","step":"s"}`, string(refusal.UnknownField), `"step"`},
		{"RetryNoAttempt", "retries", `{"step_id":"s","not_before":"2030-01-01T00:00:00Z"}`, string(refusal.InvalidRequest), "attempt 0"},
		{"RetryNoTime", "retries", `{"step_id":"s","attempt":1}`, string(refusal.InvalidRequest), "not_before is required"},
		{"RetryBadTime", "retries", `{"step_id":"s","attempt":1,"not_before":"tomorrow"}`, string(refusal.InvalidRequest), "not_before"},
		{"RetryZeroTime", "retries", `{"step_id":"s","attempt":1,"not_before":"0001-01-01T00:00:00Z"}`, string(refusal.InvalidRequest), "not_before"},
		{"RetryNoStep", "retries", `{"attempt":1,"not_before":"2030-01-01T00:00:00Z"}`, string(refusal.InvalidRequest), "step_id"},
		{"IntentNoKey", "intents", `{"method":"SMTP"}`, string(refusal.InvalidRequest), "key is required"},
		{"IntentBadKey", "intents", `{"key":"a b"}`, string(refusal.InvalidRequest), "intent key"},
		{"IntentClaimKey", "intents", `{"key":"claim:s1"}`, string(refusal.InvalidRequest), "claim:"},
		{"IntentRetryKey", "intents", `{"key":"retry:s1:1"}`, string(refusal.InvalidRequest), "retry:"},
		{"IntentProxyBoundary", "intents", `{"key":"k","boundary":"http"}`, string(refusal.InvalidRequest), "boundary"},
		{"IntentUnknownBoundary", "intents", `{"key":"k","boundary":"smtp"}`, string(refusal.InvalidRequest), "boundary"},
		{"AllowCancellingNotDelivery", "intents", `{"key":"k","allow_cancelling":true}`, string(refusal.InvalidRequest), "allow_cancelling"},
		{"IntentTargetTooLong", "intents", `{"key":"k","target":"` + strings.Repeat("t", state.MaxTargetLen+1) + `"}`, string(refusal.InvalidRequest), "target"},
		{"IntentLeaseNegative", "intents", `{"key":"k","lease_ttl":"-1s"}`, string(refusal.InvalidRequest), "lease_ttl"},
		{"IntentNotJSON", "intents", `{"key":`, string(refusal.InvalidJSON), ""},
	}
	var specs []spec
	for _, tc := range tests {
		specs = append(specs, spec{name: tc.name, method: "POST", path: "/v1/runs/b1/" + tc.path, body: tc.body, status: 400, code: tc.code, message: tc.message})
	}
	specs = append(specs,
		spec{name: "BadRunInPath", method: "POST", path: "/v1/runs/bad%20id/claims", body: `{"step_id":"s"}`, status: 400, code: string(refusal.InvalidRequest), message: "run id"},
		spec{name: "BadKeyInPath", method: "GET", path: "/v1/runs/b1/intents/a%20b", status: 400, code: string(refusal.InvalidRequest), message: "intent key"},
		spec{name: "NothingRecorded", method: "GET", path: "/v1/runs/b1/intents", status: 200, check: func(t *testing.T, r reply) {
			if strings.TrimSpace(string(r.body)) != `{"intents":[]}` {
				t.Fatalf("bad input wrote intents: %s", r.body)
			}
		}},
	)
	run(t, srv, specs)
}
