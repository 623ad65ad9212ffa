package browserguard

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"sync"
	"sync/atomic"
	"time"

	"github.com/coder/websocket"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/telemetry"
)

// session is one client's CDP connection and its session on the
// browser's DevTools pipe.
type session struct {
	g       *Guard
	run     string
	version int64
	client  *websocket.Conn
	att     *attachment
	log     *slog.Logger

	// ctx lives as long as the session; cancelling it ends reads and
	// writes on the client connection.
	ctx  context.Context
	stop context.CancelFunc
	once sync.Once
	// expires is when the run token the connection was opened with
	// expires (zero: it was opened with a version): past it, actions are
	// refused, as the egress proxy refuses the token.
	expires time.Time
	// quit is closed when end is called, before the client connection
	// closes: an admitted command not yet written then was provably never
	// sent (ended says the same to whoever cannot select on quit).
	quit  chan struct{}
	ended atomic.Bool

	mu sync.Mutex
	// pending are admitted actions forwarded to the browser and not yet
	// answered, by the id and session the browser will answer with.
	pending map[cmdKey]state.Intent
	// overReason, once the run is over, is what the client is told when
	// its connection closes, whatever closes it.
	overReason string
}

type cmdKey struct {
	id      int64
	session string
}

func newSession(g *Guard, run string, version int64, client *websocket.Conn, att *attachment) *session {
	ctx, stop := context.WithCancel(context.Background())
	return &session{
		g: g, run: run, version: version, client: client, att: att,
		log: g.log.With("run", run), ctx: ctx, stop: stop, quit: make(chan struct{}), pending: map[cmdKey]state.Intent{},
	}
}

// serve carries frames until either side goes or end is called, then
// gives the session back to the browser and records what the browser
// never answered.
func (s *session) serve() {
	var wg sync.WaitGroup
	wg.Go(s.toClient)
	s.fromClient()
	s.end(websocket.StatusNormalClosure, "")
	wg.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), browserFetchTimeout)
	s.att.detach(ctx)
	cancel()
	s.stop()
	s.abandon("the CDP connection closed before the browser answered")
}

// noteOver keeps what the client is told when its connection closes now
// that its run is over: the refusal, rather than a bare close.
func (s *session) noteOver(r *refusal.Refusal) {
	s.mu.Lock()
	s.overReason = r.CloseReason()
	s.mu.Unlock()
}

// end closes the connection once, telling the client why. The close
// handshake with the client runs on its own so that whoever ends a session
// (the cancel watcher, a shutdown) never waits on a slow client.
func (s *session) end(code websocket.StatusCode, reason string) {
	s.once.Do(func() {
		s.ended.Store(true)
		close(s.quit)
		s.mu.Lock()
		if s.overReason != "" && code != websocket.StatusGoingAway {
			// Whatever ends it (the browser stopped after its linger, or
			// exited, or the client went), the run is over: say so.
			code, reason = websocket.StatusPolicyViolation, s.overReason
		}
		s.mu.Unlock()
		// A close reason is at most 123 bytes on the wire.
		reason = state.Clip(reason, 123)
		s.att.end(code, reason)
		go func() {
			_ = s.client.Close(code, reason)
			s.stop()
		}()
	})
}

// fromClient reads the client's frames and forwards, guards or answers each.
func (s *session) fromClient() {
	limit := s.g.cfg.MaxMessage
	for {
		typ, rd, err := s.client.Reader(s.ctx)
		if err != nil {
			return
		}
		data, tooBig, err := readBounded(rd, limit)
		if err != nil {
			// Past the hard limit the library has closed the connection.
			s.log.Info("CDP client frame could not be read; closing", "err", err)
			return
		}
		switch {
		case tooBig:
			// Its id, if it comes early: the rest is not read again.
			c, _ := parseCommand(data[:min(len(data), tooBigIDScan)])
			s.answer(errorFrame(c, codeInvalidRequest, fmt.Sprintf(
				"stopgate: frame is larger than %d bytes; nothing was forwarded", limit), ""))
		case typ != websocket.MessageText:
			c, _ := parseCommand(data)
			s.answer(errorFrame(c, codeInvalidRequest,
				"stopgate: binary frame: CDP commands are JSON text frames; nothing was forwarded", ""))
		default:
			s.handle(data)
		}
	}
}

// tooBigIDScan is how much of an oversized frame is read for its id.
const tooBigIDScan = 64 << 10

// readBounded reads one message, keeping at most limit bytes; a longer one
// is read to its end and reported too big, with its first limit bytes.
func readBounded(rd io.Reader, limit int64) ([]byte, bool, error) {
	data, err := io.ReadAll(io.LimitReader(rd, limit+1))
	if err != nil {
		return nil, false, err
	}
	if int64(len(data)) <= limit {
		return data, false, nil
	}
	if _, err := io.Copy(io.Discard, rd); err != nil {
		return nil, true, err
	}
	return data[:limit], true, nil
}

