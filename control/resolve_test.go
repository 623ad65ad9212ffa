package control_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"slices"
	"testing"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
)

func sign(secret, body string) string {
	mac := hmac.New(sha256.New, []byte(secret))
	mac.Write([]byte(body))
	return "sha256=" + hex.EncodeToString(mac.Sum(nil))
}

func TestResolveByOperator(t *testing.T) {
	testkit.OnBothStores(t, func(t *testing.T, store state.Store) {
		srv := serve(t, store, "")
		run(t, srv, []spec{
			{name: "Admit", method: "POST", path: "/v1/runs", body: `{"run_id":"u1"}`, status: 201},
			{name: "Charge", method: "POST", path: "/v1/runs/u1/intents", body: `{"key":"charge-1","method":"POST","target":"https://pay.example.com/charges"}`, status: 201},
			{name: "Other", method: "POST", path: "/v1/runs/u1/intents", body: `{"key":"mail-1"}`, status: 201},
			{name: "ResolveInFlightRefused", method: "POST", path: "/v1/runs/u1/intents/charge-1/resolve", body: `{"outcome":"applied"}`, status: 409,
				code: state.ConflictNotUnknown, message: "IN_FLIGHT"},
			{name: "Cancel", method: "POST", path: "/v1/runs/u1/cancel", status: 202},
			{name: "CutAfterWrite", method: "PATCH", path: "/v1/runs/u1/intents/charge-1", body: `{"outcome":"unknown","reason":"connection reset after the body was sent"}`, status: 200},
			{name: "MailDone", method: "PATCH", path: "/v1/runs/u1/intents/mail-1", body: `{"outcome":"responded"}`, status: 200},
			{name: "RunUnknown", method: "GET", path: "/v1/runs/u1", status: 200, check: wantRun(state.StatusUnknown, 2)},
			{name: "BadOutcome", method: "POST", path: "/v1/runs/u1/intents/charge-1/resolve", body: `{"outcome":"yes"}`, status: 400,
				code: string(refusal.InvalidRequest), message: `outcome "yes"`},
			{name: "NoOutcome", method: "POST", path: "/v1/runs/u1/intents/charge-1/resolve", status: 400, code: string(refusal.InvalidRequest), message: "outcome is required"},
			{name: "OtherRunInBody", method: "POST", path: "/v1/runs/u1/intents/charge-1/resolve", body: `{"outcome":"applied","run_id":"u2"}`, status: 400,
				code: string(refusal.InvalidRequest), message: "run_id"},
			{name: "UnknownKey", method: "POST", path: "/v1/runs/u1/intents/nope/resolve", body: `{"outcome":"applied"}`, status: 404, code: string(refusal.NotFound)},
			{name: "StillUnknown", method: "GET", path: "/v1/runs/u1/intents/charge-1", status: 200, check: wantIntent("charge-1", state.IntentUnknown)},
			{name: "NotApplied", method: "POST", path: "/v1/runs/u1/intents/charge-1/resolve", header: operator,
				body: `{"outcome":"not_applied","note":"provider dashboard shows no charge"}`, status: 200,
				check: wantIntent("charge-1", state.IntentNotApplied, func(t *testing.T, in state.Intent) {
					if in.Source != control.DefaultResolveSource || in.Note != "provider dashboard shows no charge" {
						t.Errorf("source %q note %q", in.Source, in.Note)
					}
				})},
			{name: "ResolvedOnce", method: "POST", path: "/v1/runs/u1/intents/charge-1/resolve", body: `{"outcome":"applied"}`, status: 409,
				code: state.ConflictNotUnknown, message: "NOT_APPLIED"},
		})
		if got := tick(t, store, "u1"); got.Status != state.StatusCancelled || got.StatusReason != state.ReasonReconciled {
			t.Fatalf("run %s (%s) once its unknown intent is resolved, want CANCELLED (reconciled)", got.Status, got.StatusReason)
		}
		events, err := store.Events(context.Background(), "u1")
		if err != nil {
			t.Fatal(err)
		}
		i := slices.IndexFunc(events, func(e state.Event) bool { return e.Kind == state.EventIntentResolved })
		if i < 0 || events[i].Actor != operatorAlice || events[i].Reason != "operator: provider dashboard shows no charge" {
			t.Fatalf("resolution event: %+v", events)
		}
	})
}

