package llmusage_test

import (
	"strings"
	"testing"

	"github.com/stopgate/stopgate/llmusage"
	"github.com/stopgate/stopgate/state"
)

const (
	openAIChat = `{"id":"chatcmpl-1","object":"chat.completion","model":"gpt-4o-2024-08-06",` +
		`"choices":[{"index":0,"message":{"role":"assistant","content":"say \"usage\": {\"prompt_tokens\": 999} {[}]"},"finish_reason":"stop"}],` +
		`"usage":{"prompt_tokens":12,"completion_tokens":34,"total_tokens":46,"prompt_tokens_details":{"cached_tokens":0}}}`
	openAIResponses = `{"id":"resp_1","object":"response","model":"gpt-4.1","output":[{"type":"message","content":[{"type":"output_text","text":"hi"}]}],` +
		`"usage":{"input_tokens":20,"input_tokens_details":{"cached_tokens":0},"output_tokens":5,"total_tokens":25}}`
	openAIEmbeddings = `{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,-0.2,3e-5]}],"model":"text-embedding-3-small","usage":{"prompt_tokens":8,"total_tokens":8}}`
	anthropicMessage = `{"id":"msg_1","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[{"type":"text","text":"{\"usage\":1}"}],` +
		`"stop_reason":"end_turn","usage":{"input_tokens":25,"cache_creation_input_tokens":3,"cache_read_input_tokens":2,"output_tokens":17}}`
)

func openAIStream(withUsage bool) string {
	var b strings.Builder
	for i, piece := range []string{"Hel", "lo"} {
		b.WriteString(`data: {"id":"c","object":"chat.completion.chunk","model":"gpt-4o-mini","choices":[{"index":0,"delta":{"content":"` + piece + `"}}],"usage":null}` + "\n\n")
		_ = i
	}
	if withUsage {
		b.WriteString(`data: {"id":"c","object":"chat.completion.chunk","model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}` + "\r\n\r\n")
	}
	b.WriteString("data: [DONE]\n\n")
	return b.String()
}

const anthropicStream = "event: message_start\n" +
	`data: {"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","model":"claude-haiku-4-5","content":[],"usage":{"input_tokens":40,"output_tokens":1}}}` + "\n\n" +
	"event: content_block_delta\n" +
	`data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"{\"usage\":{\"output_tokens\":500}}"}}` + "\n\n" +
	"event: message_delta\n" +
	`data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":15}}` + "\n\n" +
	"event: message_stop\n" + `data: {"type":"message_stop"}` + "\n\n"

const responsesStream = "event: response.created\n" +
	`data: {"type":"response.created","response":{"id":"r","model":"gpt-4.1","usage":null}}` + "\n\n" +
	"event: response.output_text.delta\n" + `data: {"type":"response.output_text.delta","delta":"hi"}` + "\n\n" +
	"event: response.completed\n" +
	`data: {"type":"response.completed","response":{"id":"r","model":"gpt-4.1","usage":{"input_tokens":7,"output_tokens":3,"total_tokens":10}}}` + "\n\n"

