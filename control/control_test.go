package control_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
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

// The specs run against real stores behind a real HTTP server: the
// embedded store in a temporary directory here, Redis in redis_test.go.

// testToken is the operator token of the servers these tests start; do
// sends it unless a spec sets (or, with "", removes) Authorization.
const testToken = "sgop_test-operator-token"

func serve(t *testing.T, store state.Store, token string) *httptest.Server {
	t.Helper()
	if token == "" {
		token = testToken
	}
	h, err := control.New(control.Options{Store: store, Token: token, DrainTimeout: 30 * time.Second, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatalf("control.New: %v", err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

// reply is one answer as a test sees it.
type reply struct {
	status int
	header http.Header
	body   []byte
}

func (r reply) json(t *testing.T, into any) {
	t.Helper()
	if err := json.Unmarshal(r.body, into); err != nil {
		t.Fatalf("answer %d is not JSON (%v): %s", r.status, err, r.body)
	}
}

func do(t *testing.T, srv *httptest.Server, method, path, body string, header map[string]string) reply {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, srv.URL+path, rd)
	if err != nil {
		t.Fatalf("request %s %s: %v", method, path, err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Authorization", "Bearer "+testToken)
	for k, v := range header {
		if v == "" {
			req.Header.Del(k)
			continue
		}
		req.Header.Set(k, v)
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: reading answer: %v", method, path, err)
	}
	return reply{status: resp.StatusCode, header: resp.Header, body: b}
}

// spec is one request and what must come back. Specs of a walk run in
// order, each on the state the previous ones left.
type spec struct {
	name   string
	method string
	path   string
	body   string
	header map[string]string
	status int
	// code is the error code of a failure.
	code string
	// message must be contained in the error message.
	message string
	check   func(t *testing.T, r reply)
}

func run(t *testing.T, srv *httptest.Server, specs []spec) {
	t.Helper()
	for _, sp := range specs {
		t.Run(sp.name, func(t *testing.T) {
			r := do(t, srv, sp.method, sp.path, sp.body, sp.header)
			if r.status != sp.status {
				t.Fatalf("%s %s: status %d, want %d; body %s", sp.method, sp.path, r.status, sp.status, r.body)
			}
			if ct := r.header.Get("Content-Type"); ct != "application/json" {
				t.Errorf("Content-Type %q, want application/json", ct)
			}
			if r.status >= 400 {
				if got := r.header.Get(refusal.Header); got != sp.code {
					t.Errorf("%s header %q, want %q", refusal.Header, got, sp.code)
				}
				var e refusal.Refusal
				r.json(t, &e)
				if string(e.Code) != sp.code {
					t.Errorf("error code %q, want %q (message %q)", e.Code, sp.code, e.Message)
				}
				if e.Message == "" || !strings.Contains(e.Message, sp.message) {
					t.Errorf("error message %q, want it to say %q", e.Message, sp.message)
				}
			}
			if sp.check != nil {
				sp.check(t, r)
			}
		})
	}
}

func wantRun(status state.Status, version int64) func(t *testing.T, r reply) {
	return func(t *testing.T, r reply) {
		t.Helper()
		var run state.Run
		r.json(t, &run)
		if run.Status != status || run.CancelVersion != version {
			t.Fatalf("run %s/%d, want %s/%d: %s", run.Status, run.CancelVersion, status, version, r.body)
		}
		if run.Intents == nil {
			t.Errorf("row has no intents object: %s", r.body)
		}
	}
}

func wantCancel(status state.Status, version int64, changed bool, drain time.Duration) func(t *testing.T, r reply) {
	return func(t *testing.T, r reply) {
		t.Helper()
		var res control.CancelResponse
		r.json(t, &res)
		if res.Run.Status != status || res.Run.CancelVersion != version || res.Changed != changed {
			t.Fatalf("cancel gave %s/%d changed=%v, want %s/%d changed=%v: %s",
				res.Run.Status, res.Run.CancelVersion, res.Changed, status, version, changed, r.body)
		}
		if drain >= 0 {
			got := res.Run.DrainDeadline.Sub(res.Run.CancelledAt)
			if got < drain-time.Millisecond || got > drain+time.Millisecond {
				t.Errorf("drain deadline is %s after the cancel, want %s: %s", got, drain, r.body)
			}
		}
	}
}

// conflictRun checks the row a 409 carries.
func conflictRun(status state.Status, version int64) func(t *testing.T, r reply) {
	return func(t *testing.T, r reply) {
		t.Helper()
		var e refusal.Refusal
		r.json(t, &e)
		if e.Run == nil || e.Run.Status != status || e.Run.CancelVersion != version {
			t.Fatalf("409 carries run %+v, want %s/%d: %s", e.Run, status, version, r.body)
		}
	}
}

func listIDs(t *testing.T, r reply) []string {
	t.Helper()
	var l control.RunList
	r.json(t, &l)
	var ids []string
	for _, run := range l.Runs {
		ids = append(ids, run.ID)
	}
	return ids
}

func wantIDs(want ...string) func(t *testing.T, r reply) {
	return func(t *testing.T, r reply) {
		t.Helper()
		if got := listIDs(t, r); !slices.Equal(got, want) {
			t.Fatalf("runs %q, want %q", got, want)
		}
	}
}

// operator is an operator who says who they are; the audit log records
// that beside what the token proves (operatorAlice).
var operator = map[string]string{control.ActorHeader: "cli:alice"}

const operatorAlice = "operator (cli:alice)"

// walkSpecs covers every endpoint and every refusal that the store decides,
// so the same walk checks both stores give the API the same answers.
func walkSpecs() []spec {
	return []spec{
		{name: "HealthzAlwaysOK", method: "GET", path: "/healthz", status: 200},
		{name: "ReadyzPingsStore", method: "GET", path: "/readyz", status: 200},
		{name: "AdmitCreates", method: "POST", path: "/v1/runs", body: `{"run_id":"r1"}`, header: operator, status: 201, check: wantRun(state.StatusActive, 1)},
		{name: "AdmitIsIdempotent", method: "POST", path: "/v1/runs", body: `{"run_id":"r1"}`, status: 200, check: wantRun(state.StatusActive, 1)},
		{name: "GetRow", method: "GET", path: "/v1/runs/r1", status: 200, check: wantRun(state.StatusActive, 1)},
		{name: "ListActive", method: "GET", path: "/v1/runs?status=active", status: 200, check: wantIDs("r1")},
		{name: "ListBadStatus", method: "GET", path: "/v1/runs?status=RUNNING", status: 400, code: string(refusal.InvalidRequest), message: "RUNNING"},
		{name: "CancelWithGoDuration", method: "POST", path: "/v1/runs/r1/cancel", body: `{"reason":"operator pressed stop","drain_timeout":"45s"}`, header: operator, status: 202,
			check: wantCancel(state.StatusCancelling, 2, true, 45*time.Second)},
		{name: "CancelAgainIsNoOp", method: "POST", path: "/v1/runs/r1/cancel", status: 202, check: wantCancel(state.StatusCancelling, 2, false, 45*time.Second)},
		{name: "AdmitAfterCancelRefused", method: "POST", path: "/v1/runs", body: `{"run_id":"r1"}`, status: 409, code: state.RefusalRunNotActive, message: "CANCELLING",
			check: conflictRun(state.StatusCancelling, 2)},
		{name: "CompleteCancellingRefused", method: "POST", path: "/v1/runs/r1/complete", body: `{"cancel_version":2}`, status: 409, code: state.RefusalRunNotActive,
			check: conflictRun(state.StatusCancelling, 2)},
		{name: "ListCancelling", method: "GET", path: "/v1/runs?status=CANCELLING", status: 200, check: wantIDs("r1")},
		{name: "CancelWithSecondsAndServerDefault", method: "POST", path: "/v1/runs", body: `{"run_id":"r2"}`, status: 201},
		{name: "CancelDrainInSeconds", method: "POST", path: "/v1/runs/r2/cancel", body: `{"drain_timeout":1.5}`, status: 202,
			check: wantCancel(state.StatusCancelling, 2, true, 1500*time.Millisecond)},
		{name: "AdmitR3", method: "POST", path: "/v1/runs", body: `{"run_id":"r3"}`, status: 201},
		{name: "CancelEmptyBodyTakesDefaultDrain", method: "POST", path: "/v1/runs/r3/cancel", status: 202,
			check: wantCancel(state.StatusCancelling, 2, true, 30*time.Second)},
		{name: "CancelUnseenWritesTombstone", method: "POST", path: "/v1/runs/ghost/cancel", body: `{"reason":"never started"}`, status: 202,
			check: wantCancel(state.StatusCancelled, 2, true, -1)},
		{name: "AdmitTombstoneRefused", method: "POST", path: "/v1/runs", body: `{"run_id":"ghost"}`, status: 409, code: state.RefusalRunNotActive, message: "CANCELLED",
			check: conflictRun(state.StatusCancelled, 2)},
		{name: "AdmitDone", method: "POST", path: "/v1/runs", body: `{"run_id":"done"}`, status: 201},
		{name: "CompleteWrongVersion", method: "POST", path: "/v1/runs/done/complete", body: `{"cancel_version":7}`, status: 409, code: state.RefusalStaleVersion,
			check: conflictRun(state.StatusActive, 1)},
		{name: "CompleteWithoutVersion", method: "POST", path: "/v1/runs/done/complete", body: `{}`, status: 400, code: string(refusal.InvalidRequest), message: "cancel_version"},
		{name: "Complete", method: "POST", path: "/v1/runs/done/complete", body: `{"cancel_version":1,"reason":"finished"}`, status: 200, check: wantRun(state.StatusCompleted, 1)},
		{name: "CancelCompletedRefused", method: "POST", path: "/v1/runs/done/cancel", status: 409, code: state.RefusalRunNotActive, message: "COMPLETED",
			check: conflictRun(state.StatusCompleted, 1)},
		{name: "ListAll", method: "GET", path: "/v1/runs", status: 200, check: wantIDs("done", "ghost", "r1", "r2", "r3")},
		{name: "ListCompleted", method: "GET", path: "/v1/runs?status=COMPLETED", status: 200, check: wantIDs("done")},
		{name: "ListUnknownIsEmptyArray", method: "GET", path: "/v1/runs?status=UNKNOWN", status: 200, check: func(t *testing.T, r reply) {
			if !bytes.Contains(r.body, []byte(`"runs":[]`)) {
				t.Fatalf("empty list is not []: %s", r.body)
			}
		}},
		{name: "Events", method: "GET", path: "/v1/runs/r1/events", status: 200, check: func(t *testing.T, r reply) {
			var l control.EventList
			r.json(t, &l)
			var kinds []string
			for _, e := range l.Events {
				kinds = append(kinds, e.Kind)
			}
			if !slices.Equal(kinds, []string{state.EventRunAdmitted, state.EventRunCancelled}) {
				t.Fatalf("event kinds %q: %s", kinds, r.body)
			}
			if a := l.Events[1].Actor; a != operatorAlice {
				t.Errorf("cancel recorded actor %q, want %q: the token's scope and the name the operator gave", a, operatorAlice)
			}
			if l.Events[1].Reason != "operator pressed stop" {
				t.Errorf("cancel recorded reason %q", l.Events[1].Reason)
			}
		}},
		{name: "ActorWithoutAClaimIsTheScope", method: "GET", path: "/v1/runs/r2/events", status: 200, check: func(t *testing.T, r reply) {
			var l control.EventList
			r.json(t, &l)
			for _, e := range l.Events {
				if e.Actor != string(control.ScopeOperator) {
					t.Errorf("event %s by %q, want %q", e.Kind, e.Actor, control.ScopeOperator)
				}
			}
		}},
		{name: "IntentsEmptyArray", method: "GET", path: "/v1/runs/r1/intents", status: 200, check: func(t *testing.T, r reply) {
			if strings.TrimSpace(string(r.body)) != `{"intents":[]}` {
				t.Fatalf("got %s", r.body)
			}
		}},
		{name: "Audit", method: "GET", path: "/v1/runs/r1/audit", status: 200, check: func(t *testing.T, r reply) {
			var a control.Audit
			r.json(t, &a)
			if a.Run.ID != "r1" || a.Run.Status != state.StatusCancelling || a.Intents == nil || len(a.Events) != 2 {
				t.Fatalf("audit %s", r.body)
			}
			for _, field := range []string{`"run":{`, `"intents":[]`, `"events":[{`} {
				if !bytes.Contains(r.body, []byte(field)) {
					t.Errorf("audit lacks %s: %s", field, r.body)
				}
			}
		}},
		{name: "GetUnknownRun", method: "GET", path: "/v1/runs/nope", status: 404, code: string(refusal.NotFound), message: "nope"},
		{name: "EventsUnknownRun", method: "GET", path: "/v1/runs/nope/events", status: 404, code: string(refusal.NotFound), message: "nope"},
		{name: "IntentsUnknownRun", method: "GET", path: "/v1/runs/nope/intents", status: 404, code: string(refusal.NotFound)},
		{name: "AuditUnknownRun", method: "GET", path: "/v1/runs/nope/audit", status: 404, code: string(refusal.NotFound)},
		{name: "CompleteUnknownRun", method: "POST", path: "/v1/runs/nope/complete", body: `{"cancel_version":1}`, status: 404, code: string(refusal.NotFound)},
		{name: "BadRunIDInPath", method: "GET", path: "/v1/runs/bad%20id", status: 400, code: string(refusal.InvalidRequest), message: "run id"},
		{name: "BadRunIDInBody", method: "POST", path: "/v1/runs", body: `{"run_id":"brace{tag}"}`, status: 400, code: string(refusal.InvalidRequest), message: "run id"},
		{name: "EmptyRunID", method: "POST", path: "/v1/runs", body: `{}`, status: 400, code: string(refusal.InvalidRequest), message: "run id is empty"},
	}
}

func TestWalkOnFileStore(t *testing.T) {
	run(t, serve(t, testkit.FileStore(t), ""), walkSpecs())
}

// TestRequestErrors covers what the API refuses before the store is asked.
func TestRequestErrors(t *testing.T) {
	srv := serve(t, testkit.FileStore(t), "")
	big := `{"run_id":"r1","reason":"` + strings.Repeat("x", control.MaxBodyBytes) + `"}`
	run(t, srv, []spec{
		{name: "Setup", method: "POST", path: "/v1/runs", body: `{"run_id":"r1"}`, status: 201},
		{name: "BadJSON", method: "POST", path: "/v1/runs", body: `{"run_id":`, status: 400, code: string(refusal.InvalidJSON)},
		{name: "SyntaxError", method: "POST", path: "/v1/runs", body: `{"run_id" "r1"}`, status: 400, code: string(refusal.InvalidJSON), message: "byte"},
		{name: "NotAnObject", method: "POST", path: "/v1/runs", body: `["r1"]`, status: 400, code: string(refusal.InvalidJSON), message: "object"},
		{name: "UnknownField", method: "POST", path: "/v1/runs", body: `{"run_id":"r9","runid":"x"}`, status: 400, code: string(refusal.UnknownField), message: `"runid"`},
		{name: "WrongType", method: "POST", path: "/v1/runs", body: `{"run_id":42}`, status: 400, code: string(refusal.InvalidJSON), message: "run_id"},
		{name: "TwoValues", method: "POST", path: "/v1/runs", body: `{"run_id":"r9"}{"run_id":"r8"}`, status: 400, code: string(refusal.InvalidJSON), message: "one object"},
		{name: "VersionAsString", method: "POST", path: "/v1/runs/r1/complete", body: `{"cancel_version":"1"}`, status: 400, code: string(refusal.InvalidJSON), message: "cancel_version"},
		{name: "BadDrainString", method: "POST", path: "/v1/runs/r1/cancel", body: `{"drain_timeout":"soon"}`, status: 400, code: string(refusal.InvalidJSON), message: "drain_timeout"},
		{name: "BadDrainType", method: "POST", path: "/v1/runs/r1/cancel", body: `{"drain_timeout":true}`, status: 400, code: string(refusal.InvalidJSON), message: "drain_timeout"},
		{name: "NegativeDrain", method: "POST", path: "/v1/runs/r1/cancel", body: `{"drain_timeout":-5}`, status: 400, code: string(refusal.InvalidRequest), message: "drain timeout"},
		{name: "DrainTooLong", method: "POST", path: "/v1/runs/r1/cancel", body: `{"drain_timeout":"200h"}`, status: 400, code: string(refusal.InvalidRequest), message: "7 days"},
		{name: "StillActiveAfterRefusals", method: "GET", path: "/v1/runs/r1", status: 200, check: wantRun(state.StatusActive, 1)},
		{name: "ReasonTooLong", method: "POST", path: "/v1/runs/r1/cancel", body: `{"reason":"` + strings.Repeat("y", state.MaxTextLen+1) + `"}`, status: 400, code: string(refusal.InvalidRequest), message: "reason"},
		{name: "BodyTooLarge", method: "POST", path: "/v1/runs", body: big, status: 413, code: string(refusal.BodyTooLarge)},
		{name: "NotJSONContentType", method: "POST", path: "/v1/runs", body: `{"run_id":"r9"}`, header: map[string]string{"Content-Type": "text/plain"}, status: 415, code: string(refusal.UnsupportedMediaType), message: "text/plain"},
		{name: "FormContentType", method: "POST", path: "/v1/runs/r1/cancel", body: `reason=x`, header: map[string]string{"Content-Type": "application/x-www-form-urlencoded"}, status: 415, code: string(refusal.UnsupportedMediaType)},
		{name: "JSONWithCharset", method: "POST", path: "/v1/runs", body: `{"run_id":"r1"}`, header: map[string]string{"Content-Type": "application/json; charset=utf-8"}, status: 200},
		{name: "NoContentTypeIsJSON", method: "POST", path: "/v1/runs", body: `{"run_id":"r1"}`, header: map[string]string{"Content-Type": ""}, status: 200},
		{name: "WrongMethod", method: "DELETE", path: "/v1/runs/r1", status: 405, code: string(refusal.MethodNotAllowed), message: "DELETE", check: func(t *testing.T, r reply) {
			if allow := r.header.Get("Allow"); allow != "GET, HEAD" {
				t.Errorf("Allow %q, want GET, HEAD", allow)
			}
		}},
		{name: "GetOnCancel", method: "GET", path: "/v1/runs/r1/cancel", status: 405, code: string(refusal.MethodNotAllowed), check: func(t *testing.T, r reply) {
			if allow := r.header.Get("Allow"); allow != "POST" {
				t.Errorf("Allow %q, want POST", allow)
			}
		}},
		{name: "PutOnRuns", method: "PUT", path: "/v1/runs", status: 405, code: string(refusal.MethodNotAllowed), check: func(t *testing.T, r reply) {
			if allow := r.header.Get("Allow"); allow != "GET, HEAD, POST" {
				t.Errorf("Allow %q, want GET, HEAD, POST", allow)
			}
		}},
		{name: "PostOnHealthz", method: "POST", path: "/healthz", status: 405, code: string(refusal.MethodNotAllowed)},
		{name: "UnknownEndpoint", method: "GET", path: "/v2/runs", status: 404, code: string(refusal.NotFound), message: "/v2/runs"},
		{name: "UnknownSubresource", method: "GET", path: "/v1/runs/r1/bogus", status: 404, code: string(refusal.NotFound)},
		{name: "ActorTooLong", method: "POST", path: "/v1/runs/r1/cancel", header: map[string]string{control.ActorHeader: strings.Repeat("a", control.MaxActorLen+1)}, status: 400, code: string(refusal.InvalidRequest), message: control.ActorHeader},
		{name: "ActorNotASCII", method: "POST", path: "/v1/runs/r1/cancel", header: map[string]string{control.ActorHeader: "opérateur"}, status: 400, code: string(refusal.InvalidRequest), message: "printable"},
		{name: "ActorAtLimit", method: "GET", path: "/v1/runs/r1", header: map[string]string{control.ActorHeader: strings.Repeat("a", control.MaxActorLen)}, status: 200},
		{name: "NothingWrittenByRefusals", method: "GET", path: "/v1/runs/r1/events", status: 200, check: func(t *testing.T, r reply) {
			var l control.EventList
			r.json(t, &l)
			if len(l.Events) != 1 || l.Events[0].Kind != state.EventRunAdmitted {
				t.Fatalf("refused requests wrote events: %s", r.body)
			}
		}},
	})
}

func TestToken(t *testing.T) {
	srv := serve(t, testkit.FileStore(t), "s3cret")
	run(t, srv, []spec{
		{name: "Missing", method: "GET", path: "/v1/runs", header: map[string]string{"Authorization": ""}, status: 401, code: string(refusal.Unauthorized), message: "token", check: func(t *testing.T, r reply) {
			if !strings.HasPrefix(r.header.Get("WWW-Authenticate"), "Bearer") {
				t.Errorf("WWW-Authenticate %q", r.header.Get("WWW-Authenticate"))
			}
		}},
		{name: "Wrong", method: "POST", path: "/v1/runs", body: `{"run_id":"r1"}`, header: map[string]string{"Authorization": "Bearer s3cre7"}, status: 401, code: string(refusal.Unauthorized)},
		{name: "Prefix", method: "GET", path: "/v1/runs", header: map[string]string{"Authorization": "Bearer s3cret-and-more"}, status: 401, code: string(refusal.Unauthorized)},
		{name: "NotBearer", method: "GET", path: "/v1/runs", header: map[string]string{"Authorization": "Basic czNjcmV0"}, status: 401, code: string(refusal.Unauthorized)},
		{name: "UnknownPathStill401", method: "GET", path: "/v1/secret", status: 401, code: string(refusal.Unauthorized)},
		{name: "NothingAdmitted", method: "GET", path: "/v1/runs", header: map[string]string{"Authorization": "Bearer s3cret"}, status: 200, check: wantIDs()},
		{name: "Right", method: "POST", path: "/v1/runs", body: `{"run_id":"r1"}`, header: map[string]string{"Authorization": "Bearer s3cret"}, status: 201},
		{name: "SchemeAnyCase", method: "GET", path: "/v1/runs/r1", header: map[string]string{"Authorization": "bearer s3cret"}, status: 200},
		{name: "HealthzOpen", method: "GET", path: "/healthz", status: 200},
		{name: "ReadyzOpen", method: "GET", path: "/readyz", status: 200},
	})
}

// TestStoreClosed: a store that cannot answer is a 503 with the reason,
// never a 500; liveness stays up, readiness goes down.
func TestStoreClosed(t *testing.T) {
	store := testkit.FileStore(t)
	srv := serve(t, store, "")
	do(t, srv, "POST", "/v1/runs", `{"run_id":"r1"}`, nil)
	if err := store.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	run(t, srv, []spec{
		{name: "Healthz", method: "GET", path: "/healthz", status: 200},
		{name: "Readyz", method: "GET", path: "/readyz", status: 503, code: string(refusal.StoreUnavailable)},
		{name: "Get", method: "GET", path: "/v1/runs/r1", status: 503, code: string(refusal.StoreUnavailable)},
		{name: "List", method: "GET", path: "/v1/runs", status: 503, code: string(refusal.StoreUnavailable)},
		{name: "Admit", method: "POST", path: "/v1/runs", body: `{"run_id":"r2"}`, status: 503, code: string(refusal.StoreUnavailable)},
		{name: "Cancel", method: "POST", path: "/v1/runs/r1/cancel", status: 503, code: string(refusal.StoreUnavailable)},
		{name: "Complete", method: "POST", path: "/v1/runs/r1/complete", body: `{"cancel_version":1}`, status: 503, code: string(refusal.StoreUnavailable)},
		{name: "Audit", method: "GET", path: "/v1/runs/r1/audit", status: 503, code: string(refusal.StoreUnavailable)},
	})
}

// panicky is the real store with one method made to panic: fault injection,
// to check that a bug in a handler answers JSON and the server goes on.
type panicky struct{ state.Store }

func (panicky) Get(context.Context, string) (state.Run, error) { panic("injected") }

func TestPanicIsRecovered(t *testing.T) {
	store := testkit.FileStore(t)
	srv := serve(t, panicky{store}, "")
	run(t, srv, []spec{
		{name: "Panics", method: "GET", path: "/v1/runs/r1", status: 500, code: string(refusal.Internal), message: "internal error"},
		{name: "ServerGoesOn", method: "GET", path: "/v1/runs", status: 200},
	})
}

func TestDurationJSON(t *testing.T) {
	for in, want := range map[string]time.Duration{`"30s"`: 30 * time.Second, `"1m30s"`: 90 * time.Second, `30`: 30 * time.Second, `0.25`: 250 * time.Millisecond, `"45"`: 45 * time.Second, `0`: 0} {
		var d control.Duration
		if err := json.Unmarshal([]byte(in), &d); err != nil || time.Duration(d) != want {
			t.Errorf("%s: got %s, %v; want %s", in, time.Duration(d), err, want)
		}
	}
	for _, in := range []string{`"soon"`, `"30 parsecs"`, `1e300`, `{}`} {
		var d control.Duration
		if err := json.Unmarshal([]byte(in), &d); err == nil {
			t.Errorf("%s: accepted as %s", in, time.Duration(d))
		}
	}
	b, _ := json.Marshal(control.Duration(90 * time.Second))
	if string(b) != `"1m30s"` {
		t.Errorf("marshal: %s", b)
	}
}
