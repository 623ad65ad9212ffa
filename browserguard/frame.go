package browserguard

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"unicode/utf8"

	"github.com/stopgate/stopgate/state"
)

// CDP error codes the guard answers with. They are JSON-RPC's, as
// Chromium's own answers are.
const (
	// codeInvalidRequest: the frame is not a CDP command the guard can read.
	codeInvalidRequest = -32600
	// codeServerError: a command the guard read and refused (the run is not
	// ACTIVE, the store did not answer).
	codeServerError = -32000
	// codeSessionNotFound: a command in a session that is not the
	// connection's, as Chromium answers one in a session it does not know.
	codeSessionNotFound = -32001
)

// command is what the guard reads of one client frame. The frame itself is
// forwarded byte for byte: the guard never re-encodes what it admits.
type command struct {
	ID        int64
	HasID     bool
	Method    string
	SessionID string
	// HasSession is set when the frame names a session, even "" (which
	// clients may send for the browser's own session); session is where.
	HasSession bool
	session    member
	// Params is the raw params object, or nil when the frame has none;
	// params is where it is in the frame (when HasParams).
	Params    json.RawMessage
	HasParams bool
	params    member
}

// frameError says what is wrong with a frame, for the -32600 answer.
type frameError struct{ msg string }

func (e *frameError) Error() string { return e.msg }

func badFrame(format string, args ...any) error {
	return &frameError{msg: fmt.Sprintf(format, args...)}
}

// The top-level members the guard reads. Chromium reads these same names,
// case-sensitively, after decoding escapes; the guard must read the frame
// the way the browser will, so:
//   - names match exactly (encoding/json's struct decoding would take
//     "Method" for "method" and let a frame say one thing to the guard and
//     another to the browser);
//   - a repeated member is refused (which of two "method"s counts is
//     exactly the question a guard must never answer differently from the
//     browser);
//   - the frame must be one valid UTF-8 JSON object and nothing after it.
const (
	memberID        = "id"
	memberMethod    = "method"
	memberSessionID = "sessionId"
	memberParams    = "params"
	memberError     = "error"
)

// member is one top-level member of a frame: its raw value, and the bytes
// that removing it takes out (see dropMember).
type member struct {
	raw json.RawMessage
	// start and end bound the member in the frame: from the end of the
	// value before it (or the opening brace) to the end of its own value,
	// so that a member after the first takes its leading comma with it.
	start, end int
	first      bool
}

// topLevel walks one JSON object and returns the raw values of the wanted
// members. On a malformed frame it returns what it read before the fault
// with the error, so that an answer can still carry the frame's id.
func topLevel(data []byte, wanted ...string) (map[string]json.RawMessage, error) {
	ms, err := members(data, wanted...)
	got := make(map[string]json.RawMessage, len(ms))
	for name, m := range ms {
		got[name] = m.raw
	}
	return got, err
}