// TestMeterReadsTheUsageTheAPIsReport: each API's answer, plain and
// streamed, written whole, in pieces of every size and a byte at a time,
// gives the usage it reports; what looks like usage inside a string is
// text, not usage.
func TestMeterReadsTheUsageTheAPIsReport(t *testing.T) {
	for _, tc := range []struct {
		name, contentType string
		api               llmusage.API
		body              string
		want              state.LLMUsage
	}{
		{"openai chat", "application/json", llmusage.OpenAI, openAIChat, state.LLMUsage{Model: "gpt-4o-2024-08-06", Known: true, InputTokens: 12, OutputTokens: 34}},
		{"openai responses", "application/json; charset=utf-8", llmusage.OpenAI, openAIResponses, state.LLMUsage{Model: "gpt-4.1", Known: true, InputTokens: 20, OutputTokens: 5}},
		{"openai embeddings", "application/json", llmusage.OpenAI, openAIEmbeddings, state.LLMUsage{Model: "text-embedding-3-small", Known: true, InputTokens: 8}},
		{"openai chat stream with usage", "text/event-stream", llmusage.OpenAI, openAIStream(true), state.LLMUsage{Model: "gpt-4o-mini", Known: true, InputTokens: 9, OutputTokens: 2}},
		{"openai chat stream without usage", "text/event-stream", llmusage.OpenAI, openAIStream(false), state.LLMUsage{Model: "gpt-4o-mini"}},
		{"openai responses stream", "text/event-stream", llmusage.OpenAI, responsesStream, state.LLMUsage{Model: "gpt-4.1", Known: true, InputTokens: 7, OutputTokens: 3}},
		{"anthropic message", "application/json", llmusage.Anthropic, anthropicMessage, state.LLMUsage{Model: "claude-sonnet-4-5", Known: true, InputTokens: 30, OutputTokens: 17}},
		{"anthropic stream", "text/event-stream; charset=utf-8", llmusage.Anthropic, anthropicStream, state.LLMUsage{Model: "claude-haiku-4-5", Known: true, InputTokens: 40, OutputTokens: 15}},
		{"anthropic stream cut before message_delta", "text/event-stream", llmusage.Anthropic, anthropicStream[:strings.Index(anthropicStream, "event: message_delta")], state.LLMUsage{Model: "claude-haiku-4-5"}},
		{"openai stream cut before its usage", "text/event-stream", llmusage.OpenAI, openAIStream(true)[:200], state.LLMUsage{Model: "gpt-4o-mini"}},
		{"plain body cut mid-usage", "application/json", llmusage.OpenAI, openAIChat[:len(openAIChat)-20], state.LLMUsage{Model: "gpt-4o-2024-08-06"}},
		{"not json", "text/html", llmusage.OpenAI, "<html>usage</html>", state.LLMUsage{}},
		{"error body", "application/json", llmusage.OpenAI, `{"error":{"message":"rate limited","type":"requests"}}`, state.LLMUsage{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, size := range []int{len(tc.body), 1, 2, 3, 7, 64} {
				m := llmusage.New(tc.api, tc.contentType, "")
				for i := 0; i < len(tc.body); i += size {
					_, _ = m.Write([]byte(tc.body[i:min(i+size, len(tc.body))]))
				}
				if got := m.Usage(); got != tc.want {
					t.Fatalf("in pieces of %d: %+v, want %+v", size, got, tc.want)
				}
			}
		})
	}
}

// TestACompressedAnswerIsUnknown: the proxy asks for answers it can read,
// but one that comes compressed all the same is unknown, never zero.
func TestACompressedAnswerIsUnknown(t *testing.T) {
	m := llmusage.New(llmusage.OpenAI, "application/json", "gzip")
	_, _ = m.Write([]byte(openAIChat))
	if u := m.Usage(); u.Known {
		t.Fatalf("a gzip body read as %+v", u)
	}
}

// TestMeterMemoryIsBoundedWhateverTheBody: a long answer, and a usage
// object far larger than any API sends, leave nothing held but the bound.
func TestMeterMemoryIsBoundedWhateverTheBody(t *testing.T) {
	m := llmusage.New(llmusage.OpenAI, "application/json", "")
	_, _ = m.Write([]byte(`{"model":"m","choices":[{"message":{"content":"`))
	chunk := []byte(strings.Repeat("x", 1<<16))
	for range 160 { // 10 MiB of content
		_, _ = m.Write(chunk)
	}
	_, _ = m.Write([]byte(`"}}],"usage":{"prompt_tokens":1,"completion_tokens":2,"pad":"` + strings.Repeat("p", 10000) + `"}}`))
	if u := m.Usage(); u.Known || u.Model != "m" {
		t.Fatalf("a usage object past the bound was read: %+v", u)
	}
	deep := llmusage.New(llmusage.OpenAI, "application/json", "")
	_, _ = deep.Write([]byte(strings.Repeat("[", 100000)))
	if u := deep.Usage(); u.Known {
		t.Fatalf("%+v", u)
	}
}

