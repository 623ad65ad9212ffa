package control

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/runwatch"
	"github.com/stopgate/stopgate/state"
)

// The watch (GET /v1/runs/{run}/watch) tells a worker's code of its run's
// transitions as they commit, so that it stops at its next checkpoint rather
// than at its next refused effect. It is a Server-Sent Events stream of the
// run's row: the row as it stands, then the row again at every transition
// (as read when the transition is heard: two that commit before that read
// arrive as one, the later), with a heartbeat comment between. A client without SSE long-polls the same
// path (?wait=30s&after_version=N&after_status=S).
//
// The streams do not watch the store themselves: they hold their runs in the
// process's one runwatch.Watcher, whose subscription to the store's cancel
// broadcast (from every instance sharing the store) and periodic re-read of
// held rows carry every row to them. A run also changes without a broadcast
// (the sweeper moves CANCELLING on to CANCELLED); the re-read carries that.
//
// Every stream is bounded: in number (per run and in all), in how long one
// write may block on a client that does not read, and in age; serve's
// shutdown ends them all (EndWatches).

const watchPath = "/v1/runs/{run}/watch"

// Defaults of WatchOptions left zero.
const (
	DefaultMaxWatches        = 1024
	DefaultMaxWatchesPerRun  = 64
	DefaultWatchHeartbeat    = 15 * time.Second
	DefaultWatchWriteTimeout = 10 * time.Second
	DefaultWatchMaxAge       = 30 * time.Minute
	// DefaultPollWait is a long poll's wait when the request names none.
	DefaultPollWait = 30 * time.Second
	// MaxPollWait bounds a long poll's wait: under the control listener's
	// write timeout, and under what proxies between keep open.
	MaxPollWait = 60 * time.Second
)

// WatchOptions bound the watches one Handler serves. Streams and long
// polls count alike.
type WatchOptions struct {
	// Max is how many watches this instance serves at once.
	Max int
	// MaxPerRun is how many of them may watch one run.
	MaxPerRun int
	// Heartbeat is how often an idle stream sends a comment, so that a
	// client can tell a quiet run from a dead connection.
	Heartbeat time.Duration
	// WriteTimeout bounds each write to a stream: a client that stops
	// reading loses its stream once its buffers are full, rather than
	// pinning the stream's goroutine.
	WriteTimeout time.Duration
	// MaxAge ends a stream (event end, reason max_age) this long after it
	// began, so that a client that reads nothing still gives its slot
	// back; clients reconnect.
	MaxAge time.Duration
}

func (o WatchOptions) withDefaults() WatchOptions {
	o.Max = cmp.Or(o.Max, DefaultMaxWatches)
	o.MaxPerRun = cmp.Or(o.MaxPerRun, DefaultMaxWatchesPerRun)
	o.Heartbeat = cmp.Or(o.Heartbeat, DefaultWatchHeartbeat)
	o.WriteTimeout = cmp.Or(o.WriteTimeout, DefaultWatchWriteTimeout)
	o.MaxAge = cmp.Or(o.MaxAge, DefaultWatchMaxAge)
	return o
}

// Why a stream ends, in its last event (event: end, data {"reason": ...}).
const (
	// WatchEndFinal: the run is CANCELLED or COMPLETED and will never
	// change again.
	WatchEndFinal = "final"
	// WatchEndShutdown: the server is shutting down; reconnect (to another
	// instance of the fleet).
	WatchEndShutdown = "shutdown"
	// WatchEndMaxAge: the stream reached its age; reconnect.
	WatchEndMaxAge = "max_age"
)

// WatchEnd is the data of a stream's last event.
type WatchEnd struct {
	Reason string `json:"reason"`
}

// WatchHeader says what a long poll's answer is: WatchChanged (the row is
// no longer the one the request named), WatchFinal (it never will be
// anything else), or WatchUnchanged (the wait ran out, or the server is
// shutting down).
const (
	WatchHeader    = "X-Stopgate-Watch"
	WatchChanged   = "changed"
	WatchFinal     = "final"
	WatchUnchanged = "unchanged"
)

