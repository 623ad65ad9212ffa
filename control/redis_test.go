package control_test

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
)

// TestWalkOnRedisStore runs the same walk against a real redis-server: the
// API must give the same answers whichever store is behind it.
func TestWalkOnRedisStore(t *testing.T) {
	redis := redisserver.Start(t, redisserver.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	store, err := redisstore.Open(ctx, redis.URL(), redisstore.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatalf("open redisstore: %v", err)
	}
	t.Cleanup(func() { _ = store.Close() })
	srv := serve(t, store, "")
	run(t, srv, walkSpecs())

	// A Redis that is gone is a 503 naming the store, never a 500.
	redis.Kill()
	run(t, srv, []spec{
		{name: "HealthzWithRedisDown", method: "GET", path: "/healthz", status: 200},
		{name: "ReadyzWithRedisDown", method: "GET", path: "/readyz", status: 503, code: string(refusal.StoreUnavailable)},
		{name: "GetWithRedisDown", method: "GET", path: "/v1/runs/r1", status: 503, code: string(refusal.StoreUnavailable)},
		{name: "CancelWithRedisDown", method: "POST", path: "/v1/runs/r9/cancel", status: 503, code: string(refusal.StoreUnavailable)},
	})
}

// TestAClaimAnsweredUnavailableIsNeverRecorded: a claim that waited on a
// paused Redis is answered 503 "nothing was done", and stays undone when
// Redis resumes and runs the queued script: the store fences every guard
// by its caller's deadline, so the worker's retry is a first claim (201),
// not a 409 intent_in_progress against a record nobody carries.
func TestAClaimAnsweredUnavailableIsNeverRecorded(t *testing.T) {
	redis := redisserver.Start(t, redisserver.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	store, err := redisstore.Open(ctx, redis.URL(), redisstore.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatalf("open redisstore: %v", err)
	}
	t.Cleanup(func() { _ = store.Close() })
	srv := serveOpts(t, control.Options{Store: store, StoreTimeout: 300 * time.Millisecond})
	run(t, srv, []spec{{name: "Admit", method: "POST", path: "/v1/runs", body: `{"run_id":"p1"}`, status: 201}})

	redis.Pause()
	resumed := false
	defer func() {
		if !resumed {
			redis.Resume()
		}
	}()
	run(t, srv, []spec{{name: "ClaimWhilePaused", method: "POST", path: "/v1/runs/p1/claims", body: `{"step_id":"s1","cancel_version":1}`,
		status: 503, code: string(refusal.StoreUnavailable)}})
	redis.Resume()
	resumed = true
	// Redis now runs what it had queued; a round trip on a fresh
	// connection comes after it.
	if err := store.Ping(ctx); err != nil {
		t.Fatalf("ping after resume: %v", err)
	}
	time.Sleep(200 * time.Millisecond)
	if in, err := store.Intent(ctx, "p1", "claim:s1"); !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("a claim answered 503 was recorded once Redis resumed: %+v, %v", in, err)
	}
	run(t, srv, []spec{{name: "ClaimAgain", method: "POST", path: "/v1/runs/p1/claims", body: `{"step_id":"s1","cancel_version":1}`,
		status: 201, check: wantAdmitted("claim:s1", state.BoundaryClaim, state.IntentInFlight, 1)}})
}
