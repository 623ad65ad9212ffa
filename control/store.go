package control

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
)

// The store's reset: a Redis store that finds it lost writes it had
// acknowledged (emptied, rolled back, a row gone) is marked reset and
// admits nothing (state.ErrInconsistent, 503 on every edge) until an
// operator, having re-cancelled the runs that were lost, acknowledges it
// here. There is no run to audit that in: the acknowledgement is logged
// at WARN with its actor and reason, and kept in the store's marker.

// AcknowledgeResetPath is the operator's way out of a reset.
const AcknowledgeResetPath = "/v1/store/acknowledge-reset"

// AcknowledgeResetRequest is the body of POST /v1/store/acknowledge-reset.
type AcknowledgeResetRequest struct {
	// Reason says what was done about the runs the store lost (required).
	Reason string `json:"reason"`
}

// StoreMarker is the store's marker, the answer of an acknowledgement.
type StoreMarker = redisstore.Marker

// resetAcknowledger is a store that can be marked reset, and take an
// acknowledgement of it: the Redis store. The embedded store fsyncs every
// write before it acknowledges it and has no marker.
type resetAcknowledger interface {
	Acknowledge(ctx context.Context, actor, reason string) (redisstore.Marker, error)
}

// acknowledger finds the store under the ones wrapped around it (the
// measure every part calls the store through).
func acknowledger(s state.Store) (resetAcknowledger, bool) {
	for {
		if a, ok := s.(resetAcknowledger); ok {
			return a, true
		}
		u, ok := s.(interface{ Unwrap() state.Store })
		if !ok {
			return nil, false
		}
		s = u.Unwrap()
	}
}

// acknowledgeReset records an operator's acknowledgement of the store's
// reset: admissions resume.
func (h *Handler) acknowledgeReset(r *http.Request, actor string) (int, any, error) {
	var body AcknowledgeResetRequest
	if err := decode(r, &body); err != nil {
		return 0, nil, err
	}
	if body.Reason == "" {
		return 0, nil, fmt.Errorf("%w: reason is required: say what was done about the runs the store lost (e.g. which were cancelled again)", state.ErrInvalid)
	}
	if len(body.Reason) > state.MaxTextLen {
		return 0, nil, fmt.Errorf("%w: reason is %d bytes, longer than %d", state.ErrInvalid, len(body.Reason), state.MaxTextLen)
	}
	a, ok := acknowledger(h.store)
	if !ok {
		return 0, nil, refusal.New(refusal.NotFound, "this store keeps no reset marker (the embedded store fsyncs every write before it acknowledges it): there is no reset to acknowledge")
	}
	m, err := a.Acknowledge(r.Context(), actor, body.Reason)
	if errors.Is(err, redisstore.ErrNotReset) {
		return 0, nil, refusal.Wrap(err, refusal.StoreNotReset, "%v: there is nothing to acknowledge", err)
	}
	if err != nil {
		return 0, nil, err
	}
	h.log.Warn("control: the store's reset is acknowledged; runs are admitted again", "actor", actor, "reason", body.Reason,
		"reset_by", m.ResetBy, "reset_reason", m.ResetReason, "epoch", m.Epoch)
	return http.StatusOK, m, nil
}
