// Package llmusage reads what an LLM API's answer says it used — the
// model, input and output tokens — from the answer's body as it streams
// past, in bounded memory, and prices it from an operator's table. It
// reads the OpenAI-compatible shapes (chat/completions, completions,
// embeddings and responses: the usage object, and a stream's chunk or
// response.completed event that carries it) and Anthropic's messages (the
// usage of the message, and of its stream's message_start and
// message_delta events).
//
// It never buffers a body, never changes one, and never guesses: an
// answer whose usage it did not read is unknown (Usage.Known false), which
// a budget counts as such, never as zero tokens.
package llmusage

import (
	"encoding/json"
	"mime"
	"strings"

	"github.com/stopgate/stopgate/state"
)

// API is the shape of a provider's answers.
type API string

const (
	// OpenAI: OpenAI's API and the many that copy it (vLLM, Ollama's
	// /v1, Together, Groq, OpenRouter, ...).
	OpenAI API = "openai"
	// Anthropic: Anthropic's messages API.
	Anthropic API = "anthropic"
)

// APIs lists the shapes the package reads.
var APIs = []API{OpenAI, Anthropic}

// captureLimit bounds what is kept of one value (a usage object, a model
// name): far more than any API sends.
const captureLimit = 4096

// The values a meter keeps of each JSON document (a body, or one event of
// a stream), by path: wantModel..wantResponseUsage index them.
var wants = [][]string{
	{"model"}, {"usage"}, {"message", "model"}, {"message", "usage"}, {"response", "model"}, {"response", "usage"}, {"type"},
}

const (
	wantModel = iota
	wantUsage
	wantMessageModel
	wantMessageUsage
	wantResponseModel
	wantResponseUsage
	wantType
)

// Meter reads one answer's usage from its body, written to it as it
// passes (Write never fails and never holds the bytes).
type Meter struct {
	api API
	sse bool
	// unreadable: the answer is compressed or of a type the APIs do not
	// send: its usage cannot be read.
	unreadable bool

	doc *scanner
	// In a stream: the line's start (up to "data:"), whether the line is
	// data, and the event's document.
	line     []byte
	lineData bool
	skipLine bool
	crSeen   bool
	event    *scanner
	eventLen int

	model   string
	in, out int64
	// known: a usage was read; for an Anthropic stream, its message_start
	// gave the input (startSeen) and a message_delta the output.
	known     bool
	startSeen bool
}

// New is a meter for an answer of api whose headers say contentType and
// contentEncoding.
func New(api API, contentType, contentEncoding string) *Meter {
	m := &Meter{api: api}
	mt, _, err := mime.ParseMediaType(contentType)
	switch {
	case contentEncoding != "" && !strings.EqualFold(contentEncoding, "identity"):
		m.unreadable = true
	case err == nil && mt == "text/event-stream":
		m.sse = true
	case err == nil && (mt == "application/json" || strings.HasSuffix(mt, "+json")):
		m.doc = newScanner(wants, captureLimit)
	default:
		m.unreadable = true
	}
	return m
}

// Write reads p, a piece of the answer's body.
func (m *Meter) Write(p []byte) (int, error) {
	switch {
	case m.unreadable:
	case m.sse:
		m.stream(p)
	default:
		m.doc.write(p)
	}
	return len(p), nil
}

// stream reads a piece of an event stream: the data lines of each event
// make one JSON document, read when the event ends (a blank line).
func (m *Meter) stream(p []byte) {
	for _, c := range p {
		if m.crSeen {
			m.crSeen = false
			if c == '\n' {
				continue // the \n of a \r\n, already ended the line
			}
		}
		if c == '\r' || c == '\n' {
			m.crSeen = c == '\r'
			m.endLine()
			continue
		}
		switch {
		case m.skipLine:
		case m.lineData:
			// The space after "data:" is JSON's whitespace too.
			m.event.byte(c)
			m.eventLen++
		default:
			m.line = append(m.line, c)
			if len(m.line) == len("data:") {
				if string(m.line) == "data:" {
					m.lineData, m.line = true, m.line[:0]
					if m.event == nil {
						m.event = newScanner(wants, captureLimit)
					} else if m.eventLen > 0 {
						// Lines of one event join with a newline.
						m.event.byte('\n')
					}
				} else {
					m.skipLine = true
				}
			}
		}
	}
}

