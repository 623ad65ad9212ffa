package control_test

import (
	"context"
	"encoding/json"
	"maps"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/state"
)

// Who may do what on the control plane: the operator everything, a worker
// its own run's effects and reads, a reader reads. Every refusal here is
// decided before a body is read or the store is asked.

const readToken = "sgro_test-read-only-token"

func bearerOf(token string, more ...string) map[string]string {
	h := map[string]string{"Authorization": "Bearer " + token}
	for i := 0; i+1 < len(more); i += 2 {
		h[more[i]] = more[i+1]
	}
	return h
}

// mint asks the API, as the operator, for a run token of run.
func mint(t *testing.T, srv *httptest.Server, run string) string {
	t.Helper()
	r := do(t, srv, "POST", "/v1/runs/"+run+"/tokens", `{}`, nil)
	if r.status != http.StatusCreated {
		t.Fatalf("mint a token for %s: %d %s", run, r.status, r.body)
	}
	var tok control.TokenResponse
	r.json(t, &tok)
	return tok.Token
}

func forbidden(name, method, path, body string, header map[string]string, message string) spec {
	return spec{name: name, method: method, path: path, body: body, header: header, status: http.StatusForbidden, code: string(refusal.Forbidden), message: message}
}

func leasedTo(owner string) func(t *testing.T, r reply) {
	return func(t *testing.T, r reply) {
		t.Helper()
		var g control.GuardResponse
		r.json(t, &g)
		if !g.Admitted || g.Intent.LeaseOwner != owner {
			t.Fatalf("admitted %v, lease owner %q, want %q: %s", g.Admitted, g.Intent.LeaseOwner, owner, r.body)
		}
	}
}

