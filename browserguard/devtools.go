package browserguard

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"

	cdpbrowser "github.com/chromedp/cdproto/browser"
	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/target"
	"github.com/coder/websocket"

	"github.com/stopgate/stopgate/state"
)

// maxPipeMessage bounds one message the browser writes on its DevTools
// pipe: screenshots, PDFs and whole DOMs come this way. Past it the pipe
// is closed, and with it the browser.
const maxPipeMessage = 512 << 20

// errDevToolsClosed is the error of a call on a DevTools that has closed.
var errDevToolsClosed = errors.New("the browser's DevTools pipe is closed")

// DevTools is the one CDP connection to a launched browser: the pipe it
// was started with (--remote-debugging-pipe), which only stopgate holds.
// Chromium listens on no port, so the guard is the only way in.
//
// Every client connection gets a session of its own on the pipe: a
// browser session (Target.attachToBrowserTarget) for the browser endpoint,
// a page session (Target.attachToTarget) for a page endpoint. Its root
// frames are sent in that session, the sessions it attaches to are its
// own, and the browser's frames are routed back by session. So clients do
// not see each other's sessions, and when one goes its session is
// detached (and with it the targets it auto-attached and the sessions it
// opened), as Chromium does for a websocket that closes.
// The pipe's own root session is the guard's alone.
type DevTools struct {
	r   io.ReadCloser  // the browser writes here
	w   io.WriteCloser // the browser reads here
	log *slog.Logger
	// id is the browser target's id, which names the guarded
	// /devtools/browser/ID endpoint; set by ready, before anyone else sees d.
	id string

	wmu sync.Mutex // one message at a time on w

	mu sync.Mutex
	// nextID numbers the guard's own commands on the root session.
	nextID int64
	calls  map[int64]chan rootReply
	// owner maps every session on the pipe to the client connection it
	// belongs to.
	owner map[string]*attachment
	// closed is set once, with the code and reason every attachment is
	// ended with.
	closed bool
	code   websocket.StatusCode
	reason string
	done   chan struct{}
}

// rootReply is the browser's answer to one of the guard's own commands.
type rootReply struct {
	result json.RawMessage
	err    error
}

// newDevTools starts reading the browser's side of the pipe.
func newDevTools(r io.ReadCloser, w io.WriteCloser, log *slog.Logger) *DevTools {
	d := &DevTools{
		r: r, w: w, log: log,
		calls: map[int64]chan rootReply{}, owner: map[string]*attachment{}, done: make(chan struct{}),
	}
	go d.read()
	return d
}

// Done is closed when the pipe is: the browser exited or was stopped.
func (d *DevTools) Done() <-chan struct{} { return d.done }

// close closes the pipe (the browser exits when it sees it close) and
// ends every client connection with code and reason. The first call's
// reason is the one told.
func (d *DevTools) close(code websocket.StatusCode, reason string) {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return
	}
	d.closed, d.code, d.reason = true, code, reason
	calls := d.calls
	d.calls = map[int64]chan rootReply{}
	atts := map[*attachment]struct{}{}
	for _, a := range d.owner {
		atts[a] = struct{}{}
	}
	d.owner = map[string]*attachment{}
	d.mu.Unlock()

	_ = d.w.Close()
	_ = d.r.Close()
	for _, ch := range calls {
		ch <- rootReply{err: errDevToolsClosed}
	}
	for a := range atts {
		a.end(code, reason)
	}
	close(d.done)
}

// write sends one message: the JSON frame and the zero byte that ends it.
func (d *DevTools) write(frame []byte) error {
	if bytes.IndexByte(frame, 0) >= 0 {
		// Valid JSON has no raw zero byte; one would end the message early.
		return errors.New("frame holds a zero byte")
	}
	msg := make([]byte, 0, len(frame)+1)
	msg = append(append(msg, frame...), 0)
	d.wmu.Lock()
	defer d.wmu.Unlock()
	select {
	case <-d.done:
		return errDevToolsClosed
	default:
	}
	if _, err := d.w.Write(msg); err != nil {
		return fmt.Errorf("writing to the browser's DevTools pipe: %w", err)
	}
	return nil
}