func TestCleanModel(t *testing.T) {
	for in, want := range map[string]string{"gpt-4o": "gpt-4o", "llama3:8b": "llama3:8b", "a b\n": "a_b_", strings.Repeat("m", 300): strings.Repeat("m", 128)} {
		if got := llmusage.CleanModel(in); got != want {
			t.Errorf("CleanModel(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestPricesSpendByExactNameThenLongestPattern(t *testing.T) {
	in, err := llmusage.ParsePerMillion("2.50")
	if err != nil || in != 2_500_000 {
		t.Fatalf("2.50 USD/Mtok = %d pico-USD/token, %v", in, err)
	}
	out, _ := llmusage.ParsePerMillion("10")
	cheap, _ := llmusage.ParsePerMillion("0.000001")
	p, err := llmusage.NewPrices(map[string]llmusage.Price{
		"gpt-4o": {Input: in, Output: out}, "gpt-4o*": {Input: 1, Output: 1}, "gpt-4o-mini*": {Input: cheap, Output: cheap},
	})
	if err != nil {
		t.Fatal(err)
	}
	// 1000 input tokens at 2.50/M = 0.0025 USD = 2 500 000 nano; 100
	// output at 10/M = 0.001 USD.
	if n, ok := p.Spend("gpt-4o", 1000, 100); !ok || n != 3_500_000 {
		t.Fatalf("gpt-4o: %d %v", n, ok)
	}
	if n, ok := p.Spend("gpt-4o-2024-08-06", 1000, 0); !ok || n != 1 {
		t.Fatalf("gpt-4o* (1 pico a token, rounded up to a nano): %d %v", n, ok)
	}
	if _, ok := p.Spend("gpt-4o-mini-2024", 1, 1); !ok {
		t.Fatal("the longest pattern prices gpt-4o-mini-2024")
	}
	if _, ok := p.Spend("claude", 1, 1); ok {
		t.Fatal("a model not listed was priced")
	}
	for _, bad := range []string{"-1", "1.0000001", "x", ""} {
		if _, err := llmusage.ParsePerMillion(bad); err == nil {
			t.Errorf("price %q was taken", bad)
		}
	}
	if _, err := llmusage.NewPrices(map[string]llmusage.Price{"a*b": {}}); err == nil {
		t.Error("a * inside a pattern was taken")
	}
}

func TestEndpoints(t *testing.T) {
	for _, tc := range []struct {
		api          llmusage.API
		method, path string
		want         bool
	}{
		{llmusage.OpenAI, "POST", "/v1/chat/completions", true},
		{llmusage.OpenAI, "POST", "/openai/deployments/x/chat/completions", true},
		{llmusage.OpenAI, "POST", "/v1/responses", true},
		{llmusage.OpenAI, "GET", "/v1/models", false},
		{llmusage.OpenAI, "POST", "/v1/files", false},
		{llmusage.Anthropic, "POST", "/v1/messages", true},
		{llmusage.Anthropic, "POST", "/v1/messages/count_tokens", false},
	} {
		if got := llmusage.Endpoint(tc.api, tc.method, tc.path); got != tc.want {
			t.Errorf("Endpoint(%s, %s %s) = %v", tc.api, tc.method, tc.path, got)
		}
	}
	if !llmusage.LooksLikeLLM("POST", "/v1/chat/completions") || llmusage.LooksLikeLLM("POST", "/api/messages") || llmusage.LooksLikeLLM("GET", "/v1/messages") {
		t.Error("LooksLikeLLM")
	}
}

// FuzzMeterNeverPanics: whatever an upstream sends, the meter reads it
// without failing, in bounded memory.
func FuzzMeterNeverPanics(f *testing.F) {
	for _, seed := range []string{openAIChat, openAIStream(true), anthropicStream, responsesStream, `{"usage":{"prompt_tokens":-5}}`, "data: {\"usage\"\n\n"} {
		f.Add(seed, true)
		f.Add(seed, false)
	}
	f.Fuzz(func(t *testing.T, body string, sse bool) {
		ct := "application/json"
		if sse {
			ct = "text/event-stream"
		}
		for _, api := range llmusage.APIs {
			m := llmusage.New(api, ct, "")
			_, _ = m.Write([]byte(body))
			if u := m.Usage(); u.InputTokens < 0 || u.OutputTokens < 0 || state.ValidateModel(u.Model) != nil {
				t.Fatalf("%+v", u)
			}
		}
	})
}
