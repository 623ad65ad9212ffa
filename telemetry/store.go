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

// timed is observe for a call that defers it: err is read as the call
// returns.
func (m *measured) timed(op string, start time.Time, err *error) { m.observe(op, start, *err) }

func isConflict(err error) bool {
	var c *state.Conflict
	return errors.As(err, &c)
}

func (m *measured) Admit(ctx context.Context, req state.AdmitRequest) (_ state.AdmitResult, err error) {
	defer m.timed("admit", time.Now(), &err)
	return m.Store.Admit(ctx, req)
}

func (m *measured) Cancel(ctx context.Context, req state.CancelRequest) (_ state.CancelResult, err error) {
	defer m.timed("cancel", time.Now(), &err)
	return m.Store.Cancel(ctx, req)
}

func (m *measured) Complete(ctx context.Context, req state.CompleteRequest) (_ state.Run, err error) {
	defer m.timed("complete", time.Now(), &err)
	return m.Store.Complete(ctx, req)
}

func (m *measured) Get(ctx context.Context, runID string) (_ state.Run, err error) {
	defer m.timed("get", time.Now(), &err)
	return m.Store.Get(ctx, runID)
}

func (m *measured) Guard(ctx context.Context, req state.GuardRequest) (_ state.GuardResult, err error) {
	defer m.timed("guard", time.Now(), &err)
	return m.Store.Guard(ctx, req)
}

func (m *measured) Finish(ctx context.Context, req state.FinishRequest) (_ state.Intent, err error) {
	defer m.timed("outcome", time.Now(), &err)
	return m.Store.Finish(ctx, req)
}

func (m *measured) FinishLater(ctx context.Context, req state.FinishRequest, done func(error)) {
	start := time.Now()
	m.Store.FinishLater(ctx, req, func(err error) {
		m.observe("outcome", start, err)
		done(err)
	})
}

func (m *measured) Resolve(ctx context.Context, req state.ResolveRequest) (_ state.Intent, err error) {
	defer m.timed("resolve", time.Now(), &err)
	return m.Store.Resolve(ctx, req)
}

func (m *measured) Note(ctx context.Context, req state.NoteRequest) (err error) {
	defer m.timed("note", time.Now(), &err)
	return m.Store.Note(ctx, req)
}

func (m *measured) Renew(ctx context.Context, req state.RenewRequest) (_ state.RenewResult, err error) {
	defer m.timed("renew", time.Now(), &err)
	return m.Store.Renew(ctx, req)
}

func (m *measured) Tick(ctx context.Context, req state.TickRequest) (_ state.Run, err error) {
	defer m.timed("tick", time.Now(), &err)
	return m.Store.Tick(ctx, req)
}

func (m *measured) Prune(ctx context.Context, req state.PruneRequest) (_ int, err error) {
	defer m.timed("prune", time.Now(), &err)
	return m.Store.Prune(ctx, req)
}

func (m *measured) Totals(ctx context.Context) (_ state.Totals, err error) {
	defer m.timed("totals", time.Now(), &err)
	return m.Store.Totals(ctx)
}

func (m *measured) Ping(ctx context.Context) (err error) {
	defer m.timed("ping", time.Now(), &err)
	return m.Store.Ping(ctx)
}