// call sends one of the guard's own commands on the root session and
// decodes the browser's answer into result (when not nil).
func (d *DevTools) call(ctx context.Context, method string, params, result any) error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return errDevToolsClosed
	}
	d.nextID++
	id := d.nextID
	ch := make(chan rootReply, 1)
	d.calls[id] = ch
	d.mu.Unlock()
	forget := func() {
		d.mu.Lock()
		delete(d.calls, id)
		d.mu.Unlock()
	}

	msg := map[string]any{"id": id, "method": method}
	if params != nil {
		msg["params"] = params
	}
	frame, err := json.Marshal(msg)
	if err != nil {
		forget()
		return fmt.Errorf("%s: %w", method, err)
	}
	if err := d.write(frame); err != nil {
		forget()
		return fmt.Errorf("%s: %w", method, err)
	}
	select {
	case r := <-ch:
		if r.err != nil {
			return fmt.Errorf("%s: %w", method, r.err)
		}
		if result != nil {
			if err := json.Unmarshal(r.result, result); err != nil {
				return fmt.Errorf("%s: reading the browser's answer: %w", method, err)
			}
		}
		return nil
	case <-ctx.Done():
		forget()
		return fmt.Errorf("%s: the browser did not answer: %w", method, ctx.Err())
	}
}

// ready waits for the browser's first answer, which names its own target:
// the browser is up and its pipe works.
func (d *DevTools) ready(ctx context.Context) error {
	var res target.GetTargetInfoResult
	if err := d.call(ctx, target.CommandGetTargetInfo, nil, &res); err != nil {
		return err
	}
	if res.TargetInfo == nil || res.TargetInfo.Type != "browser" || res.TargetInfo.TargetID == "" {
		return errors.New("Target.getTargetInfo did not name the browser target")
	}
	d.id = string(res.TargetInfo.TargetID)
	return nil
}

// BrowserID is the browser target's id.
func (d *DevTools) BrowserID() string { return d.id }

// version is the browser's Browser.getVersion.
func (d *DevTools) version(ctx context.Context) (cdpbrowser.GetVersionResult, error) {
	var v cdpbrowser.GetVersionResult
	err := d.call(ctx, cdpbrowser.CommandGetVersion, nil, &v)
	return v, err
}

// denyDownloads turns downloads off in the browser's default context, from
// the guard's own session: at the start, and again whenever a client's
// session goes (Chromium puts back the default, downloads on, for the
// contexts a detaching session had set).
func (d *DevTools) denyDownloads(ctx context.Context) error {
	return d.call(ctx, cdpbrowser.CommandSetDownloadBehavior, cdpbrowser.SetDownloadBehaviorParams{Behavior: cdpbrowser.SetDownloadBehaviorBehaviorDeny}, nil)
}

// targets lists the browser's targets.
func (d *DevTools) targets(ctx context.Context) ([]*target.Info, error) {
	var res target.GetTargetsResult
	if err := d.call(ctx, target.CommandGetTargets, nil, &res); err != nil {
		return nil, err
	}
	return res.TargetInfos, nil
}

// read routes what the browser writes until the pipe closes.
func (d *DevTools) read() {
	br := bufio.NewReaderSize(d.r, 64<<10)
	var err error
	for {
		var frame []byte
		if frame, err = readMessage(br, maxPipeMessage); err != nil {
			break
		}
		if len(bytes.TrimSpace(frame)) > 0 {
			d.route(frame)
		}
	}
	d.mu.Lock()
	closing := d.closed
	d.mu.Unlock()
	if !closing && !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
		d.log.Warn("reading the browser's DevTools pipe failed; closing it", "err", err)
	}
	d.close(websocket.StatusInternalError, "stopgate: the browser's DevTools pipe closed (the browser exited)")
}

// readMessage reads one zero-ended message of at most limit bytes.
func readMessage(br *bufio.Reader, limit int) ([]byte, error) {
	var msg []byte
	for {
		part, err := br.ReadSlice(0)
		if len(msg)+len(part) > limit+1 {
			return nil, fmt.Errorf("a DevTools message is larger than %d bytes", limit)
		}
		msg = append(msg, part...)
		switch {
		case err == nil:
			return msg[:len(msg)-1], nil
		case errors.Is(err, bufio.ErrBufferFull):
		case errors.Is(err, io.EOF) && len(msg) > 0:
			return nil, io.ErrUnexpectedEOF
		default:
			return nil, err
		}
	}
}

// browserFrame is what routing reads of a frame from the browser.
type browserFrame struct {
	id        int64
	hasID     bool
	method    string
	sessionID string
	session   member
	params    json.RawMessage
	result    json.RawMessage
	err       json.RawMessage
}

