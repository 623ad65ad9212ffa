package telemetry

import (
	"context"
	"errors"
	"time"

	"github.com/stopgate/stopgate/state"
)

// Store returns s with every call timed and every failure counted, by
// operation, whoever the caller is (the proxy, the browser guard, the
// control API, the sweeper): the store's cost and health are measured in
// one place. It changes nothing a call does or answers.
func (t *Telemetry) Store(s state.Store) state.Store { return &measured{Store: s, t: t} }

type measured struct {
	state.Store
	t *Telemetry
}

// Unwrap is the store measured, for a caller that needs what only that
// store does (the control API's acknowledgement of a Redis store's reset).
func (m *measured) Unwrap() state.Store { return m.Store }

// observe records one call of op that started at start and ended with err.
// A refusal or a conflict is an answer, not a failure; only a store that
// did not answer (or answered nonsense) counts as an error.
func (m *measured) observe(op string, start time.Time, err error) {
	mt := m.t.metrics
	mt.storeCalls.WithLabelValues(m.t.store, op).Observe(time.Since(start).Seconds())
	if err != nil && !errors.Is(err, state.ErrNotFound) && !errors.Is(err, state.ErrInvalid) && !isConflict(err) && !errors.Is(err, context.Canceled) {
		mt.storeErrors.WithLabelValues(op).Inc()
	}
}

func isConflict(err error) bool {
	var c *state.Conflict
	return errors.As(err, &c)
}

func (m *measured) Admit(ctx context.Context, req state.AdmitRequest) (state.AdmitResult, error) {
	start := time.Now()
	out, err := m.Store.Admit(ctx, req)
	m.observe("admit", start, err)
	return out, err
}

func (m *measured) Cancel(ctx context.Context, req state.CancelRequest) (state.CancelResult, error) {
	start := time.Now()
	out, err := m.Store.Cancel(ctx, req)
	m.observe("cancel", start, err)
	return out, err
}

func (m *measured) Complete(ctx context.Context, req state.CompleteRequest) (state.Run, error) {
	start := time.Now()
	out, err := m.Store.Complete(ctx, req)
	m.observe("complete", start, err)
	return out, err
}

func (m *measured) Get(ctx context.Context, runID string) (state.Run, error) {
	start := time.Now()
	out, err := m.Store.Get(ctx, runID)
	m.observe("get", start, err)
	return out, err
}

func (m *measured) Guard(ctx context.Context, req state.GuardRequest) (state.GuardResult, error) {
	start := time.Now()
	out, err := m.Store.Guard(ctx, req)
	m.observe("guard", start, err)
	return out, err
}

func (m *measured) Finish(ctx context.Context, req state.FinishRequest) (state.Intent, error) {
	start := time.Now()
	out, err := m.Store.Finish(ctx, req)
	m.observe("outcome", start, err)
	return out, err
}

func (m *measured) FinishLater(ctx context.Context, req state.FinishRequest, done func(error)) {
	start := time.Now()
	m.Store.FinishLater(ctx, req, func(err error) {
		m.observe("outcome", start, err)
		done(err)
	})
}

func (m *measured) Resolve(ctx context.Context, req state.ResolveRequest) (state.Intent, error) {
	start := time.Now()
	out, err := m.Store.Resolve(ctx, req)
	m.observe("resolve", start, err)
	return out, err
}

func (m *measured) Note(ctx context.Context, req state.NoteRequest) error {
	start := time.Now()
	err := m.Store.Note(ctx, req)
	m.observe("note", start, err)
	return err
}

func (m *measured) Renew(ctx context.Context, req state.RenewRequest) (state.RenewResult, error) {
	start := time.Now()
	out, err := m.Store.Renew(ctx, req)
	m.observe("renew", start, err)
	return out, err
}

func (m *measured) Tick(ctx context.Context, req state.TickRequest) (state.Run, error) {
	start := time.Now()
	out, err := m.Store.Tick(ctx, req)
	m.observe("tick", start, err)
	return out, err
}

func (m *measured) Prune(ctx context.Context, req state.PruneRequest) (int, error) {
	start := time.Now()
	n, err := m.Store.Prune(ctx, req)
	m.observe("prune", start, err)
	return n, err
}

func (m *measured) Totals(ctx context.Context) (state.Totals, error) {
	start := time.Now()
	out, err := m.Store.Totals(ctx)
	m.observe("totals", start, err)
	return out, err
}

func (m *measured) Ping(ctx context.Context) error {
	start := time.Now()
	err := m.Store.Ping(ctx)
	m.observe("ping", start, err)
	return err
}
