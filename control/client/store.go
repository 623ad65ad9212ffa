package client

import (
	"context"
	"net/http"

	"github.com/stopgate/stopgate/control"
)

// AcknowledgeReset acknowledges the store's reset (POST
// /v1/store/acknowledge-reset): the store lost writes it had acknowledged,
// the runs it lost were cancelled again, and runs may be admitted again.
// A store that is not marked reset is an *APIError 409 store_not_reset.
func (c *Client) AcknowledgeReset(ctx context.Context, reason string) (Reply[control.StoreMarker], error) {
	return call[control.StoreMarker](ctx, c, http.MethodPost, control.AcknowledgeResetPath, nil, control.AcknowledgeResetRequest{Reason: reason})
}