func parseBrowserFrame(frame []byte) (browserFrame, error) {
	var f browserFrame
	m, err := members(frame, memberID, memberMethod, memberSessionID, memberParams, "result", memberError)
	if err != nil {
		return f, err
	}
	if mm, ok := m[memberID]; ok {
		if f.id, err = readID(mm.raw); err != nil {
			return f, err
		}
		f.hasID = true
	}
	if mm, ok := m[memberMethod]; ok {
		if f.method, err = readString("method", mm.raw); err != nil {
			return f, err
		}
	}
	if mm, ok := m[memberSessionID]; ok {
		if f.sessionID, err = readString("sessionId", mm.raw); err != nil {
			return f, err
		}
		f.session = mm
	}
	f.params, f.result, f.err = m[memberParams].raw, m["result"].raw, m[memberError].raw
	return f, nil
}

// route hands a frame to whom it is for: the guard (root session), or the
// client connection whose session it names.
func (d *DevTools) route(frame []byte) {
	f, err := parseBrowserFrame(frame)
	if err != nil {
		d.log.Warn("a DevTools message from the browser could not be read; dropped", "err", err, "frame", state.Clip(string(frame), 256))
		return
	}
	if f.sessionID == "" {
		d.routeRoot(f)
		return
	}
	d.mu.Lock()
	a := d.owner[f.sessionID]
	if a == nil {
		d.mu.Unlock()
		d.log.Debug("DevTools message for a session no connection holds; dropped", "session", f.sessionID, "method", f.method)
		return
	}
	switch f.method {
	case target.AttachedToTarget.Method:
		// A session the client's session opened (auto-attach) is its own.
		var p target.EventAttachedToTarget
		if json.Unmarshal(f.params, &p) == nil && p.SessionID != "" {
			d.owner[string(p.SessionID)] = a
		}
	case target.DetachedFromTarget.Method:
		var p target.EventDetachedFromTarget
		if json.Unmarshal(f.params, &p) == nil && string(p.SessionID) != a.root {
			delete(d.owner, string(p.SessionID))
		}
	}
	clientSession := f.sessionID
	if clientSession == a.root {
		clientSession = ""
	}
	if f.hasID && f.err == nil {
		if method, ok := a.tracked(cmdKey{f.id, clientSession}); ok {
			a.learn(method, f.result)
		}
	}
	d.mu.Unlock()

	if clientSession == "" {
		// The client knows its root session as no session at all.
		frame = dropMember(frame, f.session)
	}
	a.deliver(frame)
}

func (d *DevTools) routeRoot(f browserFrame) {
	if f.hasID {
		d.mu.Lock()
		ch := d.calls[f.id]
		delete(d.calls, f.id)
		d.mu.Unlock()
		if ch == nil {
			return
		}
		r := rootReply{result: f.result}
		if f.err != nil {
			var e struct {
				Code    int    `json:"code"`
				Message string `json:"message"`
			}
			_ = json.Unmarshal(f.err, &e)
			r.err = fmt.Errorf("browser answered error %d: %s", e.Code, e.Message)
		}
		ch <- r
		return
	}
	if f.method != target.DetachedFromTarget.Method {
		return
	}
	// A client's own session went: its page closed, or a client closed
	// it itself through another session.
	var p target.EventDetachedFromTarget
	if json.Unmarshal(f.params, &p) != nil {
		return
	}
	d.mu.Lock()
	a := d.owner[string(p.SessionID)]
	d.mu.Unlock()
	if a != nil && a.root == string(p.SessionID) {
		a.end(websocket.StatusNormalClosure, "stopgate: the target of this connection was closed")
	}
}

// attach opens a client connection's session: a browser session when
// targetID is "", else a session of that target.
func (d *DevTools) attach(ctx context.Context, targetID string) (*attachment, error) {
	var res target.AttachToTargetResult
	var err error
	if targetID == "" {
		err = d.call(ctx, target.CommandAttachToBrowserTarget, nil, &res)
	} else {
		flat := true
		err = d.call(ctx, target.CommandAttachToTarget, target.AttachToTargetParams{TargetID: target.ID(targetID), Flatten: &flat}, &res)
	}
	if err != nil {
		return nil, err
	}
	if res.SessionID == "" {
		return nil, errors.New("the browser opened no session")
	}
	a := &attachment{
		d: d, root: string(res.SessionID), frames: make(chan []byte, attachmentQueue), ended: make(chan struct{}),
		pending: map[cmdKey]string{},
	}
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil, errDevToolsClosed
	}
	d.owner[a.root] = a
	d.mu.Unlock()
	return a, nil
}

// attachmentQueue bounds the frames waiting for one client: a client that
// does not read them is closed rather than let it hold up the others.
const attachmentQueue = 4096

