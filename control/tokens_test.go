package control_test

import (
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/state"
)

func TestRunTokenIsIssuedForAnActiveRunOnly(t *testing.T) {
	signer, err := runtoken.New([]byte("0123456789abcdef0123456789abcdef"))
	if err != nil {
		t.Fatal(err)
	}
	store := testkit.FileStore(t)
	srv := serveOpts(t, control.Options{Store: store, Tokens: signer})
	issued := func(t *testing.T, r reply) {
		t.Helper()
		var got control.TokenResponse
		r.json(t, &got)
		c, err := signer.Verify(got.Token, time.Now())
		if err != nil || c.RunID != "tk" || c.Version != 1 || got.CancelVersion != 1 || time.Until(got.ExpiresAt) < 50*time.Minute || time.Until(got.ExpiresAt) > 61*time.Minute {
			t.Fatalf("token %+v: claims %+v %v", got, c, err)
		}
	}
	run(t, srv, []spec{
		{name: "Admit", method: "POST", path: "/v1/runs", body: `{"run_id":"tk"}`, status: 201},
		{name: "Issue", method: "POST", path: "/v1/runs/tk/tokens", body: `{"ttl":"1h"}`, status: 201, check: issued},
		{name: "BadTTL", method: "POST", path: "/v1/runs/tk/tokens", body: `{"ttl":"-5m"}`, status: 400, code: "invalid_request", message: "ttl"},
		{name: "TooLong", method: "POST", path: "/v1/runs/tk/tokens", body: `{"ttl":"9000h"}`, status: 400, code: "invalid_request", message: "at most"},
		{name: "UnknownRun", method: "POST", path: "/v1/runs/nobody/tokens", body: `{}`, status: 404, code: "not_found"},
		{name: "Cancel", method: "POST", path: "/v1/runs/tk/cancel", status: 202},
		{name: "NoneAfterCancel", method: "POST", path: "/v1/runs/tk/tokens", body: `{}`, status: 409, code: state.RefusalRunNotActive, message: "only an ACTIVE run"},
	})
	without := serve(t, store, "")
	run(t, without, []spec{
		{name: "NoSecret", method: "POST", path: "/v1/runs/tk/tokens", body: `{}`, status: 404, code: "not_found", message: "--run-token-secret"},
	})
}