// members is topLevel with where each member lies in the frame.
func members(data []byte, wanted ...string) (map[string]member, error) {
	got := make(map[string]member, len(wanted))
	if !utf8.Valid(data) {
		return got, badFrame("frame is not valid UTF-8")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	tok, err := dec.Token()
	if err != nil {
		return got, badFrame("frame is not JSON: %v", err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return got, badFrame("frame is not a JSON object")
	}
	prevEnd := int(dec.InputOffset())
	first := true
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return got, badFrame("frame is not JSON: %v", err)
		}
		name, ok := tok.(string)
		if !ok {
			return got, badFrame("frame is not JSON: object key is not a string")
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return got, badFrame("frame is not JSON: value of %q: %v", name, err)
		}
		end := int(dec.InputOffset())
		for _, w := range wanted {
			if name != w {
				continue
			}
			if _, dup := got[name]; dup {
				return got, badFrame("member %q appears twice", name)
			}
			got[name] = member{raw: raw, start: prevEnd, end: end, first: first}
		}
		prevEnd, first = end, false
	}
	if _, err := dec.Token(); err != nil {
		return got, badFrame("frame is not JSON: %v", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return got, badFrame("frame has data after its JSON object")
	}
	return got, nil
}

// dropMember returns a copy of the frame without m, which members found in
// it.
func dropMember(data []byte, m member) []byte {
	out := make([]byte, 0, len(data))
	out = append(out, data[:m.start]...)
	rest := data[m.end:]
	if m.first {
		// The first member has no comma before it: take the one after it.
		rest = bytes.TrimLeft(rest, " \t\r\n")
		rest = bytes.TrimPrefix(rest, []byte(","))
	}
	return append(out, rest...)
}

// withParams returns a copy of c's frame with params in place of its own.
func withParams(c command, frame []byte, params json.RawMessage) ([]byte, error) {
	if c.HasParams {
		frame = dropMember(frame, c.params)
	}
	return withMember(frame, memberParams, params)
}

// withMember returns a copy of a frame (a JSON object with at least one
// member, which it does not already have) with "name":value first.
func withMember(data []byte, name string, value any) ([]byte, error) {
	i := bytes.IndexByte(data, '{')
	if i < 0 {
		return nil, errors.New("frame is not a JSON object")
	}
	k, err := json.Marshal(name)
	if err != nil {
		return nil, err
	}
	v, err := json.Marshal(value)
	if err != nil {
		return nil, err
	}
	out := make([]byte, 0, len(data)+len(k)+len(v)+2)
	out = append(out, data[:i+1]...)
	out = append(out, k...)
	out = append(out, ':')
	out = append(out, v...)
	out = append(out, ',')
	return append(out, data[i+1:]...), nil
}

// readID reads a CDP id: a JSON integer that fits Chromium's 32-bit ids.
func readID(raw json.RawMessage) (int64, error) {
	id, err := strconv.ParseInt(string(raw), 10, 64)
	if err != nil || id < math.MinInt32 || id > math.MaxInt32 {
		return 0, badFrame("id %s is not a 32-bit integer", state.Clip(string(raw), 32))
	}
	return id, nil
}

func readString(name string, raw json.RawMessage) (string, error) {
	var s string
	if len(raw) == 0 || raw[0] != '"' || json.Unmarshal(raw, &s) != nil {
		return "", badFrame("%s is not a string", name)
	}
	return s, nil
}

// parseCommand reads a client frame. On error the command still carries
// the id if one could be read, for the error answer.
func parseCommand(data []byte) (command, error) {
	var c command
	m, err := members(data, memberID, memberMethod, memberSessionID, memberParams)
	if mm, ok := m[memberID]; ok {
		if id, idErr := readID(mm.raw); idErr == nil {
			c.ID, c.HasID = id, true
		} else if err == nil {
			err = idErr
		}
	}
	if err != nil {
		return c, err
	}
	if !c.HasID {
		return c, badFrame("command has no id")
	}
	mm, ok := m[memberMethod]
	if !ok {
		return c, badFrame("command %d has no method", c.ID)
	}
	if c.Method, err = readString("method", mm.raw); err != nil {
		return c, err
	}
	if mm, ok := m[memberSessionID]; ok {
		if c.SessionID, err = readString("sessionId", mm.raw); err != nil {
			return c, err
		}
		c.HasSession, c.session = true, mm
	}
	if mm, ok := m[memberParams]; ok {
		c.HasParams, c.params = true, mm
		if string(mm.raw) != "null" {
			if mm.raw[0] != '{' {
				return c, badFrame("params of command %d is not an object", c.ID)
			}
			c.Params = mm.raw
		}
	}
	return c, nil
}

// reply is what the guard reads of a browser frame: whether it answers a
// command, which, and whether with an error.
type reply struct {
	ID        int64
	HasID     bool
	SessionID string
	// Err is the browser's error text, empty for a result.
	Err string
}

// parseReply reads a browser frame. Events (no id) and frames the guard
// cannot read are not replies: they are forwarded all the same.
func parseReply(data []byte) reply {
	var r reply
	m, err := topLevel(data, memberID, memberSessionID, memberError)
	if err != nil {
		return r
	}
	raw, ok := m[memberID]
	if !ok {
		return r
	}
	if r.ID, err = readID(raw); err != nil {
		return r
	}
	r.HasID = true
	if raw, ok := m[memberSessionID]; ok {
		r.SessionID, _ = readString("sessionId", raw)
	}
	if raw, ok := m[memberError]; ok {
		var e struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
		}
		if json.Unmarshal(raw, &e) == nil && (e.Code != 0 || e.Message != "") {
			r.Err = fmt.Sprintf("browser answered error %d: %s", e.Code, e.Message)
		} else {
			r.Err = "browser answered an error: " + state.Clip(string(raw), 256)
		}
	}
	return r
}

// cdpError is a CDP error answer from the guard itself.
type cdpError struct {
	ID        *int64       `json:"id,omitempty"`
	SessionID string       `json:"sessionId,omitempty"`
	Error     cdpErrorBody `json:"error"`
}

type cdpErrorBody struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
	Data    string `json:"data,omitempty"`
}

// errorFrame encodes an error answer to c (its id and session, when known).
func errorFrame(c command, code int, message, data string) []byte {
	e := cdpError{SessionID: c.SessionID, Error: cdpErrorBody{Code: code, Message: message, Data: data}}
	if c.HasID {
		id := c.ID
		e.ID = &id
	}
	b, err := json.Marshal(e)
	if err != nil {
		// Only strings and ints: cannot fail. Say so rather than send nothing.
		return []byte(`{"error":{"code":-32603,"message":"stopgate: encoding an error answer failed"}}`)
	}
	return b
}

// scriptMethods run script and answer with the script's exception when it
// throws.
var scriptMethods = map[string]bool{
	"Runtime.evaluate": true, "Runtime.callFunctionOn": true, "Runtime.runScript": true, "Debugger.evaluateOnCallFrame": true,
}

// refusalFrame is the guard's answer to a command it read and refused. A
// script evaluation is answered as one that threw an Error with the
// message: clients report a script's exception as it is, while some
// (Playwright) replace a protocol error of an evaluation with a guess of
// their own ("Execution context was destroyed"), which would hide why.
func refusalFrame(c command, message, data string) []byte {
	if !scriptMethods[c.Method] {
		return errorFrame(c, codeServerError, message, data)
	}
	// As Chromium describes a thrown Error, without an object id: there
	// is no object in the page to refer to.
	exception := map[string]string{"type": "object", "subtype": "error", "className": "Error", "description": "Error: " + message}
	answer := map[string]any{
		"result": map[string]any{
			"result": exception,
			"exceptionDetails": map[string]any{
				"exceptionId": 1, "text": "Uncaught", "lineNumber": 0, "columnNumber": 0, "exception": exception,
			},
		},
	}
	if c.HasID {
		answer["id"] = c.ID
	}
	if c.SessionID != "" {
		answer["sessionId"] = c.SessionID
	}
	b, err := json.Marshal(answer)
	if err != nil {
		return errorFrame(c, codeServerError, message, data)
	}
	return b
}
