package control

import (
	"cmp"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/telemetry"
)

// The boundaries that do not travel through the egress proxy: queue claims,
// retry scheduling and a generic intent API for any other effect (an
// e-mail, a queue publish, a delivery), with the outcome report of each.
// Every one is the store's one atomic guard; the handlers only shape the
// request and the answer.

// Bounds of the leases these endpoints grant.
const (
	// DefaultLeaseTTL is the lease of a claim or an intent that names none:
	// long enough for a worker's step, short enough that a dead worker's
	// claim turns UNKNOWN the same morning.
	DefaultLeaseTTL = 10 * time.Minute
	// MaxLeaseTTL bounds a lease: a carrier that needs longer must report
	// an outcome and take a new attempt.
	MaxLeaseTTL = 24 * time.Hour
	// MaxStepIDLen leaves room in an intent key for "retry:" and ":<attempt>".
	MaxStepIDLen = 200
)

// genericBoundaries are the boundaries POST /v1/runs/{run}/intents takes:
// http and tunnel are the egress proxy's, claim and retry have endpoints of
// their own with their own keys.
var genericBoundaries = []state.Boundary{state.BoundaryCustom, state.BoundaryDelivery, state.BoundaryBrowser}

// intentKey reads and checks the {key} path segment.
func intentKey(r *http.Request) (string, error) {
	key := r.PathValue("key")
	if err := state.ValidateKey(key); err != nil {
		return "", err
	}
	return key, nil
}

// intentPath reads the run and the intent key of an /intents/{key} path.
func intentPath(r *http.Request) (run, key string, err error) {
	if run, err = runID(r); err != nil {
		return "", "", err
	}
	if key, err = intentKey(r); err != nil {
		return "", "", err
	}
	return run, key, nil
}

// intentRequest reads a request on one intent with a body: the path's run
// and key first, then the body.
func intentRequest[T any](r *http.Request) (run, key string, body T, err error) {
	if run, key, err = intentPath(r); err != nil {
		return "", "", body, err
	}
	if err = decode(r, &body); err != nil {
		return "", "", body, err
	}
	return run, key, body, nil
}

// leaseOf is who holds a lease and for how long: the named worker, else
// the actor; for a caller with a worker token, always that worker (the
// name it gives only tells its processes apart, see Principal.workerOwner).
func leaseOf(r *http.Request, worker string, ttl *TTL, actor string) (string, time.Duration, error) {
	if err := checkText("worker", worker); err != nil {
		return "", 0, err
	}
	d, err := leaseTTL(ttl)
	if err != nil {
		return "", 0, err
	}
	return ownerOf(r, worker, actor), d, nil
}

func ownerOf(r *http.Request, name, actor string) string {
	if p := principalOf(r); p.Scope == ScopeWorker {
		return p.workerOwner(name)
	}
	return cmp.Or(name, actor)
}

func checkStepID(step string) error {
	if step == "" {
		return fmt.Errorf("%w: step_id is required", state.ErrInvalid)
	}
	if len(step) > MaxStepIDLen {
		return fmt.Errorf("%w: step_id is %d bytes, longer than %d", state.ErrInvalid, len(step), MaxStepIDLen)
	}
	// The step id becomes part of an intent key, and keys are printable
	// ASCII without spaces so that they fit any store and any header.
	for i := 0; i < len(step); i++ {
		if step[i] < 0x21 || step[i] > 0x7e {
			return fmt.Errorf("%w: step_id %q has a byte outside printable ASCII (or a space) at offset %d", state.ErrInvalid, step, i)
		}
	}
	return nil
}

func checkText(field, s string) error {
	if len(s) > state.MaxTextLen {
		return fmt.Errorf("%w: %s is %d bytes, longer than %d", state.ErrInvalid, field, len(s), state.MaxTextLen)
	}
	return nil
}

// leaseTTL applies the default and the bounds to a requested lease.
func leaseTTL(ttl *TTL) (time.Duration, error) {
	if ttl == nil {
		return DefaultLeaseTTL, nil
	}
	d := time.Duration(*ttl)
	if d <= 0 {
		return 0, fmt.Errorf("%w: lease_ttl %s: want a positive duration such as \"10m\" or 600", state.ErrInvalid, d)
	}
	if d > MaxLeaseTTL {
		return 0, fmt.Errorf("%w: lease_ttl %s is longer than %s", state.ErrInvalid, d, MaxLeaseTTL)
	}
	return d, nil
}

