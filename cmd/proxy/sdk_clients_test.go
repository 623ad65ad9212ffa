package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/state"
)

// llmClients are the LLM SDKs scripts/test-deps installs (npm ci).
const llmClients = "testdata/llm-clients"

// TestLLMSDKsShowTheRefusalAndDoNotRetryIt: the official OpenAI and
// Anthropic SDKs for Node, calling through the proxy for a cancelled run,
// raise an error that says what stopgate said (the run, its state, what
// was recorded) with its code, and send the request once: X-Should-Retry:
// false stops their retries of a 409, so one refused call is one refused
// intent in the audit log, not three.
func TestLLMSDKsShowTheRefusalAndDoNotRetryIt(t *testing.T) {
	testkit.NeedTools(t, "node")
	if _, err := os.Stat(filepath.Join(llmClients, "node_modules", "openai")); err != nil {
		t.Fatalf("the LLM SDKs are not installed (make test-deps): %v", err)
	}
	up := testkit.NewUpstream(t, false, nil)
	s := startServe(t, "--data-dir", t.TempDir())
	s.must(t, 0, "admit", "sdk-run")
	s.must(t, 0, "cancel", "sdk-run", "--reason", "operator stop")
	for _, tc := range []struct{ sdk, base string }{
		{"openai", up.URL + "/v1"},
		{"anthropic", up.URL},
	} {
		t.Run(tc.sdk, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, "node", "sdk.mjs", tc.sdk, tc.base, s.proxyAddr(), "sdk-run")
			cmd.Dir = llmClients
			var out, errOut bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &errOut
			if err := cmd.Run(); err != nil {
				t.Fatalf("node sdk.mjs %s: %v\n%s", tc.sdk, err, errOut.String())
			}
			t.Logf("%s raised: %s", tc.sdk, strings.TrimSpace(out.String()))
			var got struct {
				OK            bool
				Attempts      int
				Status        int
				Message, Name string
				Code, Type    *string
				Refusal       *string
			}
			if err := json.Unmarshal(out.Bytes(), &got); err != nil {
				t.Fatalf("%v: %s", err, out.String())
			}
			if got.OK || got.Status != 409 || got.Attempts != 1 {
				t.Fatalf("want one attempt refused with 409, got %+v", got)
			}
			if !strings.Contains(got.Message, "409 run sdk-run is CANCELL") || !strings.Contains(got.Message, "CANCELLED_BEFORE_DISPATCH") {
				t.Errorf("the SDK's message does not say what stopgate said: %q", got.Message)
			}
			if got.Refusal == nil || *got.Refusal != "run_not_active" {
				t.Errorf("X-Stopgate-Refusal: %v", got.Refusal)
			}
			if tc.sdk == "openai" && (got.Code == nil || *got.Code != "run_not_active" || got.Type == nil || *got.Type != "stopgate_refusal") {
				t.Errorf("openai: err.code %v, err.type %v; want run_not_active, stopgate_refusal", got.Code, got.Type)
			}
		})
	}
	if n := up.Hits.Load(); n != 0 {
		t.Errorf("%d requests reached the provider", n)
	}
	var audit struct {
		Events []state.Event `json:"events"`
	}
	if err := json.Unmarshal([]byte(s.must(t, 0, "audit", "sdk-run", "--json")), &audit); err != nil {
		t.Fatal(err)
	}
	refused := 0
	for _, e := range audit.Events {
		if e.Kind == state.EventIntentRefused {
			refused++
		}
	}
	if refused != 2 {
		t.Errorf("%d refusals in the audit log for two SDK calls, want 2 (one each: no retry)", refused)
	}
}
