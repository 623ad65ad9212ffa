package control

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"

	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/signed"
	"github.com/stopgate/stopgate/state"
)

// Reconciliation of UNKNOWN intents through the API, two ways: an operator
// with the bearer token, or a provider's webhook signed with the secret of
// its source (providers do not hold our token).

// SignatureHeader carries a webhook's signature: "sha256=" and the hex
// HMAC-SHA256 of the raw request body under the source's secret.
const SignatureHeader = "X-Stopgate-Signature"

// resolvePath is the one path a signed request may reach without the token.
const resolvePath = "/v1/runs/{run}/intents/{key}/resolve"

// DefaultResolveSource is recorded when an operator names no source.
const DefaultResolveSource = "operator"

// hasSignature reports whether r takes the webhook path. ServeHTTP lets such a
// request past the token check only when it is routed to resolve, and
// resolve verifies every request this reports: both ask this one function,
// so nothing can pass the first without meeting the second.
func hasSignature(r *http.Request) bool {
	_, ok := r.Header[SignatureHeader]
	return ok
}

// signedWebhook reports whether r is a signed POST the mux routes to
// resolve. Asking the mux, rather than matching the path here, keeps its
// cleaning and escaping rules the only ones.
func (h *Handler) signedWebhook(r *http.Request) bool {
	if r.Method != http.MethodPost || !hasSignature(r) {
		return false
	}
	_, pattern := h.mux.Handler(r)
	return pattern == http.MethodPost+" "+resolvePath
}

// resolve reconciles an UNKNOWN intent to APPLIED or NOT_APPLIED.
func (h *Handler) resolve(r *http.Request, actor string) (int, any, error) {
	id, key, err := intentPath(r)
	if err != nil {
		return 0, nil, err
	}
	raw, err := bufferBody(r)
	if err != nil {
		return 0, nil, err
	}
	var body ResolveRequest
	if err := decode(r, &body); err != nil {
		return 0, nil, err
	}
	var applied bool
	switch strings.ToLower(body.Outcome) {
	case OutcomeApplied:
		applied = true
	case OutcomeNotApplied:
	case "":
		return 0, nil, fmt.Errorf("%w: outcome is required: applied or not_applied", state.ErrInvalid)
	default:
		return 0, nil, fmt.Errorf("%w: outcome %q: want applied or not_applied", state.ErrInvalid, body.Outcome)
	}
	source := body.Source
	if hasSignature(r) {
		if err := h.verifyWebhook(r, id, key, body, raw); err != nil {
			return 0, nil, err
		}
		actor = state.ResolutionWebhook + ":" + source
	} else {
		source = cmp.Or(source, DefaultResolveSource)
		// An operator need not name the intent in the body; one who does
		// must mean the one in the path.
		if body.RunID != "" && body.RunID != id {
			return 0, nil, fmt.Errorf("%w: run_id %q is not the run in the path (%s)", state.ErrInvalid, body.RunID, id)
		}
		if body.Key != "" && body.Key != key {
			return 0, nil, fmt.Errorf("%w: key %q is not the intent in the path (%s)", state.ErrInvalid, body.Key, key)
		}
	}
	in, err := h.resolveIntent(r.Context(), state.ResolveRequest{RunID: id, Key: key, Applied: applied, Source: source, Note: body.Note, Actor: actor})
	if err != nil {
		return 0, nil, err
	}
	return http.StatusOK, in, nil
}

// resolveIntent is the reconciliation of the API and of the console.
func (h *Handler) resolveIntent(ctx context.Context, req state.ResolveRequest) (state.Intent, error) {
	if err := req.Validate(); err != nil {
		return state.Intent{}, err
	}
	in, err := h.store.Resolve(ctx, req)
	if err != nil {
		return in, fmt.Errorf("resolve intent %s of run %s: %w", req.Key, req.RunID, err)
	}
	h.log.Info("intent resolved", "run", req.RunID, "key", req.Key, "state", in.State, "source", req.Source, "actor", req.Actor, "note", req.Note)
	return in, nil
}

// verifyWebhook authenticates a signed resolve: the body's source must be
// configured, the signature must be its secret's HMAC of the raw body, and
// the signed body must name the intent of the path, so that a body signed
// for one intent cannot be replayed against another. A body that lacks
// those fields is a 400 naming them; every failed check is the same 401:
// the caller holds no token, so it learns nothing about which sources
// exist. The server log says which check failed.
func (h *Handler) verifyWebhook(r *http.Request, runID, key string, body ResolveRequest, raw []byte) error {
	if body.Source == "" {
		return fmt.Errorf("%w: source is required on a signed request: the webhook source whose secret signed the body", state.ErrInvalid)
	}
	if body.RunID == "" || body.Key == "" {
		return fmt.Errorf("%w: run_id and key are required on a signed request: the signature covers them, so it is good for this intent only", state.ErrInvalid)
	}
	var secret []byte
	known := false
	if h.webhook != nil {
		secret, known = h.webhook(body.Source)
	}
	// The MAC is computed even for an unknown source, so that the time of
	// the answer does not tell which sources exist.
	wellFormed, match := signed.CheckWebhook(secret, raw, r.Header.Values(SignatureHeader))
	var reason string
	switch {
	case !wellFormed:
		reason = "malformed: want exactly one header sha256=<64 hex digits>"
	case !known || len(secret) == 0:
		reason = "unknown source"
	case !match:
		reason = "signature does not match"
	case body.RunID != runID || body.Key != key:
		reason = fmt.Sprintf("the signed body names intent %s of run %s", body.Key, body.RunID)
	}
	if reason == "" {
		return nil
	}
	h.log.Warn("control: webhook resolve refused", "run", runID, "key", key, "source", body.Source, "reason", reason, "remote", r.RemoteAddr)
	return refusal.New(refusal.BadSignature,
		"%s is not a valid sha256=<hex HMAC-SHA256 of the body> under the secret of source %q for intent %s of run %s: nothing was changed",
		SignatureHeader, body.Source, key, runID)
}

// bufferBody reads the whole body, bounded like decode, and puts it back
// for decode: a webhook's signature covers the bytes as sent, not what
// they decode to.
func bufferBody(r *http.Request) ([]byte, error) {
	if r.ContentLength > MaxBodyBytes {
		return nil, tooLarge()
	}
	raw, err := io.ReadAll(http.MaxBytesReader(nil, r.Body, MaxBodyBytes))
	if err != nil {
		return nil, decodeError(err)
	}
	r.Body = io.NopCloser(bytes.NewReader(raw))
	return raw, nil
}
