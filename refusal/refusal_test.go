package refusal_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
)

// TestFromErrorClassifies: each kind of error becomes its one code; a call
// cut short because its caller went away is never a store failure, even
// when the store wraps it as unavailable.
func TestFromErrorClassifies(t *testing.T) {
	row := state.Run{ID: "r", Status: state.StatusCancelling, CancelVersion: 2}
	for _, tc := range []struct {
		name string
		err  error
		want refusal.Code
	}{
		{"invalid", fmt.Errorf("guard: %w: run id is empty", state.ErrInvalid), refusal.InvalidRequest},
		{"not found", fmt.Errorf("run x: %w", state.ErrNotFound), refusal.NotFound},
		{"unavailable", fmt.Errorf("redis guard: %w: dial refused", state.ErrUnavailable), refusal.StoreUnavailable},
		{"deadline", fmt.Errorf("guard: %w", context.DeadlineExceeded), refusal.StoreUnavailable},
		{"inconsistent", fmt.Errorf("redis guard: %w: the store was marked reset", state.ErrInconsistent), refusal.StoreUnavailable},
		{"caller gone", fmt.Errorf("filestore: guard: %w: %w", state.ErrUnavailable, context.Canceled), refusal.ClientGone},
		{"conflict", fmt.Errorf("complete: %w", &state.Conflict{Code: state.RefusalStaleVersion, Run: row}), refusal.StaleVersion},
		{"refusal", fmt.Errorf("edge: %w", refusal.New(refusal.DestinationDenied, "no")), refusal.DestinationDenied},
		{"anything else", errors.New("boom"), refusal.Internal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := refusal.FromError(tc.err)
			if r.Code != tc.want || r.Message == "" {
				t.Fatalf("FromError(%v) = %s %q, want %s", tc.err, r.Code, r.Message, tc.want)
			}
		})
	}
	if r := refusal.FromError(&state.Conflict{Code: state.RefusalRunNotActive, Run: row}); r.Run == nil || r.Run.CancelVersion != 2 || r.RunID != "r" {
		t.Fatalf("a conflict's refusal lacks its row: %+v", r)
	}
}

// TestGuardRefusalBody: a refused guard renders the contract's body, with
// the run's fields, on every HTTP edge; the headers name the code and the
// intent.
func TestGuardRefusalBody(t *testing.T) {
	req := state.GuardRequest{RunID: "run_42", ObservedVersion: 1, Key: "d-1"}
	res := state.GuardResult{Refusal: state.RefusalRunNotActive, Run: state.Run{ID: "run_42", Status: state.StatusCancelling, CancelVersion: 3},
		Intent: state.Intent{Key: "d-1", State: state.IntentCancelledBeforeDispatch}}
	w := httptest.NewRecorder()
	refusal.FromGuard(req, res).WriteHTTP(w)
	if w.Code != http.StatusConflict || w.Header().Get(refusal.Header) != "run_not_active" || w.Header().Get(refusal.IntentHeader) != "d-1" {
		t.Fatalf("%d %v", w.Code, w.Header())
	}
	var body map[string]any
	if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]any{
		"error": "run_not_active", "run_id": "run_42", "status": "CANCELLING", "cancel_version": 3.0,
		"observed_version": 1.0, "intent": "d-1", "recorded": "CANCELLED_BEFORE_DISPATCH",
	} {
		if body[k] != want {
			t.Errorf("body %s = %v, want %v: %s", k, body[k], want, w.Body)
		}
	}
	if msg, _ := body["message"].(string); !strings.Contains(msg, "run run_42 is CANCELLING at cancel_version 3") {
		t.Errorf("message %q does not say what the run is", msg)
	}
}

// TestEveryCodeHasAClientErrorOrServerErrorStatus: the table answers every
// code with a 4xx or 5xx, and 407 carries what a client needs to answer it.
func TestEveryCodeHasAClientErrorOrServerErrorStatus(t *testing.T) {
	for _, c := range []refusal.Code{
		refusal.RunNotActive, refusal.StaleVersion, refusal.RunNotAdmitted, refusal.IntentInProgress, refusal.KeyReused,
		refusal.IntentNotInFlight, refusal.IntentNotUnknown, refusal.StaleAttempt, refusal.StoreNotReset, refusal.NoRunIdentity, refusal.BadRunIdentity,
		refusal.Unauthorized, refusal.BadSignature, refusal.Forbidden, refusal.InvalidRequest, refusal.InvalidJSON,
		refusal.UnknownField, refusal.BadRequestBody, refusal.BodyTooLarge, refusal.UnsupportedMediaType, refusal.NotAProxyRequest,
		refusal.NotFound, refusal.MethodNotAllowed, refusal.DestinationDenied, refusal.InterceptionDisabled,
		refusal.TooManyConnections, refusal.HostNotAllowed, refusal.CommandNotAllowed, refusal.StoreUnavailable, refusal.UpstreamFailed,
		refusal.BrowserUnavailable, refusal.BrowserLimit, refusal.BrowserUnreachable, refusal.NoBrowser, refusal.Internal, refusal.ClientGone,
	} {
		if s := c.Status(); s < 400 || s > 599 {
			t.Errorf("%s answers %d", c, s)
		}
	}
	w := httptest.NewRecorder()
	refusal.New(refusal.NoRunIdentity, "no run").WriteHTTP(w)
	if w.Code != http.StatusProxyAuthRequired || w.Header().Get("Proxy-Authenticate") == "" {
		t.Fatalf("407 without Proxy-Authenticate: %d %v", w.Code, w.Header())
	}
}