// After reports whether row is past the (version, status) a caller holds.
// A row's cancel_version only grows and, within one version, its status only
// moves forward (ACTIVE, CANCELLING, UNKNOWN, then CANCELLED or COMPLETED),
// so the pair orders every transition of a run, the CANCELLING → CANCELLED
// that keeps the version included.
func After(row state.Run, version int64, status state.Status) bool {
	if row.CancelVersion != version {
		return row.CancelVersion > version
	}
	return stage(row.Status) > stage(status)
}

func stage(s state.Status) int {
	switch s {
	case state.StatusActive:
		return 0
	case state.StatusCancelling:
		return 1
	case state.StatusUnknown:
		return 2
	case state.StatusCancelled, state.StatusCompleted:
		return 3
	}
	return -1 // no row yet
}

// watches are the open watches of one Handler: a runwatch.Holder, so that
// the process's watcher hands them every fresh row of the runs they follow.
type watches struct {
	opts WatchOptions
	// done is closed by EndWatches: every watch answers and ends.
	done     chan struct{}
	doneOnce sync.Once

	mu    sync.Mutex
	byRun map[string]map[*follower]struct{}
	total int
}

func newWatches(w *runwatch.Watcher, opts WatchOptions) *watches {
	if w == nil {
		return nil
	}
	ws := &watches{opts: opts.withDefaults(), done: make(chan struct{}), byRun: map[string]map[*follower]struct{}{}}
	w.Add(ws)
	return ws
}

// follower is one watch's view of its run: the furthest row offered so far.
type follower struct {
	run string
	// ready has a token when a row was offered since the last take.
	ready chan struct{}

	mu  sync.Mutex
	row state.Run
	has bool
}

// offer keeps row if it is further on than the one held. Rows arrive from
// several goroutines (the broadcast, the periodic re-read, a guard's read),
// not always in the order they were read: an older one is dropped.
func (f *follower) offer(row state.Run) {
	f.mu.Lock()
	if f.has && !After(row, f.row.CancelVersion, f.row.Status) {
		f.mu.Unlock()
		return
	}
	f.row, f.has = row, true
	f.mu.Unlock()
	select {
	case f.ready <- struct{}{}:
	default:
	}
}

func (f *follower) latest() state.Run {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.row
}

// follow opens a watch of run, within the bounds.
func (ws *watches) follow(run string) (*follower, error) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	if ws.total >= ws.opts.Max {
		return nil, refusal.New(refusal.TooManyConnections, "this instance already serves %d watches, the most it serves at once; retry later, another instance, or long-poll less often", ws.total)
	}
	if n := len(ws.byRun[run]); n >= ws.opts.MaxPerRun {
		return nil, refusal.New(refusal.TooManyConnections, "run %s already has %d watches open on this instance, the most one run may have; share one watch among a worker's tasks", run, n)
	}
	f := &follower{run: run, ready: make(chan struct{}, 1)}
	if ws.byRun[run] == nil {
		ws.byRun[run] = map[*follower]struct{}{}
	}
	ws.byRun[run][f] = struct{}{}
	ws.total++
	return f, nil
}

func (ws *watches) unfollow(f *follower) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	if _, ok := ws.byRun[f.run][f]; !ok {
		return
	}
	delete(ws.byRun[f.run], f)
	if len(ws.byRun[f.run]) == 0 {
		delete(ws.byRun, f.run)
	}
	ws.total--
}

// Holds, Runs and Enforce make watches a runwatch.Holder.
func (ws *watches) Holds(run string) bool {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	return len(ws.byRun[run]) > 0
}

func (ws *watches) Runs() []string {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	return slices.Collect(maps.Keys(ws.byRun))
}

// Enforce hands a fresh row to every watch of its run; it never blocks.
func (ws *watches) Enforce(row state.Run) {
	ws.mu.Lock()
	fs := slices.Collect(maps.Keys(ws.byRun[row.ID]))
	ws.mu.Unlock()
	for _, f := range fs {
		f.offer(row)
	}
}

