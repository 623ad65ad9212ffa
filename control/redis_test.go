package control_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/refusal"
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
