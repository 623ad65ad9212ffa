package control

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/state"
)

// The browser launcher's endpoint. The launcher itself (package
// browserguard) is passed in through Options.Browsers, so that this
// package stays the API and never starts a process.

// ErrBrowserLimit marks (errors.Is) a BrowserLauncher's error that refused
// a launch because too many browsers run; the error's text says how many.
var ErrBrowserLimit = errors.New("browser limit reached")

// BrowserRequest is the body of POST /v1/runs/{run}/browsers; it may be
// empty.
type BrowserRequest struct {
	// CancelVersion is the version the caller observed; it goes into the
	// websocket URL, and every action of the browser is checked against
	// it. 0 takes the run's version at the launch.
	CancelVersion int64 `json:"cancel_version,omitempty"`
}

// BrowserResponse is the answer: where the agent connects.
type BrowserResponse struct {
	RunID string `json:"run_id"`
	// WSURL is the guarded browser websocket URL,
	// ws://HOST/run/RUN/CREDENTIAL/devtools/browser/ID, where CREDENTIAL
	// is the cancel_version, or the run's token when tokens are required.
	WSURL         string `json:"ws_url"`
	CancelVersion int64  `json:"cancel_version"`
	// Created is false when the run already had a browser (200 rather
	// than 201).
	Created bool `json:"created"`
	// Intent is the key of the browser intent that records this launch.
	Intent string `json:"intent,omitempty"`
}

// BrowserLaunch asks a launcher for a run's browser.
type BrowserLaunch struct {
	RunID           string
	ObservedVersion int64
	// Actor is recorded on the launch's intent.
	Actor string
	// Token is the caller's own run token, when it called with one (a
	// worker): where tokens are required, the websocket URL carries it, so
	// that asking for a browser never makes a worker a new credential.
	Token string
}

// BrowserLaunched is a launcher's answer.
type BrowserLaunched struct {
	// Guard is the guard's decision on the launch; when it was refused,
	// nothing was started and the rest is empty.
	Guard         state.GuardResult
	WSURL         string
	CancelVersion int64
	Created       bool
}

// BrowserLauncher starts (or finds) a guarded browser for a run. Errors
// that wrap state.ErrUnavailable, state.ErrInvalid or a *state.Conflict are
// answered as the store's, ErrBrowserLimit as 503 browser_limit; any other
// is a browser that could not start.
type BrowserLauncher func(ctx context.Context, req BrowserLaunch) (BrowserLaunched, error)

// launchBrowser starts the run's guarded browser: 201 with its websocket
// URL, 200 when it was already running, the guard's refusal for a run that
// is not ACTIVE.
func (h *Handler) launchBrowser(r *http.Request, actor string) (int, any, error) {
	id, body, err := runRequest[BrowserRequest](r)
	if err != nil {
		return 0, nil, err
	}
	if body.CancelVersion < 0 {
		return 0, nil, fmt.Errorf("%w: cancel_version %d is negative", state.ErrInvalid, body.CancelVersion)
	}
	if h.browsers == nil {
		return 0, nil, refusal.New(refusal.BrowserUnavailable, "this stopgate launches no browsers")
	}
	// Starting Chromium takes longer than a store call may: the launcher
	// bounds the start itself, and a launch once admitted is carried to
	// its end and recorded even if the caller goes.
	launch := BrowserLaunch{RunID: id, ObservedVersion: body.CancelVersion, Actor: actor}
	if tok, err := bearer(r); err == nil && runtoken.IsToken(tok) {
		launch.Token = tok
	}
	got, err := h.browsers(context.WithoutCancel(r.Context()), launch)
	var conflict *state.Conflict
	switch {
	case err == nil && !got.Guard.Admitted:
		return 0, nil, refusal.FromGuard(state.GuardRequest{RunID: id, ObservedVersion: body.CancelVersion}, got.Guard)
	case err == nil:
	case errors.Is(err, state.ErrUnavailable), errors.Is(err, state.ErrInvalid), errors.As(err, &conflict):
		return 0, nil, err
	case errors.Is(err, ErrBrowserLimit):
		return 0, nil, refusal.Wrap(err, refusal.BrowserLimit, "no browser started for run %s: %v", id, err)
	default:
		h.log.Warn("control: browser launch failed", "run", id, "err", err)
		return 0, nil, refusal.New(refusal.BrowserUnavailable, "%s", "the browser could not be started: "+err.Error())
	}
	status := http.StatusOK
	if got.Created {
		status = http.StatusCreated
	}
	return status, BrowserResponse{RunID: id, WSURL: got.WSURL, CancelVersion: got.CancelVersion, Created: got.Created, Intent: got.Guard.Intent.Key}, nil
}