// Open counts the watches open now.
func (ws *watches) open() int {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	return ws.total
}

// EndWatches ends every watch: a stream gets its last event (end, reason
// shutdown), a long poll its answer now, and a watch that begins after this
// gets the row and ends at once. serve calls it before it shuts the control
// listener down, so that the shutdown does not wait on streams that would
// never end by themselves.
func (h *Handler) EndWatches() {
	if h.watches != nil {
		h.watches.doneOnce.Do(func() { close(h.watches.done) })
	}
}

// OpenWatches counts the watches open now.
func (h *Handler) OpenWatches() int {
	if h.watches == nil {
		return 0
	}
	return h.watches.open()
}

// poll is a long poll's question: answer once the row is not at (version,
// status), or after wait.
type poll struct {
	version int64
	status  state.Status
	wait    time.Duration
}

// parsePoll reads the long-poll parameters; nil means a stream.
func parsePoll(q url.Values) (*poll, error) {
	_, hasWait := q["wait"]
	_, hasVersion := q["after_version"]
	_, hasStatus := q["after_status"]
	if !hasWait && !hasVersion && !hasStatus {
		return nil, nil
	}
	if !hasVersion {
		return nil, refusal.New(refusal.InvalidRequest, "a long poll needs after_version: the cancel_version of the row you hold (GET /v1/runs/{run} first)")
	}
	p := &poll{status: state.StatusActive, wait: DefaultPollWait}
	v, err := strconv.ParseInt(q.Get("after_version"), 10, 64)
	if err != nil || v < 0 {
		return nil, refusal.New(refusal.InvalidRequest, "after_version %.40q: want the cancel_version you hold, a whole number of 0 or more", q.Get("after_version"))
	}
	p.version = v
	if hasStatus {
		if p.status, err = state.ParseStatus(q.Get("after_status")); err != nil {
			return nil, refusal.New(refusal.InvalidRequest, "after_status %.40q: want the status of the row you hold: ACTIVE, CANCELLING, CANCELLED, COMPLETED or UNKNOWN", q.Get("after_status"))
		}
	}
	if hasWait {
		d, err := parseDuration("wait", q.Get("wait"))
		if err != nil {
			return nil, refusal.New(refusal.InvalidRequest, "%v", err)
		}
		if d <= 0 || d > MaxPollWait {
			return nil, refusal.New(refusal.InvalidRequest, "wait %s: want a duration above 0 and at most %s", d, MaxPollWait)
		}
		p.wait = d
	}
	return p, nil
}

// watch serves GET /v1/runs/{run}/watch, a stream or a long poll.
func (h *Handler) watch(w http.ResponseWriter, r *http.Request) {
	id, err := runID(r)
	if err != nil {
		h.writeError(w, r, err)
		return
	}
	p, err := parsePoll(r.URL.Query())
	if err != nil {
		h.writeError(w, r, err)
		return
	}
	if h.watches == nil {
		h.writeError(w, r, refusal.New(refusal.NotFound, "this control API watches no runs (it was built without a run watcher): read GET /v1/runs/%s instead", id))
		return
	}
	f, err := h.watches.follow(id)
	if err != nil {
		h.log.Info("control: watch refused", "run", id, "open", h.watches.open(), "remote", r.RemoteAddr, "err", err)
		h.writeError(w, r, err)
		return
	}
	defer h.watches.unfollow(f)
	// Followed before the first read: a transition that commits between
	// the two reaches the follower either way.
	ctx, cancel := context.WithTimeout(r.Context(), h.storeTimeout)
	row, err := h.store.Get(ctx, id)
	cancel()
	if err != nil {
		h.writeError(w, r, fmt.Errorf("read run %s: %w", id, err))
		return
	}
	f.offer(row)
	if p != nil {
		h.longPoll(w, r, f, *p)
		return
	}
	h.stream(w, r, f)
}

