package control

import (
	"fmt"
	"net/http"
	"time"

	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
)

// Run tokens: the control plane hands a worker a credential that names its
// run and the cancel version it observes, signed, for the egress proxy's
// password. A token carries no authority past its run's row: after the
// cancel the guard refuses it like any other identity of the run.

// DefaultTokenTTL and MaxTokenTTL bound a token's life.
const (
	DefaultTokenTTL = 24 * time.Hour
	MaxTokenTTL     = 30 * 24 * time.Hour
)

// TokenRequest is the body of POST /v1/runs/{run}/tokens.
type TokenRequest struct {
	TTL *TTL `json:"ttl,omitempty"`
}

// TokenResponse is a signed run token.
type TokenResponse struct {
	Token         string    `json:"token"`
	RunID         string    `json:"run_id"`
	CancelVersion int64     `json:"cancel_version"`
	ExpiresAt     time.Time `json:"expires_at"`
}

// issueToken signs a token for an ACTIVE run at its current version: a run
// that can start no work gets no credential to try.
func (h *Handler) issueToken(r *http.Request, _ string) (int, any, error) {
	if h.tokens == nil {
		return 0, nil, refusal.New(refusal.NotFound, "this stopgate issues no run tokens: start serve with --run-token-secret")
	}
	id, body, err := runRequest[TokenRequest](r)
	if err != nil {
		return 0, nil, err
	}
	ttl := DefaultTokenTTL
	if body.TTL != nil {
		ttl = time.Duration(*body.TTL)
		if ttl <= 0 || ttl > MaxTokenTTL {
			return 0, nil, fmt.Errorf("%w: ttl %s: want a positive duration of at most %s", state.ErrInvalid, ttl, MaxTokenTTL)
		}
	}
	run, err := h.store.Get(r.Context(), id)
	if err != nil {
		return 0, nil, fmt.Errorf("read run %s: %w", id, err)
	}
	if run.Status != state.StatusActive {
		return 0, nil, &state.Conflict{Code: state.RefusalRunNotActive, Run: run, Detail: "only an ACTIVE run gets a run token"}
	}
	expires := time.Now().Add(ttl).UTC().Truncate(time.Second)
	return http.StatusCreated, TokenResponse{
		Token: h.tokens.Sign(run.ID, run.CancelVersion, expires), RunID: run.ID,
		CancelVersion: run.CancelVersion, ExpiresAt: expires,
	}, nil
}
