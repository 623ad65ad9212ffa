package control_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/state"
)

// fakeLauncher stands in for package browserguard: it passes the real
// guard of the store, and "starts" a browser without a process.
type fakeLauncher struct {
	store state.Store
	mu    sync.Mutex
	seen  map[string]bool
}

func (f *fakeLauncher) launch(ctx context.Context, req control.BrowserLaunch) (control.BrowserLaunched, error) {
	switch req.RunID {
	case "storedown":
		return control.BrowserLaunched{}, fmt.Errorf("launch: %w: redis timed out", state.ErrUnavailable)
	case "nochromium":
		return control.BrowserLaunched{}, errors.New("chromium /nowhere: executable file not found")
	case "full":
		return control.BrowserLaunched{}, fmt.Errorf("%w: 8 browsers are running", control.ErrBrowserLimit)
	}
	res, err := f.store.Guard(ctx, state.GuardRequest{
		RunID: req.RunID, ObservedVersion: req.ObservedVersion, Key: "launch", Boundary: state.BoundaryBrowser,
		Method: "launch", AutoAdmit: true, LeaseTTL: time.Minute, Actor: req.Actor,
	})
	if err != nil || !res.Admitted {
		return control.BrowserLaunched{Guard: res}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	created := !f.seen[req.RunID]
	f.seen[req.RunID] = true
	return control.BrowserLaunched{Guard: res, WSURL: "ws://127.0.0.1:1/run/" + req.RunID + "/1/devtools/browser/x", CancelVersion: 1, Created: created}, nil
}

func TestLaunchBrowser(t *testing.T) {
	store := testkit.FileStore(t)
	f := &fakeLauncher{store: store, seen: map[string]bool{}}
	srv := serveOpts(t, control.Options{Store: store, Browsers: f.launch})
	wantBrowser := func(created bool) func(t *testing.T, r reply) {
		return func(t *testing.T, r reply) {
			var b control.BrowserResponse
			r.json(t, &b)
			if b.RunID != "b1" || b.WSURL != "ws://127.0.0.1:1/run/b1/1/devtools/browser/x" || b.Created != created || b.Intent == "" {
				t.Fatalf("answer %s", r.body)
			}
		}
	}
	run(t, srv, []spec{
		{name: "launch", method: http.MethodPost, path: "/v1/runs/b1/browsers", status: http.StatusCreated, check: wantBrowser(true)},
		{name: "again", method: http.MethodPost, path: "/v1/runs/b1/browsers", body: `{"cancel_version":1}`, status: http.StatusOK, check: wantBrowser(false)},
		{name: "cancel", method: http.MethodPost, path: "/v1/runs/b1/cancel", status: http.StatusAccepted},
		{name: "refused after the cancel", method: http.MethodPost, path: "/v1/runs/b1/browsers", body: `{"cancel_version":1}`,
			status: http.StatusConflict, code: state.RefusalRunNotActive, message: "CANCELLING",
			check: wantRefusal("launch.3", state.StatusCancelling, 2, 1, state.IntentCancelledBeforeDispatch)},
		{name: "store down", method: http.MethodPost, path: "/v1/runs/storedown/browsers",
			status: http.StatusServiceUnavailable, code: string(refusal.StoreUnavailable), message: "redis timed out"},
		{name: "no chromium", method: http.MethodPost, path: "/v1/runs/nochromium/browsers",
			status: http.StatusServiceUnavailable, code: string(refusal.BrowserUnavailable), message: "the browser could not be started: chromium /nowhere"},
		{name: "browser limit", method: http.MethodPost, path: "/v1/runs/full/browsers",
			status: http.StatusServiceUnavailable, code: string(refusal.BrowserLimit), message: "no browser started for run full: browser limit reached: 8 browsers are running"},
		{name: "bad version", method: http.MethodPost, path: "/v1/runs/b2/browsers", body: `{"cancel_version":-1}`,
			status: http.StatusBadRequest, code: string(refusal.InvalidRequest), message: "negative"},
		{name: "bad run", method: http.MethodPost, path: "/v1/runs/bad%20run/browsers", status: http.StatusBadRequest, code: string(refusal.InvalidRequest)},
		{name: "GET", method: http.MethodGet, path: "/v1/runs/b1/browsers", status: http.StatusMethodNotAllowed, code: string(refusal.MethodNotAllowed)},
	})

	// Without a launcher the endpoint says so.
	srv = serveOpts(t, control.Options{Store: store})
	run(t, srv, []spec{{name: "no launcher", method: http.MethodPost, path: "/v1/runs/b3/browsers",
		status: http.StatusServiceUnavailable, code: string(refusal.BrowserUnavailable), message: "launches no browsers"}})
}

// TestBrowserLaunchCarriesTheWorkersOwnToken: a worker asking for its
// run's browser hands the launcher its own run token (which the URL then
// carries where tokens are required), so asking for a browser never makes
// it a new credential; the operator's call hands none.
func TestBrowserLaunchCarriesTheWorkersOwnToken(t *testing.T) {
	signer, _ := runtoken.New([]byte("0123456789abcdef0123456789abcdef"))
	store := testkit.FileStore(t)
	var got []control.BrowserLaunch
	var mu sync.Mutex
	launch := func(ctx context.Context, req control.BrowserLaunch) (control.BrowserLaunched, error) {
		mu.Lock()
		got = append(got, req)
		mu.Unlock()
		res, err := store.Guard(ctx, state.GuardRequest{RunID: req.RunID, Key: "launch", Boundary: state.BoundaryBrowser, Method: "launch", AutoAdmit: true, LeaseTTL: time.Minute})
		return control.BrowserLaunched{Guard: res, WSURL: "ws://127.0.0.1:1/run/" + req.RunID + "/x/devtools/browser/y", CancelVersion: 1, Created: true}, err
	}
	srv := serveOpts(t, control.Options{Store: store, Token: testToken, Tokens: signer, Browsers: launch})
	do(t, srv, "POST", "/v1/runs", `{"run_id":"w1"}`, nil)
	worker := mint(t, srv, "w1")
	run(t, srv, []spec{
		{name: "operator", method: http.MethodPost, path: "/v1/runs/w1/browsers", status: http.StatusCreated},
		{name: "worker", method: http.MethodPost, path: "/v1/runs/w1/browsers", header: bearerOf(worker), status: http.StatusCreated},
		{name: "another run's worker", method: http.MethodPost, path: "/v1/runs/w2/browsers", header: bearerOf(worker), status: http.StatusForbidden, code: string(refusal.Forbidden)},
	})
	if len(got) != 2 || got[0].Token != "" || got[1].Token != worker || got[1].Actor != "worker:w1" {
		t.Fatalf("launches %+v: want the operator's without a token, then the worker's with its own", got)
	}
}
