package control

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/stopgate/stopgate/state"
)

// runID reads and checks the {run} path segment before any store call, so
// a bad id gets the same 400 whichever store is behind the API.
func runID(r *http.Request) (string, error) {
	id := r.PathValue("run")
	if err := state.ValidateRunID(id); err != nil {
		return "", err
	}
	return id, nil
}

// runRequest reads a request on one run with a body: the {run} path
// segment first, then the body.
func runRequest[T any](r *http.Request) (id string, body T, err error) {
	if id, err = runID(r); err != nil {
		return "", body, err
	}
	if err = decode(r, &body); err != nil {
		return "", body, err
	}
	return id, body, nil
}

// admit answers 201 when the run is new, 200 when it was already ACTIVE.
func (h *Handler) admit(r *http.Request, actor string) (int, any, error) {
	var body AdmitRequest
	if err := decode(r, &body); err != nil {
		return 0, nil, err
	}
	given, err := body.Budget.Budget()
	if err != nil {
		return 0, nil, err
	}
	if err := validLabels(body.Labels); err != nil {
		return 0, nil, err
	}
	req := state.AdmitRequest{RunID: body.RunID, Actor: actor, Reason: body.Reason, Budget: given}
	if h.budgets != nil {
		req.Budget = h.budgets(body.RunID, body.Labels, given)
	} else if given.Limited() && given.DrainTimeout == 0 {
		req.Budget.DrainTimeout = h.drain
	}
	if err := req.Validate(); err != nil {
		return 0, nil, err
	}
	res, err := h.store.Admit(r.Context(), req)
	if err != nil {
		return 0, nil, fmt.Errorf("admit run %s: %w", req.RunID, err)
	}
	if !res.Created {
		return http.StatusOK, normRun(res.Run), nil
	}
	h.log.Info("run admitted", "run", res.Run.ID, "actor", actor, "budget", res.Run.Budget.Text())
	return http.StatusCreated, normRun(res.Run), nil
}

// maxLabels bound the labels of one admission.
const (
	maxLabels   = 32
	maxLabelLen = 128
)

// validLabels says what is wrong with an admission's labels.
func validLabels(labels map[string]string) error {
	if len(labels) > maxLabels {
		return fmt.Errorf("%w: %d labels, more than %d", state.ErrInvalid, len(labels), maxLabels)
	}
	for k, v := range labels {
		if k == "" || len(k) > maxLabelLen || len(v) > maxLabelLen {
			return fmt.Errorf("%w: label %q: want a name of 1 to %d bytes and a value of at most %d", state.ErrInvalid, k, maxLabelLen, maxLabelLen)
		}
	}
	return nil
}

func (h *Handler) list(r *http.Request, _ string) (int, any, error) {
	q, err := ParseRunQuery(r.URL.Query(), time.Now())
	if err != nil {
		return 0, nil, err
	}
	runs, err := h.store.List(r.Context(), q.Status)
	if err != nil {
		return 0, nil, fmt.Errorf("list runs: %w", err)
	}
	runs, more := q.Apply(runs)
	out := RunList{Runs: make([]state.Run, 0, len(runs)), More: more}
	for _, run := range runs {
		out.Runs = append(out.Runs, normRun(run))
	}
	return http.StatusOK, out, nil
}

func (h *Handler) get(r *http.Request, _ string) (int, any, error) {
	id, err := runID(r)
	if err != nil {
		return 0, nil, err
	}
	run, err := h.store.Get(r.Context(), id)
	if err != nil {
		return 0, nil, fmt.Errorf("read run %s: %w", id, err)
	}
	return http.StatusOK, normRun(run), nil
}

// cancel answers 202: the cancel has committed, but the run drains (and a
// sweeper moves it on) after the answer.
func (h *Handler) cancel(r *http.Request, actor string) (int, any, error) {
	id, body, err := runRequest[CancelRequest](r)
	if err != nil {
		return 0, nil, err
	}
	var drain *time.Duration
	if body.DrainTimeout != nil {
		d := time.Duration(*body.DrainTimeout)
		drain = &d
	}
	res, err := h.cancelRun(r.Context(), id, actor, body.Reason, drain)
	if err != nil {
		return 0, nil, err
	}
	return http.StatusAccepted, CancelResponse{Run: normRun(res.Run), Changed: res.Changed, Tombstone: madeTombstone(res)}, nil
}

