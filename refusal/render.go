package refusal

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"

	"github.com/stopgate/stopgate/state"
)

// body is the refusal as JSON: the contract's shape. The run's fields are
// present whenever a run is named, so a program reads one shape whichever
// edge refused it; the row itself rides along as "run" when one decided.
type body struct {
	Error           Code              `json:"error"`
	Message         string            `json:"message"`
	RunID           string            `json:"run_id,omitempty"`
	Status          *state.Status     `json:"status,omitempty"`
	CancelVersion   *int64            `json:"cancel_version,omitempty"`
	ObservedVersion *int64            `json:"observed_version,omitempty"`
	Intent          string            `json:"intent,omitempty"`
	IntentState     state.IntentState `json:"intent_state,omitempty"`
	Recorded        state.IntentState `json:"recorded,omitempty"`
	Record          *state.Intent     `json:"intent_record,omitempty"`
	Run             *state.Run        `json:"run,omitempty"`
}

// MarshalJSON writes the refusal's body.
func (r *Refusal) MarshalJSON() ([]byte, error) {
	b := body{Error: r.Code, Message: r.Message, RunID: r.RunID, Intent: r.Intent, IntentState: r.IntentState, Recorded: r.Recorded, Record: r.Record}
	if r.RunID != "" {
		observed := r.ObservedVersion
		b.ObservedVersion = &observed
	}
	if r.Run != nil {
		row := *r.Run
		if row.Intents == nil {
			row.Intents = map[state.IntentState]int{}
		}
		b.Status, b.CancelVersion, b.Run = &row.Status, &row.CancelVersion, &row
	}
	return json.Marshal(b)
}

// UnmarshalJSON reads a refusal's body, as a client of any edge does.
func (r *Refusal) UnmarshalJSON(data []byte) error {
	var b body
	if err := json.Unmarshal(data, &b); err != nil {
		return err
	}
	*r = Refusal{Code: b.Error, Message: b.Message, RunID: b.RunID, Intent: b.Intent, IntentState: b.IntentState, Recorded: b.Recorded, Record: b.Record, Run: b.Run}
	if b.ObservedVersion != nil {
		r.ObservedVersion = *b.ObservedVersion
	}
	return nil
}

func (r *Refusal) encode() []byte {
	b, err := json.Marshal(r)
	if err != nil {
		// Every field is a string, a number or a state type; failing to
		// encode one is a bug, reported without a second try.
		b = fmt.Appendf(nil, "{\"error\":%q,\"message\":%q}", Internal, "encoding the refusal failed: "+err.Error())
	}
	return append(b, '\n')
}

// headers sets what every HTTP rendering of a refusal carries.
func (r *Refusal) headers(h http.Header) {
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set(Header, string(r.Code))
	if r.Intent != "" {
		h.Set(IntentHeader, r.Intent)
	}
	if r.Code == NoRunIdentity {
		// A 407 without it is not one a client can answer.
		h.Set("Proxy-Authenticate", `Basic realm="stopgate: user = run id, password = cancel version or run token"`)
	}
}

// WriteHTTP answers w with the refusal: its status, its headers and its
// JSON body.
func (r *Refusal) WriteHTTP(w http.ResponseWriter) {
	b := r.encode()
	r.headers(w.Header())
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(r.Status())
	_, _ = w.Write(b)
}

// Response is the refusal as an answer to req, for code that hands back an
// *http.Response instead of writing one (the egress proxy's handlers).
func (r *Refusal) Response(req *http.Request) *http.Response {
	b := r.encode()
	status := r.Status()
	resp := &http.Response{
		StatusCode:    status,
		Status:        fmt.Sprintf("%d %s", status, http.StatusText(status)),
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        http.Header{},
		Body:          io.NopCloser(bytes.NewReader(b)),
		ContentLength: int64(len(b)),
		Request:       req,
	}
	r.headers(resp.Header)
	return resp
}

// CDPMessage is the refusal as the message of a CDP error answer to the
// browser command method: led by "stopgate", the code and the message, so
// that what a client library raises (Puppeteer, Playwright, chromedp all
// show the message) names the run, its state and the reason.
func (r *Refusal) CDPMessage(method string) string {
	return fmt.Sprintf("stopgate refused %s: %s: %s", method, r.Code, r.Message)
}

// CDPData is the machine-readable part of a CDP error answer.
func (r *Refusal) CDPData() string {
	d := "refusal=" + string(r.Code)
	if r.Intent != "" {
		d += " intent=" + r.Intent
	}
	return d
}

// CloseReason is the refusal as a websocket close reason: at most the 123
// bytes the frame holds, led by "stopgate" and ending with the code.
func (r *Refusal) CloseReason() string {
	suffix := " (" + string(r.Code) + ")"
	return state.Clip("stopgate: "+r.Message, 123-len(suffix)) + suffix
}