func TestWorkerTokenActsForItsOwnRunOnly(t *testing.T) {
	signer, _ := runtoken.New([]byte("0123456789abcdef0123456789abcdef"))
	store := testkit.FileStore(t)
	srv := serveOpts(t, control.Options{Store: store, Token: testToken, ReadToken: readToken, Tokens: signer})
	for _, id := range []string{"r1", "r2"} {
		do(t, srv, "POST", "/v1/runs", `{"run_id":"`+id+`"}`, nil)
	}
	// An effect of r1 the egress proxy carries: no worker may report on it.
	do(t, srv, "POST", "/v1/runs/r1/intents", `{"key":"http-1","carrier":"stopgate@host/1-abc"}`, nil)
	worker := bearerOf(mint(t, srv, "r1"))
	// The worker says it is the operator: the header changes nothing.
	forged := bearerOf(mint(t, srv, "r1"), control.ActorHeader, "operator")
	named := func(owner string) func(t *testing.T, r reply) { return leasedTo(owner) }

	run(t, srv, []spec{
		{name: "ReadsItsRun", method: "GET", path: "/v1/runs/r1", header: worker, status: 200, check: wantRun(state.StatusActive, 1)},
		{name: "ReadsItsAudit", method: "GET", path: "/v1/runs/r1/audit", header: worker, status: 200},
		{name: "ClaimsForItsRun", method: "POST", path: "/v1/runs/r1/claims", body: `{"step_id":"s1"}`, header: forged, status: 201, check: named("worker:r1")},
		{name: "NamesItsProcess", method: "POST", path: "/v1/runs/r1/claims", body: `{"step_id":"s2","worker":"w-7"}`, header: worker, status: 201, check: named("worker:r1/w-7")},
		{name: "Heartbeat", method: "POST", path: "/v1/runs/r1/intents/claim:s2/renew", body: `{"worker":"w-7"}`, header: worker, status: 200},
		{name: "ReportsItsOutcome", method: "PATCH", path: "/v1/runs/r1/intents/claim:s1", body: `{"outcome":"responded","status_code":200}`, header: worker, status: 200,
			check: wantIntent("claim:s1", state.IntentResponded)},
		{name: "SchedulesARetry", method: "POST", path: "/v1/runs/r1/retries", body: `{"step_id":"s1","attempt":2,"not_before":"2030-01-01T00:00:00Z"}`, header: worker, status: 201},
		{name: "GuardsAnEffect", method: "POST", path: "/v1/runs/r1/intents", body: `{"key":"mail-1","carrier":"mailer"}`, header: worker, status: 201, check: named("worker:r1/mailer")},
		{name: "CannotRenewTheProxysLease", method: "POST", path: "/v1/runs/r1/intents/http-1/renew", body: `{"worker":"stopgate@host/1-abc"}`, header: worker,
			status: 409, code: state.ConflictNotInFlight, message: "not worker:r1/stopgate@host/1-abc's"},
		{name: "NotesAnEffect", method: "POST", path: "/v1/runs/r1/intents/mail-1/notes", body: `{"kind":"exec.signal","reason":"SIGTERM at the cancel"}`, header: worker, status: 201},
		{name: "CannotForgeStopgatesKinds", method: "POST", path: "/v1/runs/r1/intents/mail-1/notes", body: `{"kind":"intent.cut","reason":"x"}`, header: worker, status: 400, code: "invalid_request", message: "exec.NAME or worker.NAME"},
		{name: "CannotNoteAnUnknownIntent", method: "POST", path: "/v1/runs/r1/intents/nope/notes", body: `{"kind":"exec.signal"}`, header: worker, status: 404, code: "not_found"},
		forbidden("CannotNoteAnotherRun", "POST", "/v1/runs/r2/intents/mail-1/notes", `{"kind":"exec.signal"}`, worker, "own run only"),
		forbidden("CannotReportOnTheProxysEffect", "PATCH", "/v1/runs/r1/intents/http-1", `{"outcome":"not_sent"}`, worker, `carried by "stopgate@host/1-abc"`),
		forbidden("CannotCancel", "POST", "/v1/runs/r1/cancel", `{"reason":"agent decided"}`, worker, "need the operator token"),
		forbidden("CannotCancelWithABadBodyEither", "POST", "/v1/runs/r1/cancel", `{not json`, worker, "need the operator token"),
		forbidden("CannotComplete", "POST", "/v1/runs/r1/complete", `{"cancel_version":1}`, worker, "complete runs"),
		forbidden("CannotResolve", "POST", "/v1/runs/r1/intents/http-1/resolve", `{"outcome":"not_applied"}`, worker, "resolve"),
		forbidden("CannotMint", "POST", "/v1/runs/r1/tokens", `{}`, worker, "mint run tokens"),
		forbidden("CannotAdmit", "POST", "/v1/runs", `{"run_id":"fresh"}`, worker, "admit runs"),
		forbidden("CannotListRuns", "GET", "/v1/runs", "", worker, "its own run only"),
		forbidden("CannotReadAnotherRun", "GET", "/v1/runs/r2", "", worker, "of run r2"),
		forbidden("CannotReadAnotherRunsIntents", "GET", "/v1/runs/r2/intents", "", worker, "of run r2"),
		forbidden("CannotClaimForAnotherRun", "POST", "/v1/runs/r2/claims", `{"step_id":"s1"}`, worker, "acts for its own run only"),
		forbidden("CannotGuardForAnotherRun", "POST", "/v1/runs/r2/intents", `{"key":"k"}`, worker, "of run r2"),
		forbidden("CannotCancelAnotherRun", "POST", "/v1/runs/r2/cancel", "", worker, "need the operator token"),
		forbidden("CannotLaunchAnotherRunsBrowser", "POST", "/v1/runs/r2/browsers", `{}`, worker, "of run r2"),
		{name: "ExpiredTokenIs401", method: "GET", path: "/v1/runs/r1", header: bearerOf(signer.Sign("r1", 1, time.Now().Add(-time.Minute))),
			status: 401, code: string(refusal.Unauthorized), message: "expired"},
		{name: "ForeignSignatureIs401", method: "GET", path: "/v1/runs/r1", header: bearerOf(foreignToken(t, "r1")),
			status: 401, code: string(refusal.Unauthorized), message: "signature"},
		{name: "BothRunsStillActive", method: "GET", path: "/v1/runs?status=ACTIVE", status: 200, check: wantIDs("r1", "r2")},
		{name: "NothingRecordedOnR2", method: "GET", path: "/v1/runs/r2/intents", status: 200, check: func(t *testing.T, r reply) {
			if strings.TrimSpace(string(r.body)) != `{"intents":[]}` {
				t.Fatalf("r2 has intents after the worker of r1 was refused: %s", r.body)
			}
		}},
	})

	// The record names the worker by its token, never by its header.
	events, err := store.Events(context.Background(), "r1")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range events {
		if e.Intent == "claim:s1" && e.Actor != "worker:r1" {
			t.Errorf("event %s of claim:s1 by %q, want worker:r1 (the header said operator)", e.Kind, e.Actor)
		}
		if strings.Contains(e.Actor, "operator") && strings.HasPrefix(e.Intent, "claim:") {
			t.Errorf("a worker's header reached the record: %+v", e)
		}
	}
}

