package control

import (
	"context"
	"net/http"
	"time"

	"github.com/stopgate/stopgate/refusal"
)

// PolicyReloader reads serve's policy file again and applies it (SIGHUP
// does the same). A file that does not parse or validate leaves the policy
// in force as it is: the error is a *refusal.Refusal with code
// refusal.PolicyInvalid, saying what is wrong.
type PolicyReloader func(ctx context.Context, actor string) (PolicyReloaded, error)

// PolicyReloaded is the answer of POST /v1/policy/reload: the file read,
// the rules now in force by kind, and what the reload could not change.
type PolicyReloaded struct {
	Config     string         `json:"config"`
	ReloadedAt time.Time      `json:"reloaded_at"`
	Rules      map[string]int `json:"rules"`
	// Notes say what of the file takes effect only at the next start.
	Notes []string `json:"notes,omitempty"`
}

func (h *Handler) reloadPolicy(r *http.Request, actor string) (int, any, error) {
	if err := decode(r, &struct{}{}); err != nil {
		return 0, nil, err
	}
	if h.reload == nil {
		return 0, nil, refusal.New(refusal.NotFound, "this server has no policy file to reload: start stopgate serve with --config")
	}
	out, err := h.reload(r.Context(), actor)
	if err != nil {
		return 0, nil, err
	}
	return http.StatusOK, out, nil
}
