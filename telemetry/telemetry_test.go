package telemetry_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/telemetry"
)

// TestOneDecisionOneLineAndItsCounters: a decision is one canonical JSON
// line with every field it has, and moves its counters.
func TestOneDecisionOneLineAndItsCounters(t *testing.T) {
	var buf bytes.Buffer
	reg := prometheus.NewRegistry()
	tel := telemetry.New(telemetry.Options{Registry: reg, Logger: slog.New(slog.NewJSONHandler(&buf, nil)), Store: "file"})
	tel.Decided(context.Background(), telemetry.Decision{
		Boundary: state.BoundaryHTTP, Result: telemetry.Refused, Reason: "run_not_active", Run: "r1", Version: 1,
		Method: "POST", Host: "api.example:443", Intent: "d-1", Recorded: state.IntentCancelledBeforeDispatch,
		Store: 300 * time.Microsecond, Duration: time.Millisecond, Via: "credentials",
	})
	var line map[string]any
	if err := json.Unmarshal(bytes.TrimSpace(buf.Bytes()), &line); err != nil {
		t.Fatalf("not one JSON line: %v: %s", err, buf.Bytes())
	}
	for k, want := range map[string]any{
		"msg": "decision", "boundary": "http", "decision": "refused", "reason": "run_not_active", "run": "r1",
		"version": 1.0, "method": "POST", "host": "api.example:443", "intent": "d-1", "recorded": "CANCELLED_BEFORE_DISPATCH", "via": "credentials",
	} {
		if line[k] != want {
			t.Errorf("%s = %v, want %v: %s", k, line[k], want, buf.Bytes())
		}
	}
	for _, k := range []string{"store_latency", "duration"} {
		if _, ok := line[k]; !ok {
			t.Errorf("line lacks %s: %s", k, buf.Bytes())
		}
	}
	if n := counter(t, reg, "stopgate_refusals_total"); n != 1 {
		t.Errorf("refusals counted %v, want 1", n)
	}
	if n := counter(t, reg, "stopgate_decisions_total"); n != 1 {
		t.Errorf("decisions counted %v, want 1", n)
	}
}

// counter is the value of the one series of a counter.
func counter(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() == name && len(f.GetMetric()) == 1 {
			return f.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("no single series %s", name)
	return 0
}