func foreignToken(t *testing.T, run string) string {
	other, err := runtoken.New([]byte(strings.Repeat("z", 32)))
	if err != nil {
		t.Fatal(err)
	}
	return other.Sign(run, 1, time.Now().Add(time.Hour))
}

func TestReadOnlyTokenChangesNothing(t *testing.T) {
	signer, _ := runtoken.New([]byte("0123456789abcdef0123456789abcdef"))
	store := testkit.FileStore(t)
	srv := serveOpts(t, control.Options{Store: store, Token: testToken, ReadToken: readToken, Tokens: signer})
	do(t, srv, "POST", "/v1/runs", `{"run_id":"r1"}`, nil)
	do(t, srv, "POST", "/v1/runs/r1/intents", `{"key":"k1"}`, nil)
	reader := bearerOf(readToken, control.ActorHeader, "operator")
	specs := []spec{
		{name: "Lists", method: "GET", path: "/v1/runs", header: reader, status: 200, check: wantIDs("r1")},
		{name: "Status", method: "GET", path: "/v1/runs/r1", header: reader, status: 200},
		{name: "Audit", method: "GET", path: "/v1/runs/r1/audit", header: reader, status: 200},
		{name: "Events", method: "GET", path: "/v1/runs/r1/events", header: reader, status: 200},
		{name: "Intents", method: "GET", path: "/v1/runs/r1/intents", header: reader, status: 200},
		{name: "Intent", method: "GET", path: "/v1/runs/r1/intents/k1", header: reader, status: 200},
	}
	for _, w := range []struct{ name, method, path, body string }{
		{"Admit", "POST", "/v1/runs", `{"run_id":"r2"}`},
		{"Cancel", "POST", "/v1/runs/r1/cancel", `{}`},
		{"Complete", "POST", "/v1/runs/r1/complete", `{"cancel_version":1}`},
		{"Claim", "POST", "/v1/runs/r1/claims", `{"step_id":"s"}`},
		{"Retry", "POST", "/v1/runs/r1/retries", `{"step_id":"s","attempt":1,"not_before":"2030-01-01T00:00:00Z"}`},
		{"Guard", "POST", "/v1/runs/r1/intents", `{"key":"k2"}`},
		{"Outcome", "PATCH", "/v1/runs/r1/intents/k1", `{"outcome":"responded"}`},
		{"Renew", "POST", "/v1/runs/r1/intents/k1/renew", `{}`},
		{"Resolve", "POST", "/v1/runs/r1/intents/k1/resolve", `{"outcome":"applied"}`},
		{"Mint", "POST", "/v1/runs/r1/tokens", `{}`},
		{"Browser", "POST", "/v1/runs/r1/browsers", `{}`},
	} {
		specs = append(specs, forbidden("Cannot"+w.name, w.method, w.path, w.body, reader, "a read-only token may not"))
	}
	specs = append(specs,
		spec{name: "StillActiveAtVersion1", method: "GET", path: "/v1/runs/r1", status: 200, check: wantRun(state.StatusActive, 1)},
		spec{name: "IntentUntouched", method: "GET", path: "/v1/runs/r1/intents/k1", status: 200, check: wantIntent("k1", state.IntentInFlight)})
	run(t, srv, specs)
}