// madeTombstone reports whether a cancel wrote the tombstone of a run never
// seen: the cancel of a known run only ever moves it to CANCELLING, so a
// cancel that changed a row straight to CANCELLED created it.
func madeTombstone(res state.CancelResult) bool {
	return res.Changed && res.Run.Status == state.StatusCancelled
}

// cancelRun is the cancel of the API and of the console's Stop button:
// drain nil takes the server's default.
func (h *Handler) cancelRun(ctx context.Context, id, actor, reason string, drain *time.Duration) (state.CancelResult, error) {
	req := state.CancelRequest{RunID: id, Actor: actor, Reason: reason, DrainTimeout: h.drain}
	if drain != nil {
		req.DrainTimeout = *drain
	}
	if err := req.Validate(); err != nil {
		return state.CancelResult{}, err
	}
	res, err := h.store.Cancel(ctx, req)
	if err != nil {
		return res, fmt.Errorf("cancel run %s: %w", id, err)
	}
	if res.Changed {
		h.log.Info("run cancelled", "run", id, "status", res.Run.Status, "cancel_version", res.Run.CancelVersion,
			"drain_timeout", req.DrainTimeout, "actor", actor, "reason", req.Reason)
	}
	return res, nil
}

func (h *Handler) complete(r *http.Request, actor string) (int, any, error) {
	id, body, err := runRequest[CompleteRequest](r)
	if err != nil {
		return 0, nil, err
	}
	req := state.CompleteRequest{RunID: id, Version: body.CancelVersion, Actor: actor, Reason: body.Reason}
	if err := req.Validate(); err != nil {
		return 0, nil, err
	}
	run, err := h.store.Complete(r.Context(), req)
	if err != nil {
		return 0, nil, fmt.Errorf("complete run %s: %w", id, err)
	}
	h.log.Info("run completed", "run", id, "cancel_version", run.CancelVersion, "actor", actor)
	return http.StatusOK, normRun(run), nil
}

func (h *Handler) events(r *http.Request, _ string) (int, any, error) {
	id, err := runID(r)
	if err != nil {
		return 0, nil, err
	}
	events, err := h.store.Events(r.Context(), id)
	if err != nil {
		return 0, nil, fmt.Errorf("read events of run %s: %w", id, err)
	}
	return http.StatusOK, EventList{Events: nonNil(events)}, nil
}

func (h *Handler) intents(r *http.Request, _ string) (int, any, error) {
	id, err := runID(r)
	if err != nil {
		return 0, nil, err
	}
	intents, err := h.store.Intents(r.Context(), id)
	if err != nil {
		return 0, nil, fmt.Errorf("read intents of run %s: %w", id, err)
	}
	return http.StatusOK, IntentList{Intents: nonNil(intents)}, nil
}

// audit reads the row, then the intents, then the events: three reads, not
// one snapshot. Read in this order, everything the row counts is in the
// lists (the lists may hold a little more, never less).
func (h *Handler) audit(r *http.Request, _ string) (int, any, error) {
	id, err := runID(r)
	if err != nil {
		return 0, nil, err
	}
	ctx := r.Context()
	run, err := h.store.Get(ctx, id)
	if err != nil {
		return 0, nil, fmt.Errorf("read run %s: %w", id, err)
	}
	intents, err := h.store.Intents(ctx, id)
	if err != nil {
		return 0, nil, fmt.Errorf("read intents of run %s: %w", id, err)
	}
	events, err := h.store.Events(ctx, id)
	if err != nil {
		return 0, nil, fmt.Errorf("read events of run %s: %w", id, err)
	}
	return http.StatusOK, Audit{Run: normRun(run), Intents: nonNil(intents), Events: nonNil(events)}, nil
}

// normRun makes a row without intents print "intents":{} rather than null,
// so programs can index the counts without a nil check.
func normRun(r state.Run) state.Run {
	if r.Intents == nil {
		r.Intents = map[state.IntentState]int{}
	}
	return r
}

// nonNil makes empty lists print [] rather than null.
func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}
