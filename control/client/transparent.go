package client

import (
	"context"
	"net/http"
	"net/url"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/redirect"
)

// Endpoints reads where the stopgate's listeners are (GET /v1/endpoints).
func (c *Client) Endpoints(ctx context.Context) (Reply[control.Endpoints], error) {
	return call[control.Endpoints](ctx, c, http.MethodGet, "/v1/endpoints", nil, nil)
}

// Bind asks for a transparent listener bound to a run, for the kernel to
// redirect one uid to (POST /v1/transparent/bindings). A uid that already
// has one is an *APIError 409 uid_bound.
func (c *Client) Bind(ctx context.Context, req control.BindingRequest) (Reply[redirect.Binding], error) {
	return call[redirect.Binding](ctx, c, http.MethodPost, "/v1/transparent/bindings", nil, req)
}

// RenewBinding keeps a binding for another lease.
func (c *Client) RenewBinding(ctx context.Context, id string) (Reply[redirect.Binding], error) {
	return call[redirect.Binding](ctx, c, http.MethodPost, "/v1/transparent/bindings/"+url.PathEscape(id)+"/renew", nil, nil)
}

// Unbind closes a binding's listener.
func (c *Client) Unbind(ctx context.Context, id string) error {
	_, _, err := c.do(ctx, http.MethodDelete, "/v1/transparent/bindings/"+url.PathEscape(id), nil, nil)
	return err
}
