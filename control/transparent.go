package control

import (
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/stopgate/stopgate/redirect"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
)

// Where this stopgate listens, and the transparent bindings of `stopgate
// exec --isolate`. The bindings themselves (listeners in the proxy) are
// passed in through Options.Transparent, so that this package stays the
// API and opens no socket.

// Endpoints is the answer to GET /v1/endpoints: what `stopgate exec` needs
// to put an agent behind this stopgate. Read-only; addresses as listened on.
type Endpoints struct {
	// Proxy is the egress proxy's host:port.
	Proxy string `json:"proxy"`
	// Transparent is the transparent listener's host:port; empty when
	// transparent mode is off (and then no bindings can be made).
	Transparent string `json:"transparent,omitempty"`
	// RunTokens is "off", "accepted" or "required": whether the proxy
	// verifies signed run tokens, and whether it takes nothing else.
	RunTokens string `json:"run_tokens"`
}

// Run-token modes of Endpoints.RunTokens.
const (
	RunTokensOff      = "off"
	RunTokensAccepted = "accepted"
	RunTokensRequired = "required"
)

// DefaultBindingTTL is a binding's life without renewal when the request names none.
const DefaultBindingTTL = 30 * time.Second

// BindingRequest is the body of POST /v1/transparent/bindings: a loopback
// listener bound to one run, for the kernel to redirect one uid to.
type BindingRequest struct {
	UID   *int64 `json:"uid"`
	RunID string `json:"run_id"`
	// CancelVersion is the version the caller observed; every request
	// through the binding is checked against it. 0 checks ACTIVE alone.
	CancelVersion int64 `json:"cancel_version,omitempty"`
	// LeaseTTL is how long the binding lives without a renewal; nil takes
	// DefaultBindingTTL.
	LeaseTTL *TTL `json:"lease_ttl,omitempty"`
}

// TransparentBinder makes, renews and ends bindings: the egress proxy's
// (proxy.Bindings), passed in so that this package opens no socket. Bind
// returns an error wrapping redirect.ErrUIDBound for a uid that has one;
// Renew and Unbind one wrapping redirect.ErrNoBinding for an id they do not
// know.
type TransparentBinder interface {
	Bind(uid uint32, runID string, version int64, ttl time.Duration) (redirect.Binding, error)
	Renew(id string) (redirect.Binding, error)
	Unbind(id string) error
}

func (h *Handler) endpoints(r *http.Request, _ string) (int, any, error) {
	return http.StatusOK, h.endpointInfo, nil
}

func (h *Handler) bind(r *http.Request, actor string) (int, any, error) {
	if h.transparent == nil {
		return 0, nil, transparentOff()
	}
	var body BindingRequest
	if err := decode(r, &body); err != nil {
		return 0, nil, err
	}
	if body.UID == nil {
		return 0, nil, fmt.Errorf("%w: uid is required", state.ErrInvalid)
	}
	if why := redirect.CheckUID(*body.UID); why != "" {
		return 0, nil, fmt.Errorf("%w: %s", state.ErrInvalid, why)
	}
	if err := state.ValidateRunID(body.RunID); err != nil {
		return 0, nil, err
	}
	if body.CancelVersion < 0 {
		return 0, nil, fmt.Errorf("%w: cancel_version %d is negative", state.ErrInvalid, body.CancelVersion)
	}
	ttl := DefaultBindingTTL
	if body.LeaseTTL != nil {
		ttl = time.Duration(*body.LeaseTTL)
	}
	b, err := h.transparent.Bind(uint32(*body.UID), body.RunID, body.CancelVersion, ttl)
	if err != nil {
		return 0, nil, bindingError(err)
	}
	h.log.Info("control: transparent binding made", "id", b.ID, "uid", b.UID, "run", b.RunID, "port", b.Port, "actor", actor)
	return http.StatusCreated, b, nil
}

func (h *Handler) renewBinding(r *http.Request, _ string) (int, any, error) {
	if h.transparent == nil {
		return 0, nil, transparentOff()
	}
	b, err := h.transparent.Renew(r.PathValue("id"))
	if err != nil {
		return 0, nil, bindingError(err)
	}
	return http.StatusOK, b, nil
}

func (h *Handler) unbind(r *http.Request, actor string) (int, any, error) {
	if h.transparent == nil {
		return 0, nil, transparentOff()
	}
	id := r.PathValue("id")
	if err := h.transparent.Unbind(id); err != nil {
		return 0, nil, bindingError(err)
	}
	h.log.Info("control: transparent binding removed", "id", id, "actor", actor)
	return http.StatusOK, map[string]string{"id": id, "status": "removed"}, nil
}

func transparentOff() error {
	return refusal.New(refusal.TransparentOff, "this stopgate has no transparent mode: start serve with --transparent-addr")
}

func bindingError(err error) error {
	switch {
	case errors.Is(err, redirect.ErrUIDBound):
		return refusal.Wrap(err, refusal.UIDBound, "%v", err)
	case errors.Is(err, redirect.ErrNoBinding):
		return refusal.Wrap(err, refusal.NotFound, "%v", err)
	}
	return err
}
