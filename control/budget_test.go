package control_test

import (
	"log/slog"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/policy"
	"github.com/stopgate/stopgate/state"
)

// TestAdmitTakesABudgetOnTopOfThePolicysAndRefusesABadOne: POST /v1/runs
// with a budget and labels admits the run with the policy's budget for
// those labels, the given limits on top, the server's drain when neither
// gives one; a budget that is not one is a 400 naming the field, and
// nothing is admitted.
func TestAdmitTakesABudgetOnTopOfThePolicysAndRefusesABadOne(t *testing.T) {
	pol, err := policy.Parse([]byte(`budgets:
  default: {max_wall_time: 1h}
  rules:
    - name: research
      labels: {team: research}
      budget: {max_tokens: 1000}
`))
	if err != nil {
		t.Fatal(err)
	}
	store := testkit.FileStore(t)
	h, err := control.New(control.Options{Store: store, Token: testToken, DrainTimeout: 20 * time.Second, Logger: slog.New(slog.DiscardHandler),
		Budgets: func(run string, labels map[string]string, given state.Budget) state.Budget {
			return pol.Budgets.Admitted(run, labels, given, 20*time.Second)
		}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	run(t, srv, []spec{
		{name: "a budget and labels", method: "POST", path: "/v1/runs",
			body:   `{"run_id":"b1","budget":{"max_effects":5,"max_spend_usd":"2.5"},"labels":{"team":"research"}}`,
			status: 201, check: func(t *testing.T, r reply) {
				var row state.Run
				r.json(t, &row)
				want := state.Budget{MaxEffects: 5, MaxWallTime: time.Hour, MaxTokens: 1000, MaxSpend: 2_500_000_000, DrainTimeout: 20 * time.Second}
				if row.Budget != want {
					t.Fatalf("budget %+v, want %+v", row.Budget, want)
				}
			}},
		{name: "the policy's alone", method: "POST", path: "/v1/runs", body: `{"run_id":"b2"}`, status: 201, check: func(t *testing.T, r reply) {
			var row state.Run
			r.json(t, &row)
			if row.Budget != (state.Budget{MaxWallTime: time.Hour, DrainTimeout: 20 * time.Second}) {
				t.Fatalf("budget %+v", row.Budget)
			}
		}},
		{name: "a negative limit", method: "POST", path: "/v1/runs", body: `{"run_id":"b3","budget":{"max_effects":-1}}`, status: 400, code: "invalid_request", message: "max_effects"},
		{name: "a wall time that is no duration", method: "POST", path: "/v1/runs", body: `{"run_id":"b3","budget":{"max_wall_time":"soon"}}`, status: 400, code: "invalid_request", message: "budget.max_wall_time"},
		{name: "a spend that is no amount", method: "POST", path: "/v1/runs", body: `{"run_id":"b3","budget":{"max_spend_usd":"-3"}}`, status: 400, code: "invalid_request", message: "max_spend_usd"},
		{name: "a misspelt limit", method: "POST", path: "/v1/runs", body: `{"run_id":"b3","budget":{"max_efects":5}}`, status: 400, code: "unknown_field", message: "max_efects"},
		{name: "nothing of b3 was admitted", method: "GET", path: "/v1/runs/b3", status: 404, code: "not_found"},
		{name: "the row shows the budget", method: "GET", path: "/v1/runs/b1", status: 200, check: func(t *testing.T, r reply) {
			var row map[string]any
			r.json(t, &row)
			b, _ := row["budget"].(map[string]any)
			if b["max_effects"] != 5.0 || b["max_spend_usd"] != 2.5 || b["max_wall_time"] != "1h0m0s" {
				t.Fatalf("budget on the wire %v", row["budget"])
			}
		}},
	})
}