// stream writes the run's row, then every row further on, as Server-Sent
// Events until the run is final, the client goes, the stream ages out or
// the server shuts down.
func (h *Handler) stream(w http.ResponseWriter, r *http.Request, f *follower) {
	opts := h.watches.opts
	rc := http.NewResponseController(w)
	hdr := w.Header()
	hdr.Set("Content-Type", "text/event-stream")
	hdr.Set("Cache-Control", "no-store")
	hdr.Set("X-Content-Type-Options", "nosniff")
	// A buffering proxy in between (nginx) would hold the events back.
	hdr.Set("X-Accel-Buffering", "no")
	if r.Method == http.MethodHead {
		w.WriteHeader(http.StatusOK)
		return
	}
	// send writes and flushes one piece, bounded: the listener's own write
	// timeout counts from the request, which a stream outlives, and a
	// client that does not read must not hold the goroutine for longer.
	send := func(b []byte) bool {
		_ = rc.SetWriteDeadline(time.Now().Add(opts.WriteTimeout))
		if _, err := w.Write(b); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	end := func(reason string) {
		b, _ := json.Marshal(WatchEnd{Reason: reason})
		send(sseEvent("end", b))
	}
	started := time.Now()
	h.log.Debug("control: watch stream opened", "run", f.run, "remote", r.RemoteAddr)
	defer func() {
		h.log.Debug("control: watch stream closed", "run", f.run, "remote", r.RemoteAddr, "duration", time.Since(started))
	}()
	// retry: how long an EventSource waits before it reconnects.
	if !send([]byte("retry: 1000\n\n")) {
		return
	}
	heartbeat := time.NewTicker(opts.Heartbeat)
	defer heartbeat.Stop()
	age := time.NewTimer(opts.MaxAge)
	defer age.Stop()
	var sent state.Run
	for {
		if row := f.latest(); After(row, sent.CancelVersion, sent.Status) {
			b, err := json.Marshal(normRun(row))
			if err != nil || !send(sseEvent("run", b)) {
				return
			}
			sent = row
			if row.Final() {
				end(WatchEndFinal)
				return
			}
		}
		select {
		case <-f.ready:
		case <-heartbeat.C:
			if !send([]byte(": heartbeat\n\n")) {
				return
			}
		case <-age.C:
			end(WatchEndMaxAge)
			return
		case <-h.watches.done:
			end(WatchEndShutdown)
			return
		case <-r.Context().Done():
			return
		}
	}
}

// sseEvent is one event; data is one line of JSON (encoding/json writes
// no newline inside a value).
func sseEvent(name string, data []byte) []byte {
	b := make([]byte, 0, len(name)+len(data)+16)
	b = append(b, "event: "...)
	b = append(b, name...)
	b = append(b, "\ndata: "...)
	b = append(b, data...)
	return append(b, "\n\n"...)
}

// longPoll answers the row once it is not the one the caller holds (at
// once if it already is not, or if it is final), or the row as it stands
// when the wait runs out.
func (h *Handler) longPoll(w http.ResponseWriter, r *http.Request, f *follower, p poll) {
	// The listener's write timeout counts from the request; the answer
	// comes after the wait.
	_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(p.wait + h.watches.opts.WriteTimeout))
	answer := func(row state.Run, what string) {
		w.Header().Set(WatchHeader, what)
		refusal.WriteJSON(w, http.StatusOK, normRun(row))
	}
	wait := time.NewTimer(p.wait)
	defer wait.Stop()
	for {
		row := f.latest()
		switch {
		case row.CancelVersion != p.version || row.Status != p.status:
			answer(row, WatchChanged)
			return
		case row.Final():
			answer(row, WatchFinal)
			return
		}
		select {
		case <-f.ready:
		case <-wait.C:
			answer(row, WatchUnchanged)
			return
		case <-h.watches.done:
			answer(row, WatchUnchanged)
			return
		case <-r.Context().Done():
			return
		}
	}
}
