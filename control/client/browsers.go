package client

import (
	"context"
	"net/http"

	"github.com/stopgate/stopgate/control"
)

// Browser starts the run's guarded browser in the server, or finds the one
// it has (POST /v1/runs/RUN/browsers), and returns the websocket URL an
// agent connects to. A run that is not ACTIVE is an *APIError 409 (the
// refused launch is recorded); a browser that could not start is 503
// browser_unavailable.
func (c *Client) Browser(ctx context.Context, runID string, req control.BrowserRequest) (Reply[control.BrowserResponse], error) {
	return call[control.BrowserResponse](ctx, c, http.MethodPost, runPath(runID, "browsers"), nil, req)
}
