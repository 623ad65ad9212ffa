package proxy_test

import (
	"context"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
)

// TestEffectsEntryCoversTheNameWithATrailingDot: a policy's
// `effects: {api.openai.com: none}`, read by the policy file's parser and
// applied by the proxy, covers a request the agent sends to
// api.openai.com. (the same name, fully qualified) and to API.OpenAI.com:
// cut at the cancel and recorded NOT_APPLIED (source policy), as the
// entry says, never drained as a write whose outcome is UNKNOWN.
func TestEffectsEntryCoversTheNameWithATrailingDot(t *testing.T) {
	for _, name := range []string{"api.openai.com.", "API.OpenAI.com"} {
		t.Run(name, func(t *testing.T) {
			up, arrived := held(t)
			_, port, _ := net.SplitHostPort(up.Listener.Addr().String())
			loopback := func(ctx context.Context, host string) ([]netip.Addr, error) {
				if strings.EqualFold(strings.TrimSuffix(host, "."), "api.openai.com") {
					return []netip.Addr{netip.MustParseAddr("127.0.0.1")}, nil
				}
				return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
			}
			e := newEnv(t, envOptions{resolve: loopback, policyYAML: "effects:\n  api.openai.com: none\n"})
			e.admit("llm")
			done := make(chan *http.Response, 1)
			go func() {
				req, _ := http.NewRequest("POST", "http://"+net.JoinHostPort(name, port)+"/v1/responses", strings.NewReader(`{}`))
				resp, err := e.client("llm", 1).Do(req)
				if err != nil {
					resp = nil
				}
				done <- resp
			}()
			select {
			case <-arrived:
			case <-time.After(5 * time.Second):
				t.Fatal("the request never reached the upstream")
			}
			// A drain long enough that only the effects entry can cut the
			// request before the test's bound.
			e.cancel("llm", time.Minute)
			var resp *http.Response
			select {
			case resp = <-done:
			case <-time.After(5 * time.Second):
				t.Fatal("the request in flight was not cut at the cancel: the effects entry did not cover its host")
			}
			if resp == nil || resp.StatusCode != http.StatusConflict {
				t.Fatalf("the cut request answered %v, want 409 run_not_active", resp)
			}
			key := resp.Header.Get(refusal.IntentHeader)
			resp.Body.Close()
			if in := e.intent("llm", key); in.State != state.IntentNotApplied || in.Source != state.SourcePolicy {
				t.Fatalf("the cut request is recorded %s (source %q), want NOT_APPLIED (policy): %+v", in.State, in.Source, in)
			}
		})
	}
}