func (s *session) handle(data []byte) {
	c, err := parseCommand(data)
	if err != nil {
		s.answer(errorFrame(c, codeInvalidRequest, "stopgate: bad CDP frame: "+err.Error()+"; nothing was forwarded", ""))
		return
	}
	if !s.att.owns(c.SessionID) {
		// As Chromium answers it: the session is not this connection's.
		s.answer(errorFrame(c, codeSessionNotFound, "Session with given id not found.", ""))
		return
	}
	if !s.expires.IsZero() && !time.Now().Before(s.expires) {
		rf := refusal.New(refusal.Unauthorized, "the run token this connection was opened with expired at %s: nothing was sent; "+
			"connect again with a new URL (stopgate browser --run %s)", s.expires.UTC().Format(time.RFC3339), s.run)
		s.answer(refusalFrame(c, rf.CDPMessage(c.Method), rf.CDPData()))
		return
	}
	if why := forbidden(c, Sandbox{Uploads: s.g.cfg.Uploads}.UploadDir(s.run)); why != "" {
		s.refuse(c, why)
		return
	}
	if downloadMethods[c.Method] {
		// Downloads stay off: an allow is forwarded as deny.
		var err error
		if c, data, err = downloadsDenied(c, data); err != nil {
			s.answer(errorFrame(c, codeInvalidRequest, "stopgate: bad CDP frame: "+err.Error()+"; nothing was forwarded", ""))
			return
		}
	}
	if !isAction(c.Method) {
		s.forward(c, data)
		return
	}
	key := cmdKey{c.ID, c.SessionID}
	s.mu.Lock()
	_, dup := s.pending[key]
	s.mu.Unlock()
	if dup {
		// The browser's answer could not be told from the first one's.
		s.answer(errorFrame(c, codeInvalidRequest, fmt.Sprintf(
			"stopgate: command id %d is still awaiting the browser's answer on this session; use a new id; nothing was forwarded", c.ID), ""))
		return
	}

	recorded, keyTarget, digest := effectOf(c)
	greq := state.GuardRequest{
		RunID: s.run, ObservedVersion: s.version, Key: intents.DerivedKey(s.run, c.Method, keyTarget, digest),
		Boundary: state.BoundaryBrowser, Method: c.Method, Target: recorded, BodyDigest: digest, AutoAdmit: s.g.cfg.AutoAdmit,
	}
	// The guard's answer is learned even if the client goes meanwhile: an
	// admission nobody heard of would sit IN_FLIGHT until its lease expires.
	started := time.Now()
	res, err := s.g.cfg.Ledger.Begin(context.WithoutCancel(s.ctx), greq)
	d := telemetry.Decision{Boundary: state.BoundaryBrowser, Run: s.run, Version: s.version, Method: c.Method,
		Host: hostOf(recorded), Store: time.Since(started), Via: "cdp"}
	if err == nil && !res.Admitted {
		err = refusal.FromGuard(greq, res)
	}
	if err != nil {
		rf := refusal.FromError(err)
		d.Result, d.Reason, d.Intent, d.Recorded = telemetry.Refused, string(rf.Code), rf.Intent, rf.Recorded
		if rf.Code == refusal.StoreUnavailable || rf.Code == refusal.Internal {
			d.Detail = rf.Message
		}
		s.g.cfg.Telemetry.Decided(s.ctx, d)
		s.answer(refusalFrame(c, rf.CDPMessage(c.Method), rf.CDPData()))
		return
	}
	d.Result, d.Intent, d.Recorded = telemetry.Admitted, res.Intent.Key, res.Intent.State
	s.g.cfg.Telemetry.Decided(s.ctx, d)
	if s.ended.Load() {
		s.finish(res.Intent, state.IntentNotSent, "the CDP connection closed before the command was forwarded")
		return
	}
	// Pending before the write, so that the answer cannot come first.
	s.mu.Lock()
	s.pending[key] = res.Intent
	s.mu.Unlock()
	if err := s.att.send(c, data); err != nil {
		if in, ok := s.take(key); ok {
			s.finish(in, state.IntentUnknown, "writing the command to the browser failed: "+err.Error())
		}
		s.end(websocket.StatusInternalError, "stopgate: the browser connection failed")
	}
}