// TestRefusalsARetryCannotChangeSayDoNotRetry: the refusals about the run
// or the request carry X-Should-Retry: false, which the OpenAI and
// Anthropic SDKs obey instead of retrying a 409 twice; a refusal about
// load or a failure leaves the SDK's own retry rules alone.
func TestRefusalsARetryCannotChangeSayDoNotRetry(t *testing.T) {
	for _, tc := range []struct {
		code  refusal.Code
		retry bool
	}{
		{refusal.RunNotActive, false},
		{refusal.StaleVersion, false},
		{refusal.RunNotAdmitted, false},
		{refusal.KeyReused, false},
		{refusal.DestinationDenied, false},
		{refusal.NoRunIdentity, false},
		{refusal.BodyTooLarge, false},
		{refusal.InterceptionDisabled, false},
		{refusal.IntentInProgress, true},
		{refusal.TooManyConnections, true},
		{refusal.StoreUnavailable, true},
		{refusal.UpstreamFailed, true},
		{refusal.Internal, true},
	} {
		t.Run(string(tc.code), func(t *testing.T) {
			if got := tc.code.Retryable(); got != tc.retry {
				t.Fatalf("Retryable() = %v, want %v", got, tc.retry)
			}
			w := httptest.NewRecorder()
			refusal.New(tc.code, "m").WriteHTTP(w)
			resp := refusal.New(tc.code, "m").Response(httptest.NewRequest("GET", "http://x/", nil))
			for edge, h := range map[string]http.Header{"WriteHTTP": w.Header(), "Response": resp.Header} {
				want := "false"
				if tc.retry {
					want = ""
				}
				if got := h.Get(refusal.ShouldRetryHeader); got != want {
					t.Errorf("%s: %s = %q, want %q", edge, refusal.ShouldRetryHeader, got, want)
				}
			}
		})
	}
}

// TestSDKClientsGetTheMessageWhereTheyReadIt: a request from an OpenAI or
// Anthropic SDK (X-Stainless-Lang) gets error as an object whose message
// and code those SDKs show, with every other field of the contract's body
// beside it; any other client gets error as the code itself. Both read
// back as the same refusal.
func TestSDKClientsGetTheMessageWhereTheyReadIt(t *testing.T) {
	req := state.GuardRequest{RunID: "run_42", ObservedVersion: 1, Key: "d-1"}
	res := state.GuardResult{Refusal: state.RefusalRunNotActive, Run: state.Run{ID: "run_42", Status: state.StatusCancelling, CancelVersion: 3},
		Intent: state.Intent{Key: "d-1", State: state.IntentCancelledBeforeDispatch}}
	r := refusal.FromGuard(req, res)
	plain := httptest.NewRequest("POST", "http://api.openai.com/v1/chat/completions", nil)
	sdk := httptest.NewRequest("POST", "http://api.openai.com/v1/chat/completions", nil)
	sdk.Header.Set("X-Stainless-Lang", "js")
	for _, tc := range []struct {
		name string
		req  *http.Request
	}{{"plain", plain}, {"sdk", sdk}} {
		t.Run(tc.name, func(t *testing.T) {
			resp := r.Response(tc.req)
			var body map[string]any
			if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
				t.Fatal(err)
			}
			for k, want := range map[string]any{
				"message": r.Message, "run_id": "run_42", "status": "CANCELLING", "cancel_version": 3.0,
				"observed_version": 1.0, "intent": "d-1", "recorded": "CANCELLED_BEFORE_DISPATCH",
			} {
				if body[k] != want {
					t.Errorf("body %s = %v, want %v", k, body[k], want)
				}
			}
			switch e := body["error"].(type) {
			case string:
				if tc.name != "plain" || e != "run_not_active" {
					t.Errorf("error = %q for a %s client", e, tc.name)
				}
			case map[string]any:
				if tc.name != "sdk" || e["code"] != "run_not_active" || e["message"] != r.Message || e["type"] != refusal.SDKErrorType {
					t.Errorf("error = %v for a %s client", e, tc.name)
				}
			default:
				t.Errorf("error = %#v", e)
			}
			resp = r.Response(tc.req)
			var back refusal.Refusal
			if err := json.NewDecoder(resp.Body).Decode(&back); err != nil || back.Code != refusal.RunNotActive || back.Message != r.Message || back.Intent != "d-1" {
				t.Errorf("read back: %+v %v", back, err)
			}
		})
	}
}

// TestConflictMessageDoesNotRepeatItsCode: a conflict's refusal says its
// code once, in the code; the message is the words after it, so that
// "code: message" reads run_not_active: run r is CANCELLED…, not twice.
func TestConflictMessageDoesNotRepeatItsCode(t *testing.T) {
	row := state.Run{ID: "r", Status: state.StatusCancelled, CancelVersion: 2}
	r := refusal.FromError(fmt.Errorf("complete: %w", &state.Conflict{Code: state.RefusalRunNotActive, Run: row, Detail: "a cancelled run cannot complete"}))
	if got := r.Error(); strings.Count(got, "run_not_active") != 1 || !strings.Contains(got, "run r is CANCELLED at cancel_version 2") {
		t.Fatalf("Error() = %q", got)
	}
}