// claim takes a queued step for a worker: IN_FLIGHT under "claim:<step>",
// leased to the worker until it reports an outcome or the lease expires
// (then UNKNOWN, never silently handed to another worker).
func (h *Handler) claim(r *http.Request, actor string) (int, any, error) {
	id, body, err := runRequest[ClaimRequest](r)
	if err != nil {
		return 0, nil, err
	}
	if err := checkStepID(body.StepID); err != nil {
		return 0, nil, err
	}
	owner, ttl, err := leaseOf(r, body.Worker, body.LeaseTTL, actor)
	if err != nil {
		return 0, nil, err
	}
	return h.guard(r, state.GuardRequest{
		RunID: id, ObservedVersion: body.CancelVersion, Key: state.ClaimKey(body.StepID), ExplicitKey: true,
		Boundary: state.BoundaryClaim, LeaseOwner: owner, LeaseTTL: ttl, Actor: actor,
	})
}

// retry schedules one attempt of a step: SCHEDULED under
// "retry:<step>:<attempt>", unleased; the cancel revokes it in its own
// atomic step.
func (h *Handler) retry(r *http.Request, actor string) (int, any, error) {
	id, body, err := runRequest[RetryRequest](r)
	if err != nil {
		return 0, nil, err
	}
	if err := checkStepID(body.StepID); err != nil {
		return 0, nil, err
	}
	if body.Attempt < 1 {
		return 0, nil, fmt.Errorf("%w: attempt %d: want the attempt number being scheduled (1 or more)", state.ErrInvalid, body.Attempt)
	}
	if body.NotBefore == "" {
		return 0, nil, fmt.Errorf("%w: not_before is required: the RFC 3339 time the retry may start", state.ErrInvalid)
	}
	at, err := time.Parse(time.RFC3339, body.NotBefore)
	if err != nil {
		return 0, nil, fmt.Errorf("%w: not_before %q: want an RFC 3339 time such as 2026-01-02T10:00:00Z", state.ErrInvalid, body.NotBefore)
	}
	if at.IsZero() {
		// The guard reads a zero NotBefore as "dispatch now".
		return 0, nil, fmt.Errorf("%w: not_before %q is the zero time", state.ErrInvalid, body.NotBefore)
	}
	return h.guard(r, state.GuardRequest{
		RunID: id, ObservedVersion: body.CancelVersion, Key: state.RetryKey(body.StepID, body.Attempt),
		ExplicitKey: true, Boundary: state.BoundaryRetry, NotBefore: at, Actor: actor,
	})
}

// dispatchRetry runs a scheduled retry when its time has come: the same
// guard, on the same "retry:<step>:<attempt>" key, now IN_FLIGHT and leased
// to the worker. After the cancel it is refused, and the REVOKED record stays.
func (h *Handler) dispatchRetry(r *http.Request, actor string) (int, any, error) {
	id, err := runID(r)
	if err != nil {
		return 0, nil, err
	}
	step := r.PathValue("step")
	if err := checkStepID(step); err != nil {
		return 0, nil, err
	}
	attempt, err := strconv.Atoi(r.PathValue("attempt"))
	if err != nil || attempt < 1 {
		return 0, nil, fmt.Errorf("%w: attempt %q in the path: want a whole number of 1 or more", state.ErrInvalid, r.PathValue("attempt"))
	}
	var body DispatchRequest
	if err := decode(r, &body); err != nil {
		return 0, nil, err
	}
	owner, ttl, err := leaseOf(r, body.Worker, body.LeaseTTL, actor)
	if err != nil {
		return 0, nil, err
	}
	return h.guard(r, state.GuardRequest{
		RunID: id, ObservedVersion: body.CancelVersion, Key: state.RetryKey(step, attempt),
		ExplicitKey: true, Boundary: state.BoundaryRetry, LeaseOwner: owner, LeaseTTL: ttl, Actor: actor,
	})
}