// TestEveryEndpointNeedsAToken: without a credential, or with a wrong one,
// every endpoint but the probes, the scraper and the CA is a 401 that says
// how to authenticate, and changes nothing.
func TestEveryEndpointNeedsAToken(t *testing.T) {
	store := testkit.FileStore(t)
	srv := serveOpts(t, control.Options{Store: store, Token: testToken, ReadToken: readToken})
	do(t, srv, "POST", "/v1/runs", `{"run_id":"r1"}`, nil)
	endpoints := []struct{ method, path, body string }{
		{"POST", "/v1/runs", `{"run_id":"r2"}`},
		{"GET", "/v1/runs", ""},
		{"GET", "/v1/runs/r1", ""},
		{"POST", "/v1/runs/r1/cancel", `{}`},
		{"POST", "/v1/runs/r1/complete", `{"cancel_version":1}`},
		{"GET", "/v1/runs/r1/events", ""},
		{"GET", "/v1/runs/r1/intents", ""},
		{"GET", "/v1/runs/r1/audit", ""},
		{"POST", "/v1/runs/r1/claims", `{"step_id":"s"}`},
		{"POST", "/v1/runs/r1/retries", `{"step_id":"s","attempt":1,"not_before":"2030-01-01T00:00:00Z"}`},
		{"POST", "/v1/runs/r1/retries/s/1/dispatch", `{}`},
		{"POST", "/v1/runs/r1/intents", `{"key":"k"}`},
		{"GET", "/v1/runs/r1/intents/k", ""},
		{"PATCH", "/v1/runs/r1/intents/k", `{"outcome":"responded"}`},
		{"POST", "/v1/runs/r1/intents/k/renew", `{}`},
		{"POST", "/v1/runs/r1/intents/k/resolve", `{"outcome":"applied"}`},
		{"POST", "/v1/runs/r1/tokens", `{}`},
		{"POST", "/v1/runs/r1/browsers", `{}`},
		{"GET", "/v1/nowhere", ""},
		{"DELETE", "/v1/runs/r1", ""},
	}
	credentials := map[string]map[string]string{
		"None":             {"Authorization": ""},
		"Wrong":            {"Authorization": "Bearer sgop_guessed"},
		"NotBearer":        {"Authorization": "Basic " + testToken},
		"EmptyBearer":      {"Authorization": "Bearer "},
		"TheOperatorsName": {"Authorization": "", control.ActorHeader: "operator"},
	}
	var specs []spec
	for credName, header := range credentials {
		for _, e := range endpoints {
			specs = append(specs, spec{name: credName + "/" + e.method + e.path, method: e.method, path: e.path, body: e.body, header: maps.Clone(header),
				status: 401, code: string(refusal.Unauthorized), check: func(t *testing.T, r reply) {
					if !strings.HasPrefix(r.header.Get("WWW-Authenticate"), "Bearer") {
						t.Errorf("WWW-Authenticate %q, want Bearer", r.header.Get("WWW-Authenticate"))
					}
				}})
		}
	}
	none := map[string]string{"Authorization": ""}
	specs = append(specs,
		spec{name: "HealthzOpen", method: "GET", path: "/healthz", header: none, status: 200},
		spec{name: "ReadyzOpen", method: "GET", path: "/readyz", header: none, status: 200},
		spec{name: "CAOpen", method: "GET", path: "/v1/ca", header: none, status: 404, code: string(refusal.NotFound)},
		spec{name: "NothingChanged", method: "GET", path: "/v1/runs", status: 200, check: wantIDs("r1")},
		spec{name: "R1StillActive", method: "GET", path: "/v1/runs/r1", status: 200, check: wantRun(state.StatusActive, 1)},
	)
	run(t, srv, specs)
}

