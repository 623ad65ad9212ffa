package proxy

import (
	"context"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/stopgate/stopgate/state"
)

// flow is one admitted effect this instance is carrying: a request on its
// way to the upstream or streaming back, or a pass-through tunnel. The
// registry of flows is how a cancel reaches connections that goproxy has
// already handed off.
type flow struct {
	id     identity
	intent state.Intent
	method string
	// allowCancelling: a delivery destination that a CANCELLING run may still reach.
	allowCancelling bool
	tunnel          bool
	// streaming is set when the upstream answered with a stream (SSE or
	// an upgraded connection), which a cancel cuts at once whatever the
	// method; an ordinary answer to an unsafe request may finish reaching
	// the client until the drain deadline, since its effect has happened.
	streaming atomic.Bool
	// answered is set once the upstream's answer came back (RESPONDED).
	answered atomic.Bool
	cut      context.CancelCauseFunc
}

// cutError is the cause a flow is cut with, so the round trip can record why.
type cutError struct{ reason string }

func (e *cutError) Error() string { return "cut by stopgate: " + e.reason }

func safeMethod(m string) bool {
	switch m {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return false
}

type flowSet struct {
	mu     sync.Mutex
	byRun  map[string]map[*flow]struct{}
	timers map[string]*time.Timer
}

func newFlowSet() *flowSet {
	return &flowSet{byRun: map[string]map[*flow]struct{}{}, timers: map[string]*time.Timer{}}
}

func (s *flowSet) add(f *flow) {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := s.byRun[f.id.run]
	if m == nil {
		m = map[*flow]struct{}{}
		s.byRun[f.id.run] = m
	}
	m[f] = struct{}{}
}

func (s *flowSet) remove(f *flow) {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := s.byRun[f.id.run]
	delete(m, f)
	if len(m) == 0 {
		delete(s.byRun, f.id.run)
		if t := s.timers[f.id.run]; t != nil {
			t.Stop()
			delete(s.timers, f.id.run)
		}
	}
}

func (s *flowSet) runs() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.byRun))
	for run := range s.byRun {
		out = append(out, run)
	}
	return out
}

func (s *flowSet) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, m := range s.byRun {
		n += len(m)
	}
	return n
}

// enforce applies the run's row to its open flows: nothing while ACTIVE;
// while CANCELLING, tunnels, streams and safe requests are cut at once and
// unsafe requests may finish until the drain deadline (delivery
// destinations until the run leaves CANCELLING); once the run is anything
// else, everything left is cut, but for answers to unsafe requests still
// on their way back, which keep their drain. It returns the drain deadline
// still to wait for, if any.
func (s *flowSet) enforce(run state.Run, now time.Time) (wait time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for f := range s.byRun[run.ID] {
		reason, waiting := cutReason(f, run, now)
		if waiting {
			wait = run.DrainDeadline
		}
		if reason != "" {
			f.cut(&cutError{reason: reason})
		}
	}
	return wait
}

// cutReason says why f must be cut now ("" if not), and whether it waits
// for the run's drain deadline.
func cutReason(f *flow, run state.Run, now time.Time) (reason string, waiting bool) {
	if run.Status == state.StatusActive {
		return "", false
	}
	draining := now.Before(run.DrainDeadline)
	unsafe := !f.tunnel && !f.streaming.Load() && !safeMethod(f.method)
	// The effect has happened: its answer may reach the agent, whatever the
	// run became meanwhile (drained runs are CANCELLED at once).
	if unsafe && f.answered.Load() && draining {
		return "", true
	}
	if run.Status != state.StatusCancelling {
		return "run_" + string(run.Status), false
	}
	switch {
	case f.allowCancelling:
		return "", false
	case f.tunnel:
		return "run_cancelled: pass-through tunnel", false
	case f.streaming.Load():
		return "run_cancelled: response stream", false
	case safeMethod(f.method):
		return "run_cancelled: safe request", false
	case !draining:
		return "drain_timeout", false
	}
	return "", true
}

func (s *flowSet) cutAll(reason string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range s.byRun {
		for f := range m {
			f.cut(&cutError{reason: reason})
		}
	}
}

// armTimer makes sure the run is enforced again at its drain deadline.
func (s *flowSet) armTimer(run string, at time.Time, fire func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.timers[run]; ok || len(s.byRun[run]) == 0 {
		return
	}
	s.timers[run] = time.AfterFunc(time.Until(at)+10*time.Millisecond, func() {
		s.mu.Lock()
		delete(s.timers, run)
		s.mu.Unlock()
		fire()
	})
}