// beginIntent is the guard for an effect the caller carries itself.
func (h *Handler) beginIntent(r *http.Request, actor string) (int, any, error) {
	id, body, err := runRequest[IntentRequest](r)
	if err != nil {
		return 0, nil, err
	}
	if body.Key == "" {
		return 0, nil, fmt.Errorf("%w: key is required: the effect's idempotency key", state.ErrInvalid)
	}
	if err := state.CheckUnreserved(body.Key); err != nil {
		return 0, nil, err
	}
	boundary := cmp.Or(body.Boundary, state.BoundaryCustom)
	if !slices.Contains(genericBoundaries, boundary) {
		return 0, nil, fmt.Errorf("%w: boundary %q: want custom, delivery or browser", state.ErrInvalid, body.Boundary)
	}
	if body.AllowCancelling && boundary != state.BoundaryDelivery {
		return 0, nil, fmt.Errorf("%w: allow_cancelling is only for boundary delivery (got %s): other effects of a cancelled run must not start", state.ErrInvalid, boundary)
	}
	for field, v := range map[string]string{"method": body.Method, "body_digest": body.BodyDigest, "carrier": body.Carrier} {
		if err := checkText(field, v); err != nil {
			return 0, nil, err
		}
	}
	ttl, err := leaseTTL(body.LeaseTTL)
	if err != nil {
		return 0, nil, err
	}
	return h.guard(r, state.GuardRequest{
		RunID: id, ObservedVersion: body.CancelVersion, Key: body.Key, ExplicitKey: true, Boundary: boundary,
		Method: body.Method, Target: body.Target, BodyDigest: body.BodyDigest, AllowCancelling: body.AllowCancelling,
		LeaseOwner: ownerOf(r, body.Carrier, actor), LeaseTTL: ttl, Actor: actor,
	})
}

// guard runs the store's guard and answers 201 with the intent, or the
// refusal in the shape every edge gives it.
func (h *Handler) guard(r *http.Request, req state.GuardRequest) (int, any, error) {
	if err := req.Validate(); err != nil {
		return 0, nil, err
	}
	started := time.Now()
	res, err := h.store.Guard(r.Context(), req)
	d := telemetry.Decision{Boundary: req.Boundary, Run: req.RunID, Version: req.ObservedVersion, Method: req.Method,
		Intent: req.Key, Store: time.Since(started), Via: req.Actor}
	if err == nil && !res.Admitted {
		err = refusal.FromGuard(req, res)
	}
	if err != nil {
		rf := refusal.FromError(err)
		d.Result, d.Reason, d.Recorded = telemetry.Refused, string(rf.Code), rf.Recorded
		h.tel.Decided(r.Context(), d)
		if rf.Code != refusal.RunNotActive && rf.Code != refusal.StaleVersion && rf.Code != refusal.IntentInProgress && rf.Code != refusal.KeyReused && rf.Code != refusal.RunNotAdmitted {
			return 0, nil, fmt.Errorf("guard %s %s of run %s: %w", req.Boundary, req.Key, req.RunID, err)
		}
		return 0, nil, rf
	}
	d.Result, d.Intent, d.Recorded = telemetry.Admitted, res.Intent.Key, res.Intent.State
	h.tel.Decided(r.Context(), d)
	return http.StatusCreated, GuardResponse{Admitted: true, Intent: res.Intent, Run: normRun(res.Run)}, nil
}

// getIntent reads one intent.
// renewIntent is a worker's heartbeat on an effect it carries (a long
// claimed step): it extends the lease and answers the run's row, which is
// how a cooperative worker learns of a cancel at its next checkpoint. A
// lease that is no longer the worker's (expired into UNKNOWN, finished, or
// another worker's) is a 409: the worker must stop and not report success.
func (h *Handler) renewIntent(r *http.Request, actor string) (int, any, error) {
	id, key, body, err := intentRequest[RenewRequest](r)
	if err != nil {
		return 0, nil, err
	}
	owner, ttl, err := leaseOf(r, body.Worker, body.LeaseTTL, actor)
	if err != nil {
		return 0, nil, err
	}
	ref := state.IntentRef{RunID: id, Key: key}
	res, err := h.store.Renew(r.Context(), state.RenewRequest{Owner: owner, TTL: ttl, Refs: []state.IntentRef{ref}})
	if err != nil {
		return 0, nil, fmt.Errorf("renew the lease of intent %s of run %s: %w", key, id, err)
	}
	run, ok := res.Runs[id]
	if !ok {
		return 0, nil, fmt.Errorf("run %s: %w", id, state.ErrNotFound)
	}
	in, renewed := res.Holds(ref)
	if !renewed {
		// The lease was not the worker's: say what the intent is now.
		if in, err = h.store.Intent(r.Context(), id, key); err != nil {
			return 0, nil, fmt.Errorf("read intent %s of run %s: %w", key, id, err)
		}
		return 0, nil, &state.Conflict{Code: state.ConflictNotInFlight, Run: run, Intent: &in,
			Detail: fmt.Sprintf("the lease is not %s's: the intent is %s, leased to %q; stop, and do not report success", owner, in.State, in.LeaseOwner)}
	}
	return http.StatusOK, RenewResponse{Intent: in, Run: run}, nil
}