func (m *Meter) endLine() {
	blank := !m.lineData && !m.skipLine && len(m.line) == 0
	m.line, m.lineData, m.skipLine = m.line[:0], false, false
	if blank && m.event != nil {
		m.absorb(m.event)
		m.event, m.eventLen = nil, 0
	}
}

// usageJSON is every usage object's fields the APIs name.
type usageJSON struct {
	PromptTokens     *int64 `json:"prompt_tokens"`
	CompletionTokens *int64 `json:"completion_tokens"`
	InputTokens      *int64 `json:"input_tokens"`
	OutputTokens     *int64 `json:"output_tokens"`
	CacheCreation    *int64 `json:"cache_creation_input_tokens"`
	CacheRead        *int64 `json:"cache_read_input_tokens"`
}

func parseUsage(raw []byte) (usageJSON, bool) {
	var u usageJSON
	if len(raw) == 0 || raw[0] != '{' || json.Unmarshal(raw, &u) != nil {
		return u, false
	}
	return u, true
}

func n(p *int64) int64 {
	if p == nil || *p < 0 {
		return 0
	}
	return *p
}

// absorb takes what one document (a body, an event) says.
func (m *Meter) absorb(s *scanner) {
	for _, i := range []int{wantModel, wantMessageModel, wantResponseModel} {
		var model string
		if raw := s.value(i); raw != nil && json.Unmarshal(raw, &model) == nil && model != "" {
			m.model = model
		}
	}
	var typ string
	if raw := s.value(wantType); raw != nil {
		_ = json.Unmarshal(raw, &typ)
	}
	switch m.api {
	case OpenAI:
		for _, i := range []int{wantUsage, wantResponseUsage} {
			u, ok := parseUsage(s.value(i))
			if !ok {
				continue
			}
			in, out := u.PromptTokens, u.CompletionTokens
			if in == nil {
				in = u.InputTokens
			}
			if out == nil {
				out = u.OutputTokens
			}
			if in == nil && out == nil {
				continue
			}
			m.in, m.out, m.known = n(in), n(out), true
		}
	case Anthropic:
		// A message (a body, or a stream's message_start) gives its
		// input and the output so far; a stream's message_delta gives
		// the output as it stands at the end (cumulative).
		if u, ok := parseUsage(s.value(wantMessageUsage)); ok {
			m.in = n(u.InputTokens) + n(u.CacheCreation) + n(u.CacheRead)
			m.out, m.startSeen = n(u.OutputTokens), true
		}
		if u, ok := parseUsage(s.value(wantUsage)); ok {
			switch {
			case typ == "message_delta":
				if u.OutputTokens != nil {
					m.out = n(u.OutputTokens)
					m.known = m.startSeen
				}
				if in := n(u.InputTokens) + n(u.CacheCreation) + n(u.CacheRead); in > 0 {
					m.in = in
				}
			case typ == "message" || typ == "":
				m.in = n(u.InputTokens) + n(u.CacheCreation) + n(u.CacheRead)
				m.out, m.known = n(u.OutputTokens), u.InputTokens != nil || u.OutputTokens != nil
			}
		}
	}
}

// Usage is what the answer said it used, once its body is over (ended or
// cut: a usage read before a cut stands, one that had not come is
// unknown). The model is cleaned to a name a counter can carry.
func (m *Meter) Usage() state.LLMUsage {
	if m.doc != nil {
		m.absorb(m.doc)
		m.doc = nil
	}
	if m.event != nil {
		// A stream that ends without a blank line after its last event.
		m.absorb(m.event)
		m.event = nil
	}
	u := state.LLMUsage{Model: CleanModel(m.model)}
	if m.known && !m.unreadable {
		u.Known, u.InputTokens, u.OutputTokens = true, m.in, m.out
	}
	return u
}

// CleanModel makes a model's name one a counter can carry: printable
// ASCII (anything else becomes _), at most 128 bytes.
func CleanModel(model string) string {
	const limit = 128
	b := []byte(model)
	if len(b) > limit {
		b = b[:limit]
	}
	for i, c := range b {
		if c < 0x21 || c > 0x7e {
			b[i] = '_'
		}
	}
	out := string(b)
	if state.ValidateModel(out) != nil {
		return ""
	}
	return out
}
