package control_test

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state/redisstore"
	"github.com/stopgate/stopgate/telemetry"
)

// TestAcknowledgeResetIsTheOperatorsWayOut: a Redis store emptied under
// the API refuses admissions (503, naming the reset and the way out) until
// an operator acknowledges the reset, with a reason; the acknowledgement
// is answered with the store's marker, and admits again. The store is
// reached through the measure serve wraps around it. A store that is not
// reset is a 409, the embedded store (no marker) a 404; readers and bad
// bodies are refused.
func TestAcknowledgeResetIsTheOperatorsWayOut(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	srvRedis := redisserver.Start(t, redisserver.Options{})
	store, err := redisstore.Open(ctx, srvRedis.URL(), redisstore.Options{Logger: slog.New(slog.DiscardHandler), CheckInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = store.Close() })
	measured := telemetry.New(telemetry.Options{}).Store(store)
	srv := serveOpts(t, control.Options{Store: measured, Token: testToken, ReadToken: readToken})
	const ack = control.AcknowledgeResetPath
	run(t, srv, []spec{
		{name: "AdmitBefore", method: "POST", path: "/v1/runs", body: `{"run_id":"a1"}`, status: 201},
		{name: "CancelBefore", method: "POST", path: "/v1/runs/a1/cancel", body: `{"reason":"stop"}`, status: 202},
		{name: "NotReset", method: "POST", path: ack, body: `{"reason":"nothing happened"}`, status: 409,
			code: string(refusal.StoreNotReset), message: "not marked reset"},
	})

	admin := redis.NewClient(&redis.Options{Addr: srvRedis.Addr()})
	t.Cleanup(func() { _ = admin.Close() })
	if err := admin.FlushDB(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if err := store.CheckMarker(ctx); err != nil {
		t.Fatal(err)
	}
	run(t, srv, []spec{
		{name: "AdmitAfterTheFlush", method: "POST", path: "/v1/runs", body: `{"run_id":"a2"}`, status: 503,
			code: string(refusal.StoreUnavailable), message: "acknowledge-reset"},
		{name: "ClaimAfterTheFlush", method: "POST", path: "/v1/runs/a1/claims", body: `{"step_id":"s1"}`, status: 503,
			code: string(refusal.StoreUnavailable), message: "marked reset"},
		{name: "ReadyzAfterTheFlush", method: "GET", path: "/readyz", status: 503, code: string(refusal.StoreUnavailable), message: "marked reset"},
		// The way out: cancel again what was lost, then acknowledge.
		{name: "CancelAgain", method: "POST", path: "/v1/runs/a1/cancel", body: `{"reason":"lost in the flush"}`, status: 202},
		{name: "ReaderMayNot", method: "POST", path: ack, body: `{"reason":"x"}`, header: bearerOf(readToken), status: 403,
			code: string(refusal.Forbidden)},
		{name: "NoReason", method: "POST", path: ack, body: `{}`, status: 400, code: string(refusal.InvalidRequest), message: "reason is required"},
		{name: "UnknownField", method: "POST", path: ack, body: `{"reason":"x","force":true}`, status: 400, code: string(refusal.UnknownField)},
		{name: "Acknowledge", method: "POST", path: ack, body: `{"reason":"a1 cancelled again"}`, status: 200,
			header: map[string]string{control.ActorHeader: "cli:carol"},
			check: func(t *testing.T, r reply) {
				var m control.StoreMarker
				r.json(t, &m)
				if m.State != redisstore.MarkerOK || !m.Acked || m.Reason != "a1 cancelled again" || m.By != "operator (cli:carol)" || m.ResetReason == "" {
					t.Fatalf("the acknowledged marker: %+v", m)
				}
			}},
		{name: "AckTwice", method: "POST", path: ack, body: `{"reason":"again"}`, status: 409, code: string(refusal.StoreNotReset)},
		{name: "AdmitAfterTheAck", method: "POST", path: "/v1/runs", body: `{"run_id":"a2"}`, status: 201},
		{name: "TheRecancelledRunStaysCancelled", method: "POST", path: "/v1/runs", body: `{"run_id":"a1"}`, status: 409,
			code: string(refusal.RunNotActive)},
		{name: "ReadyzAfterTheAck", method: "GET", path: "/readyz", status: 200},
	})

	embedded := serveOpts(t, control.Options{Store: testkit.FileStore(t), Token: testToken})
	run(t, embedded, []spec{{name: "EmbeddedHasNoMarker", method: "POST", path: ack, body: `{"reason":"x"}`, status: 404,
		code: string(refusal.NotFound), message: "no reset marker"}})
	if _, err := store.Acknowledge(ctx, "t", "x"); !errors.Is(err, redisstore.ErrNotReset) {
		t.Fatalf("store.Acknowledge of a store not reset: %v", err)
	}
}
