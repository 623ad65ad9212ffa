package telemetry_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/stopgate/stopgate/internal/testkit"
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

// TestAnEffectsOrdinaryPathIsDebugTheRestInfo: at info, an effect admitted
// and answered writes no line; one that ended unanswered (UNKNOWN) or was
// cut does. At debug every decision has its line. All of them count.
func TestAnEffectsOrdinaryPathIsDebugTheRestInfo(t *testing.T) {
	for _, tc := range []struct {
		level slog.Level
		lines []string
	}{
		{slog.LevelInfo, []string{"finished:UNKNOWN", "cut:RESPONDED"}},
		{slog.LevelDebug, []string{"admitted:IN_FLIGHT", "finished:RESPONDED", "finished:UNKNOWN", "cut:RESPONDED"}},
	} {
		t.Run(tc.level.String(), func(t *testing.T) {
			var buf bytes.Buffer
			reg := prometheus.NewRegistry()
			log := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: tc.level}))
			tel := telemetry.New(telemetry.Options{Registry: reg, Logger: log, Store: "file"})
			d := telemetry.Decision{Boundary: state.BoundaryHTTP, Run: "r1", Method: "POST", Host: "api.example:443", Intent: "d-1"}
			d.Result, d.Recorded = telemetry.Admitted, state.IntentInFlight
			tel.Decided(context.Background(), d)
			d.Result, d.Recorded, d.StatusCode = telemetry.Finished, state.IntentResponded, 200
			tel.Decided(context.Background(), d)
			d.Result, d.Recorded, d.StatusCode = telemetry.Finished, state.IntentUnknown, 0
			tel.Decided(context.Background(), d)
			d.Result, d.Recorded, d.Reason = telemetry.Cut, state.IntentResponded, "run_cancelled"
			tel.Decided(context.Background(), d)
			var got []string
			for _, raw := range bytes.Split(bytes.TrimSpace(buf.Bytes()), []byte("\n")) {
				var line map[string]any
				if err := json.Unmarshal(raw, &line); err != nil {
					t.Fatalf("not a JSON line: %v: %s", err, raw)
				}
				got = append(got, fmt.Sprintf("%s:%s", line["decision"], line["recorded"]))
				if line["host"] != "api.example:443" || line["run"] != "r1" {
					t.Errorf("line lacks the effect's run or host: %s", raw)
				}
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.lines) {
				t.Errorf("lines %v, want %v", got, tc.lines)
			}
			if n := series(t, reg, "stopgate_decisions_total"); n != 3 {
				t.Errorf("%d series of decisions, want one for each result", n)
			}
		})
	}
}

// series is how many series a metric has.
func series(t *testing.T, reg *prometheus.Registry, name string) int {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() == name {
			return len(f.GetMetric())
		}
	}
	return 0
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

// TestTheStoreIsMeasuredByOperation: every call through the measure is
// timed under its operation, and only a store that failed counts as an
// error — a refusal or a missing run is an answer.
func TestTheStoreIsMeasuredByOperation(t *testing.T) {
	reg := prometheus.NewRegistry()
	tel := telemetry.New(telemetry.Options{Registry: reg, Store: "file"})
	raw := testkit.FileStore(t)
	s := tel.Store(raw)
	ctx := context.Background()
	if _, err := s.Admit(ctx, state.AdmitRequest{RunID: "m", Actor: "t"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Guard(ctx, state.GuardRequest{RunID: "m", Key: "k", ExplicitKey: true, Boundary: state.BoundaryHTTP, LeaseTTL: time.Minute}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(ctx, "nobody"); err == nil {
		t.Fatal("a missing run was found")
	}
	if err := raw.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Guard(ctx, state.GuardRequest{RunID: "m", Key: "k2", ExplicitKey: true, Boundary: state.BoundaryHTTP, LeaseTTL: time.Minute}); err == nil {
		t.Fatal("a guard on a closed store succeeded")
	}
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	calls, errs := map[string]uint64{}, map[string]float64{}
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			switch f.GetName() {
			case "stopgate_store_seconds":
				calls[labels["op"]] = m.GetHistogram().GetSampleCount()
			case "stopgate_store_errors_total":
				errs[labels["op"]] = m.GetCounter().GetValue()
			}
		}
	}
	if calls["admit"] != 1 || calls["guard"] != 2 || calls["get"] != 1 {
		t.Errorf("calls timed %v, want admit 1, guard 2, get 1", calls)
	}
	if errs["guard"] != 1 || errs["get"] != 0 || errs["admit"] != 0 {
		t.Errorf("errors counted %v, want the one guard on the closed store only", errs)
	}
}
