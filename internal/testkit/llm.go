package testkit

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
)

// LLM is a fake LLM provider on loopback that answers as the real APIs'
// shapes do — OpenAI-compatible chat/completions (plain, and streamed with
// the usage in its last chunk when stream_options.include_usage asks) or
// Anthropic's messages (plain, and streamed: message_start, deltas,
// message_delta with the usage, message_stop) — and keeps the sum of the
// usage it reported, by model: what stopgate must count, read from the
// provider's own side.
type LLM struct {
	*Upstream
	mu       sync.Mutex
	reported map[string][2]int64
	encoding []string
}

// LLMShape names the API a fake provider answers as.
type LLMShape string

const (
	ShapeOpenAI    LLMShape = "openai"
	ShapeAnthropic LLMShape = "anthropic"
)

// HeaderCut, on a request, makes the fake provider cut its streamed
// answer before the usage: a few chunks, then the connection closed.
const HeaderCut = "X-Test-Cut"

// NewLLM starts a fake provider of shape (TLS when tlsOn). Each answer
// reports input tokens of 10 + the request body's length mod 17, and
// output tokens of 3 for each word of the answer it streams (five words).
func NewLLM(t testing.TB, shape LLMShape, tlsOn bool) *LLM {
	l := &LLM{reported: map[string][2]int64{}}
	l.Upstream = NewUpstream(t, tlsOn, func(w http.ResponseWriter, r *http.Request) {
		l.mu.Lock()
		l.encoding = append(l.encoding, r.Header.Get("Accept-Encoding"))
		l.mu.Unlock()
		var req struct {
			Model         string `json:"model"`
			Stream        bool   `json:"stream"`
			StreamOptions struct {
				IncludeUsage bool `json:"include_usage"`
			} `json:"stream_options"`
		}
		body, _ := io.ReadAll(r.Body)
		if err := json.Unmarshal(body, &req); err != nil || req.Model == "" {
			w.WriteHeader(http.StatusBadRequest)
			fmt.Fprint(w, `{"error":{"message":"want a JSON body with a model"}}`)
			return
		}
		in, out := int64(10+len(body)%17), int64(15)
		cut := r.Header.Get(HeaderCut) != ""
		words := []string{"the ", "run ", "stops ", "itself ", "here"}
		switch {
		case shape == ShapeOpenAI && !req.Stream:
			l.report(req.Model, in, out)
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"id":"chatcmpl-1","object":"chat.completion","model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":%q},"finish_reason":"stop"}],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}`,
				req.Model, strings.Join(words, ""), in, out, in+out)
		case shape == ShapeOpenAI:
			w.Header().Set("Content-Type", "text/event-stream")
			for i, word := range words {
				if cut && i == 2 {
					l.cut(w)
					return
				}
				fmt.Fprintf(w, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":%q,\"choices\":[{\"index\":0,\"delta\":{\"content\":%q}}],\"usage\":null}\n\n", req.Model, word)
				flush(w)
			}
			if req.StreamOptions.IncludeUsage {
				l.report(req.Model, in, out)
				fmt.Fprintf(w, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":%q,\"choices\":[],\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"total_tokens\":%d}}\n\n", req.Model, in, out, in+out)
			}
			fmt.Fprint(w, "data: [DONE]\n\n")
		case !req.Stream:
			l.report(req.Model, in, out)
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"id":"msg_1","type":"message","role":"assistant","model":%q,"content":[{"type":"text","text":%q}],"stop_reason":"end_turn","usage":{"input_tokens":%d,"output_tokens":%d}}`,
				req.Model, strings.Join(words, ""), in, out)
		default:
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprintf(w, "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":%q,\"content\":[],\"usage\":{\"input_tokens\":%d,\"output_tokens\":1}}}\n\n", req.Model, in)
			for i, word := range words {
				if cut && i == 2 {
					l.cut(w)
					return
				}
				fmt.Fprintf(w, "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":%q}}\n\n", word)
				flush(w)
			}
			l.report(req.Model, in, out)
			fmt.Fprintf(w, "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":%d}}\n\n", out)
			fmt.Fprint(w, "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n")
		}
	})
	return l
}

func flush(w http.ResponseWriter) {
	if f, ok := w.(http.Flusher); ok {
		f.Flush()
	}
}

// cut ends the answer mid-stream: the connection closes without the
// stream's end.
func (l *LLM) cut(w http.ResponseWriter) {
	flush(w)
	if hj, ok := w.(http.Hijacker); ok {
		if conn, _, err := hj.Hijack(); err == nil {
			_ = conn.Close()
			return
		}
	}
	panic(http.ErrAbortHandler)
}

func (l *LLM) report(model string, in, out int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.reported[model]
	l.reported[model] = [2]int64{r[0] + in, r[1] + out}
}

// Reported is the usage the provider reported, by model: input, output.
func (l *LLM) Reported() map[string][2]int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[string][2]int64, len(l.reported))
	for k, v := range l.reported {
		out[k] = v
	}
	return out
}

// AcceptEncodings are the Accept-Encoding headers of the requests, in order.
func (l *LLM) AcceptEncodings() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.encoding...)
}