// refuse answers a command that is never forwarded, and records it as
// refused for why (command_not_allowed), whatever the run's state, in the
// guard's one step. A store that does not answer does not change the
// answer: the command is refused all the same, unrecorded.
func (s *session) refuse(c command, why string) {
	recorded, keyTarget, digest := effectOf(c)
	greq := state.GuardRequest{
		RunID: s.run, ObservedVersion: s.version, Key: intents.DerivedKey(s.run, c.Method, keyTarget, digest),
		Boundary: state.BoundaryBrowser, Method: c.Method, Target: recorded, BodyDigest: digest, AutoAdmit: s.g.cfg.AutoAdmit,
		Refuse: string(refusal.CommandNotAllowed),
	}
	rf := refusal.New(refusal.CommandNotAllowed, "%s; nothing was sent", why)
	rf.RunID, rf.ObservedVersion = s.run, s.version
	started := time.Now()
	res, err := s.g.cfg.Ledger.Begin(context.WithoutCancel(s.ctx), greq)
	d := telemetry.Decision{Boundary: state.BoundaryBrowser, Run: s.run, Version: s.version, Method: c.Method,
		Host: hostOf(recorded), Store: time.Since(started), Via: "cdp", Result: telemetry.Refused, Reason: string(rf.Code)}
	switch {
	case err != nil:
		rf.Message += "; the refusal could not be recorded: " + err.Error()
		d.Detail = err.Error()
	case res.Refusal == greq.Refuse:
		rf.Intent, rf.Recorded = res.Intent.Key, state.IntentCancelledBeforeDispatch
		rf.Message += "; recorded " + string(state.IntentCancelledBeforeDispatch) + " under " + res.Intent.Key
		d.Intent, d.Recorded = rf.Intent, rf.Recorded
	}
	s.g.cfg.Telemetry.Decided(s.ctx, d)
	s.answer(refusalFrame(c, rf.CDPMessage(c.Method), rf.CDPData()))
}

// downloadsDenied is a setDownloadBehavior command with behavior deny,
// read again from its new frame.
func downloadsDenied(c command, data []byte) (command, []byte, error) {
	params, err := withDownloadsDenied(c.Params)
	if err != nil || params == nil {
		return c, data, err
	}
	frame, err := withParams(c, data, params)
	if err != nil {
		return c, data, err
	}
	nc, err := parseCommand(frame)
	if err != nil {
		return c, data, err
	}
	return nc, frame, nil
}

func (s *session) forward(c command, data []byte) {
	if err := s.att.send(c, data); err != nil {
		s.end(websocket.StatusInternalError, "stopgate: the browser connection failed")
	}
}

// answer sends the guard's own answer to the client.
func (s *session) answer(frame []byte) {
	if err := s.client.Write(s.ctx, websocket.MessageText, frame); err != nil {
		s.end(websocket.StatusNormalClosure, "")
	}
}

// toClient carries the browser's frames to the client, recording the
// answers to admitted actions before the client sees them. When the
// browser's side ends (the browser stopped or exited), what it sent
// before goes out first.
func (s *session) toClient() {
	for {
		select {
		case f := <-s.att.frames:
			if !s.deliver(f) {
				return
			}
		case <-s.att.Ended():
			for len(s.att.frames) > 0 {
				if !s.deliver(<-s.att.frames) {
					return
				}
			}
			s.end(s.att.code, s.att.reason)
			return
		case <-s.quit:
			return
		}
	}
}

func (s *session) deliver(frame []byte) bool {
	if s.waiting() {
		if r := parseReply(frame); r.HasID {
			if in, ok := s.take(cmdKey{r.ID, r.SessionID}); ok {
				s.finish(in, state.IntentResponded, r.Err)
			}
		}
	}
	if err := s.client.Write(s.ctx, websocket.MessageText, frame); err != nil {
		s.end(websocket.StatusNormalClosure, "")
		return false
	}
	return true
}

func (s *session) waiting() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.pending) > 0
}

func (s *session) take(key cmdKey) (state.Intent, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	in, ok := s.pending[key]
	delete(s.pending, key)
	return in, ok
}

// abandon records every action still unanswered as UNKNOWN: it was
// forwarded, and whether the browser carried it out nobody can say.
func (s *session) abandon(reason string) {
	s.mu.Lock()
	left := s.pending
	s.pending = map[cmdKey]state.Intent{}
	s.mu.Unlock()
	for _, in := range left {
		s.finish(in, state.IntentUnknown, reason)
	}
}

func (s *session) finish(in state.Intent, outcome state.IntentState, reason string) {
	started := time.Now()
	_, err := s.g.cfg.Ledger.Finish(context.WithoutCancel(s.ctx), state.FinishRequest{RunID: in.RunID, Key: in.Key, Attempt: in.Attempts, Outcome: outcome, Reason: state.Clip(reason, state.MaxTextLen)})
	s.g.cfg.Telemetry.Decided(s.ctx, telemetry.Decision{Boundary: state.BoundaryBrowser, Result: telemetry.Finished, Run: s.run,
		Version: s.version, Method: in.Method, Intent: in.Key, Recorded: outcome, Store: time.Since(started), Via: "cdp"})
	if err == nil {
		return
	}
	var conflict *state.Conflict
	if errors.As(err, &conflict) {
		// The sweeper got there first (drain deadline, lease expiry): the
		// record already says what happened.
		s.log.Debug("action outcome not recorded: the intent moved on", "intent", in.Key, "outcome", outcome, "err", err)
		return
	}
	s.log.Warn("action outcome not recorded; its lease expires into UNKNOWN", "intent", in.Key, "outcome", outcome, "err", err)
}

// hostOf is the host of a recorded target, for the decision line; "" when
// the target is not a URL (a script, a key press).
func hostOf(target string) string {
	u, err := url.Parse(target)
	if err != nil {
		return ""
	}
	return u.Host
}
