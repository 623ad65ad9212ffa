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
		refusal.IntentNotInFlight, refusal.IntentNotUnknown, refusal.StaleAttempt, refusal.NoRunIdentity, refusal.BadRunIdentity,
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