// TestActorComesFromTheToken: the operator may say who they are within the
// operator scope; the record says both, and which is proven.
func TestActorComesFromTheToken(t *testing.T) {
	store := testkit.FileStore(t)
	srv := serveOpts(t, control.Options{Store: store, Token: testToken})
	do(t, srv, "POST", "/v1/runs", `{"run_id":"r1"}`, map[string]string{control.ActorHeader: "cli:alice"})
	do(t, srv, "POST", "/v1/runs/r1/cancel", `{"reason":"x"}`, nil)
	events, err := store.Events(context.Background(), "r1")
	if err != nil || len(events) != 2 {
		t.Fatalf("events %+v %v", events, err)
	}
	if events[0].Actor != "operator (cli:alice)" || events[1].Actor != "operator" {
		t.Fatalf("actors %q, %q; want \"operator (cli:alice)\" and \"operator\"", events[0].Actor, events[1].Actor)
	}
}

// TestOpenControlPlane: served with Open, a caller without a credential is
// an anonymous operator, and the record says so; a credential presented is
// still checked and scoped.
func TestOpenControlPlane(t *testing.T) {
	signer, _ := runtoken.New([]byte("0123456789abcdef0123456789abcdef"))
	store := testkit.FileStore(t)
	srv := serveOpts(t, control.Options{Store: store, Open: true, Tokens: signer})
	none := map[string]string{"Authorization": "", control.ActorHeader: "cli:bob"}
	worker := bearerOf(signer.Sign("r1", 1, time.Now().Add(time.Hour)))
	run(t, srv, []spec{
		{name: "AdmitWithoutAToken", method: "POST", path: "/v1/runs", body: `{"run_id":"r1"}`, header: none, status: 201},
		{name: "WrongTokenStill401", method: "GET", path: "/v1/runs", header: bearerOf("sgop_wrong"), status: 401, code: string(refusal.Unauthorized)},
		{name: "WorkerStillScoped", method: "POST", path: "/v1/runs/r1/cancel", header: worker, status: 403, code: string(refusal.Forbidden)},
		{name: "RecordSaysAnonymous", method: "GET", path: "/v1/runs/r1/events", header: none, status: 200, check: func(t *testing.T, r reply) {
			var l control.EventList
			r.json(t, &l)
			if len(l.Events) != 1 || l.Events[0].Actor != "anonymous (cli:bob)" {
				t.Fatalf("events %s, want the admit by \"anonymous (cli:bob)\"", r.body)
			}
		}},
	})
}

func TestNewRefusesAnUnauthenticatedAPIUnlessAskedTo(t *testing.T) {
	store := testkit.FileStore(t)
	for name, opts := range map[string]control.Options{
		"NoToken":             {Store: store},
		"ReadTokenIsOperator": {Store: store, Token: "sgop_same", ReadToken: "sgop_same"},
		"TokenLooksSigned":    {Store: store, Token: "sg1.abc.def"},
	} {
		if _, err := control.New(opts); err == nil {
			t.Errorf("%s: control.New accepted %+v", name, opts)
		}
	}
	if _, err := control.New(control.Options{Store: store, Open: true}); err != nil {
		t.Errorf("Open: %v", err)
	}
}

// TestRefusalsDoNotEchoTokens: a token presented never comes back in an answer.
func TestRefusalsDoNotEchoTokens(t *testing.T) {
	store := testkit.FileStore(t)
	srv := serveOpts(t, control.Options{Store: store, Token: testToken, ReadToken: readToken})
	for _, tok := range []string{"sgop_guess-" + testToken, readToken} {
		r := do(t, srv, "POST", "/v1/runs/r1/cancel", `{}`, bearerOf(tok))
		var e refusal.Refusal
		_ = json.Unmarshal(r.body, &e)
		if strings.Contains(string(r.body), tok) || strings.Contains(string(r.body), testToken) {
			t.Errorf("answer %d echoes a token: %s", r.status, r.body)
		}
	}
}
