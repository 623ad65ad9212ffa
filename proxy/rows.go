package proxy

import (
	"context"
	"net/http"
	"strings"
	"sync"

	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/telemetry"
)

// seenRows remembers the rows of runs this instance has seen leave ACTIVE
// (in a guard's answer, or handed over by the run watcher), so that a
// request of such a run is guarded before its body is read: a cancelled
// run's upload is refused without being uploaded, at no extra store step.
//
// A remembered row never admits anything. It only moves the one guard of
// the request before the body; the guard still decides, on the row as it
// is in the store. A run never returns to ACTIVE and its cancel_version
// never goes down, so a row that refused a request once refuses it later.
//
// The memory is bounded: past max runs the one least recently learned or
// asked about is forgotten (a run forgotten is only guarded after its body
// again, as one never seen).
type seenRows struct {
	// mu makes learn's read and write of one run one step: two rows of a
	// run learned at once keep the later version.
	mu   sync.Mutex
	rows *lru.Cache[string, state.Run]
}

func newSeenRows(max int) *seenRows {
	rows, err := lru.New[string, state.Run](max)
	if err != nil {
		panic(err) // only for a size below 1
	}
	return &seenRows{rows: rows}
}

// learn keeps row if the run is no longer ACTIVE, unless a later version
// of it is kept already.
func (s *seenRows) learn(row state.Run) {
	if row.ID == "" || row.Status == state.StatusActive {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if old, ok := s.rows.Peek(row.ID); !ok || old.CancelVersion <= row.CancelVersion {
		s.rows.Add(row.ID, row)
	}
}

func (s *seenRows) get(run string) (state.Run, bool) { return s.rows.Get(run) }

// refuses predicts whether the guard refuses an effect of row's run that
// observed version (0: none) — the guard's own rule, used only to decide
// when to ask the guard, never instead of it.
func refuses(row state.Run, version int64, allowCancelling bool) bool {
	switch row.Status {
	case state.StatusActive:
		return version != 0 && version != row.CancelVersion
	case state.StatusCancelling:
		return !allowCancelling
	}
	return true
}

// guardFirst reports whether the request's guard must come before its
// body is read: the run is known to this instance as one the guard
// refuses, or the client asked with Expect: 100-continue whether to send
// its body and the run's row, read now, says the guard refuses.
func (p *Proxy) guardFirst(req *http.Request, id identity, allowCancelling bool) bool {
	if req.Body == nil || req.Body == http.NoBody {
		return false
	}
	if row, ok := p.seen.get(id.run); ok && refuses(row, id.version, allowCancelling) {
		return true
	}
	if p.cfg.Runs == nil || !expectsContinue(req.Header) {
		return false
	}
	ctx, cancel := context.WithTimeout(req.Context(), p.cfg.StoreTimeout)
	defer cancel()
	row, err := p.cfg.Runs.Get(ctx, id.run)
	if err != nil {
		// An unseen run, or a store that does not answer: the guard,
		// after the body, says which.
		return false
	}
	p.seen.learn(row)
	return refuses(row, id.version, allowCancelling)
}

func expectsContinue(h http.Header) bool {
	for _, v := range h.Values("Expect") {
		if strings.EqualFold(strings.TrimSpace(v), "100-continue") {
			return true
		}
	}
	return false
}

// refuseEarly answers a request refused before anything of it was read or
// named (a loop back into the proxy, the cap on open exchanges), with its
// decision line.
func (p *Proxy) refuseEarly(w http.ResponseWriter, req *http.Request, r *refusal.Refusal) {
	boundary := state.BoundaryHTTP
	if req.Method == http.MethodConnect && p.current().PassThrough.Match(req.Host) {
		boundary = state.BoundaryTunnel
	}
	d := telemetry.Decision{Boundary: boundary, Result: telemetry.Refused, Reason: string(r.Code), Method: req.Method, Host: hostOf(req)}
	p.tel.Decided(req.Context(), d)
	d.StatusCode = r.Status()
	p.tel.Accessed(req.Context(), d)
	// The connection is let go with the answer, not kept for another
	// request: a client refused for holding too much must not hold more.
	w.Header().Set("Connection", "close")
	r.WriteHTTP(w)
}