// attachment is one client connection's part of the pipe: its session
// and what it opened from there.
type attachment struct {
	d    *DevTools
	root string
	// frames are the browser's frames for the client, in order.
	frames chan []byte

	once   sync.Once
	ended  chan struct{}
	code   websocket.StatusCode
	reason string

	// Guarded by d.mu: commands whose answers say what the client now
	// holds, and what it created, to dispose of when it goes.
	pending  map[cmdKey]string
	contexts []string
}

// The commands whose answers name what a client now holds.
var trackedMethods = map[string]bool{
	target.CommandAttachToTarget:        true,
	target.CommandAttachToBrowserTarget: true,
	target.CommandCreateBrowserContext:  true,
}

// tracked takes a tracked command's method by its key (d.mu held).
func (a *attachment) tracked(k cmdKey) (string, bool) {
	m, ok := a.pending[k]
	delete(a.pending, k)
	return m, ok
}

// learn records what a tracked command's answer gave the client (d.mu held).
func (a *attachment) learn(method string, result json.RawMessage) {
	switch method {
	case target.CommandCreateBrowserContext:
		var r target.CreateBrowserContextResult
		if json.Unmarshal(result, &r) == nil && r.BrowserContextID != "" {
			a.contexts = append(a.contexts, string(r.BrowserContextID))
		}
	default:
		var r target.AttachToTargetResult
		if json.Unmarshal(result, &r) == nil && r.SessionID != "" {
			a.d.owner[string(r.SessionID)] = a
		}
	}
}

// owns reports whether the client may send in a session: its own root
// ("" to it) or one it opened.
func (a *attachment) owns(session string) bool {
	if session == "" {
		return true
	}
	a.d.mu.Lock()
	defer a.d.mu.Unlock()
	return session != a.root && a.d.owner[session] == a
}

// send writes a client's command, already read and admitted, in the
// client's session: a frame that names no session (or "") goes in the
// client's root session.
func (a *attachment) send(c command, frame []byte) error {
	if c.SessionID == "" {
		var err error
		if frame, err = inSession(c, frame, a.root); err != nil {
			return err
		}
	}
	if trackedMethods[c.Method] {
		a.d.mu.Lock()
		a.pending[cmdKey{c.ID, c.SessionID}] = c.Method
		a.d.mu.Unlock()
	}
	return a.d.write(frame)
}

// inSession is a root frame of a client, read as c, sent in session
// instead: its sessionId member ("" or none) becomes the session's.
func inSession(c command, frame []byte, session string) ([]byte, error) {
	if c.HasSession {
		frame = dropMember(frame, c.session)
	}
	return withMember(frame, memberSessionID, session)
}

// deliver queues a frame for the client; one that does not keep up is
// ended.
func (a *attachment) deliver(frame []byte) {
	select {
	case <-a.ended:
		return
	default:
	}
	select {
	case a.frames <- frame:
	default:
		a.end(websocket.StatusPolicyViolation, fmt.Sprintf("stopgate: the client left %d browser messages unread", attachmentQueue))
	}
}

// end stops delivering to the client and tells it why; the first call
// wins.
func (a *attachment) end(code websocket.StatusCode, reason string) {
	a.once.Do(func() {
		a.code, a.reason = code, reason
		close(a.ended)
	})
}

// Ended is closed when the attachment ends; code and reason say why.
func (a *attachment) Ended() <-chan struct{} { return a.ended }

// detach gives the client's session and what it created back to the
// browser: its session (and with it what it attached to) is detached and
// the browser contexts it created are disposed of, as when a client's
// websocket to Chromium closes.
func (a *attachment) detach(ctx context.Context) {
	a.end(websocket.StatusNormalClosure, "")
	d := a.d
	d.mu.Lock()
	for s, o := range d.owner {
		if o == a {
			delete(d.owner, s)
		}
	}
	contexts := a.contexts
	d.mu.Unlock()
	if err := d.call(ctx, target.CommandDetachFromTarget, target.DetachFromTargetParams{SessionID: target.SessionID(a.root)}, nil); err != nil && !errors.Is(err, errDevToolsClosed) {
		d.log.Debug("detaching a closed connection's session", "session", a.root, "err", err)
	}
	if err := d.denyDownloads(ctx); err != nil && !errors.Is(err, errDevToolsClosed) {
		d.log.Debug("turning downloads off again after a connection closed", "err", err)
	}
	for _, id := range contexts {
		if err := d.call(ctx, target.CommandDisposeBrowserContext, target.DisposeBrowserContextParams{BrowserContextID: cdp.BrowserContextID(id)}, nil); err != nil && !errors.Is(err, errDevToolsClosed) {
			d.log.Debug("disposing a closed connection's browser context", "context", id, "err", err)
		}
	}
}