// TestWebhookResolve: a provider holds no bearer token; its signature
// stands in for it on the resolve path only, and a bad one changes nothing.
func TestWebhookResolve(t *testing.T) {
	testkit.OnBothStores(t, func(t *testing.T, store state.Store) {
		secrets := map[string][]byte{"stripe": []byte("whsec_stripe"), "empty": nil}
		srv := serveOpts(t, control.Options{Store: store, Token: "s3cret", WebhookSecret: func(source string) ([]byte, bool) {
			s, ok := secrets[source]
			return s, ok
		}})
		bearer := map[string]string{"Authorization": "Bearer s3cret"}
		run(t, srv, []spec{
			{name: "Admit", method: "POST", path: "/v1/runs", header: bearer, body: `{"run_id":"w1"}`, status: 201},
			{name: "Charge", method: "POST", path: "/v1/runs/w1/intents", header: bearer, body: `{"key":"ch_1"}`, status: 201},
			{name: "Other", method: "POST", path: "/v1/runs/w1/intents", header: bearer, body: `{"key":"ch_2"}`, status: 201},
			{name: "Cancel", method: "POST", path: "/v1/runs/w1/cancel", header: bearer, status: 202},
			{name: "Cut", method: "PATCH", path: "/v1/runs/w1/intents/ch_1", header: bearer, body: `{"outcome":"unknown"}`, status: 200},
			{name: "CutOther", method: "PATCH", path: "/v1/runs/w1/intents/ch_2", header: bearer, body: `{"outcome":"unknown"}`, status: 200},
		})
		good := `{"outcome":"applied","source":"stripe","note":"evt_123 charge.succeeded","run_id":"w1","key":"ch_1"}`
		forOther := `{"outcome":"not_applied","source":"stripe","run_id":"w1","key":"ch_2"}`
		path := "/v1/runs/w1/intents/ch_1/resolve"
		sig := func(v string) map[string]string { return map[string]string{control.SignatureHeader: v} }
		before := eventKinds(t, store, "w1")

		refused := []spec{
			{name: "WrongSecret", body: good, header: sig(sign("whsec_other", good)), code: string(refusal.BadSignature)},
			{name: "TamperedBody", body: `{"outcome":"not_applied","source":"stripe","note":"evt_123 charge.succeeded","run_id":"w1","key":"ch_1"}`,
				header: sig(sign("whsec_stripe", good)), code: string(refusal.BadSignature)},
			{name: "UnknownSource", body: `{"outcome":"applied","source":"paypal","run_id":"w1","key":"ch_1"}`,
				header: sig(sign("whsec_stripe", `{"outcome":"applied","source":"paypal","run_id":"w1","key":"ch_1"}`)), code: string(refusal.BadSignature)},
			{name: "SourceWithoutSecret", body: `{"outcome":"applied","source":"empty","run_id":"w1","key":"ch_1"}`,
				header: sig(sign("", `{"outcome":"applied","source":"empty","run_id":"w1","key":"ch_1"}`)), code: string(refusal.BadSignature)},
			{name: "EmptySignature", body: good, header: sig(" "), code: string(refusal.BadSignature)},
			{name: "NotSHA256", body: good, header: sig("sha1=" + sign("whsec_stripe", good)[len("sha256="):]), code: string(refusal.BadSignature)},
			{name: "NotHex", body: good, header: sig("sha256=zz"), code: string(refusal.BadSignature)},
			{name: "ReplayedForAnotherIntent", body: forOther, header: sig(sign("whsec_stripe", forOther)), code: string(refusal.BadSignature)},
			{name: "MissingSignatureWithoutToken", body: good, code: string(refusal.Unauthorized)},
			{name: "TokenDoesNotSaveABadSignature", body: good, header: map[string]string{"Authorization": "Bearer s3cret", control.SignatureHeader: "sha256=00"},
				code: string(refusal.BadSignature)},
		}
		for i := range refused {
			refused[i].method, refused[i].path, refused[i].status, refused[i].message = "POST", path, 401, ""
		}
		// The signature opens the resolve path only: anywhere else it is
		// no credential at all.
		goodCancel := `{"reason":"x"}`
		refused = append(refused,
			spec{name: "SignatureOpensNoOtherPath", method: "POST", path: "/v1/runs/w1/cancel", body: goodCancel,
				header: sig(sign("whsec_stripe", goodCancel)), status: 401, code: string(refusal.Unauthorized)},
			spec{name: "SignatureOpensNoOtherMethod", method: "GET", path: path, header: sig(sign("whsec_stripe", "")),
				status: 401, code: string(refusal.Unauthorized)},
			spec{name: "SignatureOpensNoCleanedPath", method: "POST", path: "/v1/runs/w1/intents/ch_1/resolve/../../../../w1/cancel", body: goodCancel,
				header: sig(sign("whsec_stripe", goodCancel)), status: 401, code: string(refusal.Unauthorized)},
		)
		run(t, srv, refused)
		if in := intentState(t, store, "w1", "ch_1"); in.State != state.IntentUnknown {
			t.Fatalf("refused webhooks changed the intent: %s", in.State)
		}
		if after := eventKinds(t, store, "w1"); !slices.Equal(after, before) {
			t.Fatalf("refused webhooks wrote to the audit log:\nbefore %v\nafter  %v", before, after)
		}

		run(t, srv, []spec{
			{name: "SignedMissingBinding", method: "POST", path: path, body: `{"outcome":"applied","source":"stripe"}`,
				header: sig(sign("whsec_stripe", `{"outcome":"applied","source":"stripe"}`)), status: 400, code: string(refusal.InvalidRequest), message: "run_id and key"},
			{name: "GoodSignature", method: "POST", path: path, body: good, header: sig(sign("whsec_stripe", good)), status: 200,
				check: wantIntent("ch_1", state.IntentApplied, func(t *testing.T, in state.Intent) {
					if in.Source != "stripe" || in.Note != "evt_123 charge.succeeded" {
						t.Errorf("source %q note %q", in.Source, in.Note)
					}
				})},
			{name: "ReplayOfTheSameBody", method: "POST", path: path, body: good, header: sig(sign("whsec_stripe", good)), status: 409, code: state.ConflictNotUnknown},
			{name: "OtherBySignature", method: "POST", path: "/v1/runs/w1/intents/ch_2/resolve", body: forOther, header: sig(sign("whsec_stripe", forOther)), status: 200,
				check: wantIntent("ch_2", state.IntentNotApplied)},
		})
		events, err := store.Events(context.Background(), "w1")
		if err != nil {
			t.Fatal(err)
		}
		i := slices.IndexFunc(events, func(e state.Event) bool { return e.Kind == state.EventIntentResolved })
		if i < 0 || events[i].Actor != "webhook:stripe" || events[i].Intent != "ch_1" {
			t.Fatalf("resolution event: %+v", events)
		}
		if got := tick(t, store, "w1"); got.Status != state.StatusCancelled {
			t.Fatalf("run %s once every unknown intent is resolved", got.Status)
		}
	})
}

// TestWebhookWithoutSources: with no webhook source configured, every
// signed request is refused, token or not.
func TestWebhookWithoutSources(t *testing.T) {
	store := testkit.FileStore(t)
	srv := serve(t, store, "")
	body := `{"outcome":"applied","source":"stripe","run_id":"n1","key":"k"}`
	run(t, srv, []spec{
		{name: "Admit", method: "POST", path: "/v1/runs", body: `{"run_id":"n1"}`, status: 201},
		{name: "Signed", method: "POST", path: "/v1/runs/n1/intents/k/resolve", body: body,
			header: map[string]string{control.SignatureHeader: sign("anything", body)}, status: 401, code: string(refusal.BadSignature)},
	})
}