func (h *Handler) getIntent(r *http.Request, _ string) (int, any, error) {
	id, key, err := intentPath(r)
	if err != nil {
		return 0, nil, err
	}
	in, err := h.store.Intent(r.Context(), id, key)
	if err != nil {
		return 0, nil, fmt.Errorf("read intent %s of run %s: %w", key, id, err)
	}
	return http.StatusOK, in, nil
}

// finishIntent records what happened to an IN_FLIGHT effect.
func (h *Handler) finishIntent(r *http.Request, actor string) (int, any, error) {
	id, key, body, err := intentRequest[OutcomeRequest](r)
	if err != nil {
		return 0, nil, err
	}
	var outcome state.IntentState
	switch strings.ToLower(body.Outcome) {
	case OutcomeResponded:
		outcome = state.IntentResponded
	case OutcomeNotSent:
		outcome = state.IntentNotSent
	case OutcomeUnknown:
		outcome = state.IntentUnknown
	case "":
		return 0, nil, fmt.Errorf("%w: outcome is required: responded, not_sent or unknown", state.ErrInvalid)
	default:
		return 0, nil, fmt.Errorf("%w: outcome %q: want responded, not_sent or unknown", state.ErrInvalid, body.Outcome)
	}
	var attempt int
	if body.Attempt != nil {
		attempt = *body.Attempt
	}
	if p := principalOf(r); body.Attempt == nil || p.Scope == ScopeWorker {
		// A caller that does not say which attempt it carried reports on
		// the current one. This read is not part of the step: the store
		// still compares the attempt atomically, so a report can only ever
		// land on the attempt it was read for. Never 0, so that an intent
		// that was never dispatched gets the store's intent_not_in_flight.
		in, err := h.store.Intent(r.Context(), id, key)
		if err != nil {
			return 0, nil, fmt.Errorf("read intent %s of run %s: %w", key, id, err)
		}
		if body.Attempt == nil {
			attempt = max(in.Attempts, 1)
		}
		// A worker reports on what it carries, never on an effect the
		// egress proxy (or another worker) carries. The store compares the
		// attempt in its step, so holding the report to the attempt whose
		// lease was read here keeps the check and the write on one attempt.
		if p.Scope == ScopeWorker {
			if !p.carries(in.LeaseOwner) {
				return 0, nil, refusal.New(refusal.Forbidden, "intent %s of run %s is carried by %q, not by %s: a worker reports the outcomes of the effects it carries", key, id, in.LeaseOwner, p.Actor())
			}
			if attempt != in.Attempts {
				return 0, nil, refusal.New(refusal.StaleAttempt, "intent %s of run %s is at attempt %d, not %d: report on the attempt you carry", key, id, in.Attempts, attempt)
			}
		}
	}
	req := state.FinishRequest{RunID: id, Key: key, Attempt: attempt, Outcome: outcome, StatusCode: body.StatusCode, Reason: body.Reason, Actor: actor}
	if err := req.Validate(); err != nil {
		return 0, nil, err
	}
	started := time.Now()
	in, err := h.store.Finish(r.Context(), req)
	if err != nil {
		return 0, nil, fmt.Errorf("record %s of intent %s of run %s: %w", outcome, key, id, err)
	}
	h.tel.Decided(r.Context(), telemetry.Decision{Boundary: in.Boundary, Result: telemetry.Finished, Run: id, Method: in.Method,
		Intent: key, Recorded: in.State, StatusCode: in.StatusCode, Store: time.Since(started), Via: actor})
	return http.StatusOK, in, nil
}

// noteIntent appends one event about an effect of the run to its audit, of a
// kind of the caller's own (NoteKindPrefixes), under the caller's actor: a
// worker can add to its run's record, never forge what stopgate wrote.
func (h *Handler) noteIntent(r *http.Request, actor string) (int, any, error) {
	id, key, body, err := intentRequest[NoteRequest](r)
	if err != nil {
		return 0, nil, err
	}
	if !slices.ContainsFunc(NoteKindPrefixes, func(p string) bool { return strings.HasPrefix(body.Kind, p) && len(body.Kind) > len(p) }) {
		return 0, nil, fmt.Errorf("%w: note kind %q: want exec.NAME or worker.NAME", state.ErrInvalid, body.Kind)
	}
	req := state.NoteRequest{RunID: id, Key: key, Kind: body.Kind, Reason: body.Reason, Actor: actor}
	if err := req.Validate(); err != nil {
		return 0, nil, err
	}
	if err := h.store.Note(r.Context(), req); err != nil {
		return 0, nil, fmt.Errorf("note %s on intent %s of run %s: %w", body.Kind, key, id, err)
	}
	return http.StatusCreated, req, nil
}
