package statetest

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stopgate/stopgate/state"
)

// The budget part of the conformance suite (docs/budgets.md): the same
// limits, counts and cancels whichever store keeps the row.
var budgetTests = []struct {
	name string
	fn   func(t *testing.T, s state.Store)
}{
	{"BudgetIsFixedInTheRowAtAdmission", testBudgetAdmitted},
	{"BudgetRefusesTheEffectThatWouldCrossItAndCancelsTheRun", testBudgetEffects},
	{"BudgetCountsEffectsPerDestination", testBudgetPerDestination},
	{"BudgetCountsRequestBytesAtTheGuard", testBudgetRequestBytes},
	{"BudgetWallTimeRefusesAndTickCancels", testBudgetWallTime},
	{"BudgetCrossedByAnOutcomeCancelsInThatStep", testBudgetTokens},
	{"UsageCountsEveryRunPerModelAndUnknownNeverAsZero", testUsageCounted},
	{"BudgetCancelsOnUnknownUsageWhenAsked", testBudgetUnknown},
	{"TripwireRefusesRecordsAndCancels", testTripwire},
	{"BudgetTakesExactlyItsLimitUnderConcurrentGuards", testBudgetConcurrent},
	{"BudgetStepRacingAnOperatorsCancelOneWinsBothRecorded", testBudgetRacesCancel},
	{"AutoAdmitTakesTheGuardsBudget", testBudgetAutoAdmit},
}

func admitBudget(t *testing.T, s state.Store, id string, b state.Budget) state.Run {
	t.Helper()
	r, err := s.Admit(ctx(t), state.AdmitRequest{RunID: id, Actor: "operator:test", Budget: b})
	if err != nil {
		t.Fatalf("admit %s with %+v: %v", id, b, err)
	}
	return r.Run
}

func events(t *testing.T, s state.Store, id string) []state.Event {
	t.Helper()
	evs, err := s.Events(ctx(t), id)
	if err != nil {
		t.Fatalf("events %s: %v", id, err)
	}
	return evs
}

// wantBudgetCancel checks that the run was cancelled by stopgate for
// reason, once, with the effect named.
func wantBudgetCancel(t *testing.T, s state.Store, id, reason, intent string) {
	t.Helper()
	r := get(t, s, id)
	if r.Status == state.StatusActive || r.Reason != reason || r.CancelVersion != 2 {
		t.Fatalf("run %s is %s/%d reason %q, want cancelled at version 2 for %q", id, r.Status, r.CancelVersion, r.Reason, reason)
	}
	n := 0
	for _, e := range events(t, s, id) {
		if e.Kind != state.EventRunCancelled {
			continue
		}
		n++
		if e.Actor != state.ActorStopgate || e.Reason != reason || e.Intent != intent || e.From != "ACTIVE" || e.To != "CANCELLING" || e.Version != 2 {
			t.Fatalf("run %s cancel event %+v, want actor stopgate, reason %s, intent %q, ACTIVE → CANCELLING at 2", id, e, reason, intent)
		}
	}
	if n != 1 {
		t.Fatalf("run %s has %d cancel events, want 1", id, n)
	}
}

func testBudgetAdmitted(t *testing.T, s state.Store) {
	b := state.Budget{MaxEffects: 5, MaxWallTime: time.Hour, MaxSpend: 2 * state.NanoUSD, CancelOnUnknownUsage: true, DrainTimeout: 3 * time.Second}
	r := admitBudget(t, s, "b", b)
	if r.Budget != b {
		t.Fatalf("admitted with budget %+v, the answer says %+v", b, r.Budget)
	}
	if got := get(t, s, "b").Budget; got != b {
		t.Fatalf("admitted with budget %+v, the row holds %+v", b, got)
	}
	// A second admission changes nothing, the budget included.
	again, err := s.Admit(ctx(t), state.AdmitRequest{RunID: "b", Actor: "operator:test", Budget: state.Budget{MaxEffects: 1}})
	if err != nil || again.Created || again.Run.Budget != b {
		t.Fatalf("admit again: %+v %v, want the row as it was", again, err)
	}
	if res := guard(t, s, state.GuardRequest{RunID: "b", Key: "k", ExplicitKey: true}); !res.Admitted || res.Run.Budget != b {
		t.Fatalf("a guard's answer carries the row's budget: %+v", res.Run)
	}
	if _, err := s.Admit(ctx(t), state.AdmitRequest{RunID: "neg", Budget: state.Budget{MaxEffects: -1}}); err == nil {
		t.Fatal("a negative limit was admitted")
	}
	if plain := admit(t, s, "plain"); plain.Budget.Limited() {
		t.Fatalf("a run admitted without a budget has one: %+v", plain.Budget)
	}
}

func testBudgetEffects(t *testing.T, s state.Store) {
	admitBudget(t, s, "e", state.Budget{MaxEffects: 3, DrainTimeout: time.Minute})
	sched := guard(t, s, state.GuardRequest{RunID: "e", Key: "retry:1", ExplicitKey: true, Boundary: state.BoundaryRetry, NotBefore: time.Now().Add(time.Hour)})
	if !sched.Admitted {
		t.Fatalf("a scheduled retry is not an effect until dispatched: %+v", sched)
	}
	cancels, err := s.Cancels(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if res := guard(t, s, state.GuardRequest{RunID: "e", Key: fmt.Sprintf("k%d", i), ExplicitKey: true, Target: "https://a.example/x"}); !res.Admitted {
			t.Fatalf("effect %d of 3 refused: %+v", i+1, res)
		}
	}
	res := guard(t, s, state.GuardRequest{RunID: "e", Key: "k3", ExplicitKey: true, Target: "https://a.example/x"})
	if res.Admitted || res.Refusal != state.RefusalBudgetExceeded || res.Cause != "budget:max_effects" {
		t.Fatalf("the 4th effect of a budget of 3: %+v, want refused budget_exceeded, cause budget:max_effects", res)
	}
	wantRun(t, res.Run, state.StatusCancelling, 2)
	if res.Intent.State != state.IntentCancelledBeforeDispatch || res.Intent.Reason != "budget:max_effects" {
		t.Fatalf("the refused effect is recorded %+v", res.Intent)
	}
	wantBudgetCancel(t, s, "e", "budget:max_effects", "k3")
	if in := intent(t, s, "e", "retry:1"); in.State != state.IntentRevoked {
		t.Fatalf("the budget's cancel revokes scheduled retries as any cancel: %+v", in)
	}
	r := get(t, s, "e")
	if r.Usage[state.CounterEffects] != 3 || r.Usage.Destinations()["a.example"] != 3 {
		t.Fatalf("usage %v, want 3 effects, 3 to a.example", r.Usage)
	}
	if !r.DrainDeadline.Equal(r.CancelledAt.Add(time.Minute)) {
		t.Fatalf("drain deadline %s, cancelled %s: want the budget's drain of 1m", r.DrainDeadline, r.CancelledAt)
	}
	select {
	case id := <-cancels:
		if id != "e" {
			t.Fatalf("cancel broadcast for %s, want e", id)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a budget's cancel was not broadcast")
	}
	// What comes after is refused as after any cancel.
	if res := guard(t, s, state.GuardRequest{RunID: "e", Key: "k4", ExplicitKey: true}); res.Refusal != state.RefusalRunNotActive {
		t.Fatalf("after the budget's cancel: %+v", res)
	}
}

func testBudgetPerDestination(t *testing.T, s state.Store) {
	admitBudget(t, s, "d", state.Budget{MaxEffectsPerDestination: 2})
	for i, target := range []string{"https://A.example/1", "https://b.example:8443/2", "https://a.example./3", "http://user@b.example/4"} {
		if res := guard(t, s, state.GuardRequest{RunID: "d", Key: fmt.Sprintf("k%d", i), ExplicitKey: true, Target: target}); !res.Admitted {
			t.Fatalf("%s: refused %+v", target, res)
		}
	}
	res := guard(t, s, state.GuardRequest{RunID: "d", Key: "k9", ExplicitKey: true, Target: "https://a.example/again"})
	if res.Refusal != state.RefusalBudgetExceeded || res.Cause != "budget:max_effects_per_destination" {
		t.Fatalf("the third effect to a.example: %+v", res)
	}
	wantBudgetCancel(t, s, "d", "budget:max_effects_per_destination", "k9")
	if got := get(t, s, "d").Usage.Destinations(); got["a.example"] != 2 || got["b.example"] != 2 || len(got) != 2 {
		t.Fatalf("effects by destination %v", got)
	}
}

func testBudgetRequestBytes(t *testing.T, s state.Store) {
	admitBudget(t, s, "q", state.Budget{MaxRequestBytes: 100})
	if res := guard(t, s, state.GuardRequest{RunID: "q", Key: "k0", ExplicitKey: true, RequestBytes: 60}); !res.Admitted {
		t.Fatalf("60 of 100 bytes: %+v", res)
	}
	if res := guard(t, s, state.GuardRequest{RunID: "q", Key: "k1", ExplicitKey: true, RequestBytes: 40}); !res.Admitted {
		t.Fatalf("100 of 100 bytes is within the limit: %+v", res)
	}
	res := guard(t, s, state.GuardRequest{RunID: "q", Key: "k2", ExplicitKey: true, RequestBytes: 1})
	if res.Cause != "budget:max_request_bytes" {
		t.Fatalf("101 of 100 bytes: %+v", res)
	}
	if u := get(t, s, "q").Usage; u[state.CounterRequestBytes] != 100 {
		t.Fatalf("request bytes %d, want the 100 admitted", u[state.CounterRequestBytes])
	}
}

func testBudgetWallTime(t *testing.T, s state.Store) {
	admitBudget(t, s, "w", state.Budget{MaxWallTime: 150 * time.Millisecond})
	admitBudget(t, s, "idle", state.Budget{MaxWallTime: 150 * time.Millisecond})
	if res := guard(t, s, state.GuardRequest{RunID: "w", Key: "k0", ExplicitKey: true}); !res.Admitted {
		t.Fatalf("within its wall time: %+v", res)
	}
	if r := tick(t, s, "idle"); r.Status != state.StatusActive {
		t.Fatalf("a tick within the wall time cancelled the run: %+v", r)
	}
	time.Sleep(300 * time.Millisecond)
	res := guard(t, s, state.GuardRequest{RunID: "w", Key: "k1", ExplicitKey: true})
	if res.Cause != "budget:max_wall_time" {
		t.Fatalf("past its wall time: %+v", res)
	}
	wantBudgetCancel(t, s, "w", "budget:max_wall_time", "k1")
	// A run that asks for nothing more is cancelled by the sweeper's tick.
	r := tick(t, s, "idle")
	if r.Reason != "budget:max_wall_time" || r.Status != state.StatusCancelled {
		t.Fatalf("a tick past the wall time: %+v, want cancelled (nothing in flight) for budget:max_wall_time", r)
	}
	wantBudgetCancel(t, s, "idle", "budget:max_wall_time", "")
}

func llmFinish(t *testing.T, s state.Store, in state.Intent, bytes int64, llm *state.LLMUsage) state.Intent {
	t.Helper()
	out, err := s.Finish(ctx(t), state.FinishRequest{RunID: in.RunID, Key: in.Key, Attempt: in.Attempts, Outcome: state.IntentResponded,
		StatusCode: 200, Actor: "proxy:test", ResponseBytes: bytes, LLM: llm})
	if err != nil {
		t.Fatalf("finish %s: %v", in.Key, err)
	}
	return out
}

func testBudgetTokens(t *testing.T, s state.Store) {
	admitBudget(t, s, "t", state.Budget{MaxTokens: 1000, MaxResponseBytes: 1 << 20})
	a := guard(t, s, state.GuardRequest{RunID: "t", Key: "a", ExplicitKey: true}).Intent
	b := guard(t, s, state.GuardRequest{RunID: "t", Key: "b", ExplicitKey: true}).Intent
	llmFinish(t, s, a, 300, &state.LLMUsage{Model: "gpt-x", Known: true, InputTokens: 400, OutputTokens: 200})
	if r := get(t, s, "t"); r.Status != state.StatusActive {
		t.Fatalf("600 of 1000 tokens cancelled the run: %+v", r)
	}
	// The second answer takes the run to 1100: it has happened, the run
	// is cancelled in the same step, and with nothing else in flight it
	// is CANCELLED at once.
	llmFinish(t, s, b, 300, &state.LLMUsage{Model: "gpt-x", Known: true, InputTokens: 300, OutputTokens: 200})
	wantBudgetCancel(t, s, "t", "budget:max_tokens", "b")
	r := get(t, s, "t")
	if r.Status != state.StatusCancelled || r.StatusReason != state.ReasonDrained {
		t.Fatalf("after the crossing outcome: %s/%s, want CANCELLED drained", r.Status, r.StatusReason)
	}
	if r.Usage[state.CounterTokens] != 1100 || r.Usage[state.CounterResponseBytes] != 600 {
		t.Fatalf("usage %v", r.Usage)
	}
	if res := guard(t, s, state.GuardRequest{RunID: "t", Key: "c", ExplicitKey: true}); res.Refusal != state.RefusalRunNotActive {
		t.Fatalf("the next effect: %+v", res)
	}
	// A crossing by bytes alone.
	admitBudget(t, s, "rb", state.Budget{MaxResponseBytes: 10})
	c := guard(t, s, state.GuardRequest{RunID: "rb", Key: "c", ExplicitKey: true}).Intent
	llmFinish(t, s, c, 11, nil)
	wantBudgetCancel(t, s, "rb", "budget:max_response_bytes", "c")
}

func testUsageCounted(t *testing.T, s state.Store) {
	admit(t, s, "u")
	ins := make([]state.Intent, 4)
	for i := range ins {
		ins[i] = guard(t, s, state.GuardRequest{RunID: "u", Key: fmt.Sprintf("k%d", i), ExplicitKey: true, Target: "https://api.example/v1", RequestBytes: 10}).Intent
	}
	llmFinish(t, s, ins[0], 100, &state.LLMUsage{Model: "m-1", Known: true, InputTokens: 10, OutputTokens: 5, Priced: true, Spend: 1500})
	llmFinish(t, s, ins[1], 100, &state.LLMUsage{Model: "m-2", Known: true, InputTokens: 7, OutputTokens: 3})
	llmFinish(t, s, ins[2], 50, &state.LLMUsage{Model: "m-1", Known: false})
	finish(t, s, ins[3], state.IntentNotSent, 0)
	u := get(t, s, "u").Usage
	want := state.Usage{
		state.CounterEffects: 4, state.CounterRequestBytes: 40, state.CounterResponseBytes: 250,
		state.CounterInputTokens: 17, state.CounterOutputTokens: 8, state.CounterTokens: 25, state.CounterSpend: 1500,
		state.CounterLLMCalls: 2, state.CounterUnknownUsage: 1, state.CounterUnpriced: 1,
		"dest:api.example": 4, "in:m-1": 10, "out:m-1": 5, "calls:m-1": 1, "in:m-2": 7, "out:m-2": 3, "calls:m-2": 1,
	}
	if fmt.Sprint(u) != fmt.Sprint(want) {
		t.Fatalf("usage\n  %v\nwant\n  %v", u, want)
	}
	if list, err := s.List(ctx(t), ""); err != nil || len(list) != 1 || fmt.Sprint(list[0].Usage) != fmt.Sprint(want) {
		t.Fatalf("List carries the usage as Get does: %+v %v", list, err)
	}
	if m := u.Models()["m-1"]; m != (state.ModelUsage{InputTokens: 10, OutputTokens: 5, Calls: 1}) {
		t.Fatalf("model m-1 %+v", m)
	}
	// A step's answer carries the row without its usage.
	res := guard(t, s, state.GuardRequest{RunID: "u", Key: "k9", ExplicitKey: true})
	if res.Run.Usage != nil {
		t.Fatalf("a guard's answer carries usage %v", res.Run.Usage)
	}
	finish(t, s, res.Intent, state.IntentResponded, 200)
	// What a run used stays with its row after a prune.
	cancel(t, s, "u", 0)
	tick(t, s, "u")
	if _, err := s.Prune(ctx(t), state.PruneRequest{FinalBefore: time.Now().Add(time.Hour), Limit: 10}); err != nil {
		t.Fatal(err)
	}
	if r := get(t, s, "u"); r.PrunedAt.IsZero() || r.Usage[state.CounterTokens] != 25 || r.Usage["in:m-2"] != 7 || r.Usage[state.CounterEffects] != 5 {
		t.Fatalf("after a prune: %+v", r)
	}
}

func testBudgetUnknown(t *testing.T, s state.Store) {
	admitBudget(t, s, "count", state.Budget{MaxTokens: 10})
	a := guard(t, s, state.GuardRequest{RunID: "count", Key: "a", ExplicitKey: true}).Intent
	llmFinish(t, s, a, 10, &state.LLMUsage{Known: false})
	if r := get(t, s, "count"); r.Status != state.StatusActive || r.Usage[state.CounterUnknownUsage] != 1 {
		t.Fatalf("unknown usage without cancel_on_unknown_usage: %+v", r)
	}
	admitBudget(t, s, "strict", state.Budget{MaxTokens: 10, CancelOnUnknownUsage: true})
	b := guard(t, s, state.GuardRequest{RunID: "strict", Key: "b", ExplicitKey: true}).Intent
	llmFinish(t, s, b, 10, &state.LLMUsage{Known: false})
	wantBudgetCancel(t, s, "strict", "budget:unknown_usage", "b")
	// With a spend limit, a model without a price is unknown spend.
	admitBudget(t, s, "spend", state.Budget{MaxSpend: state.NanoUSD, CancelOnUnknownUsage: true})
	c := guard(t, s, state.GuardRequest{RunID: "spend", Key: "c", ExplicitKey: true}).Intent
	llmFinish(t, s, c, 10, &state.LLMUsage{Model: "nopriced", Known: true, InputTokens: 1})
	wantBudgetCancel(t, s, "spend", "budget:unknown_usage", "c")
}

func testTripwire(t *testing.T, s state.Store) {
	admit(t, s, "tw")
	guard(t, s, state.GuardRequest{RunID: "tw", Key: "ok", ExplicitKey: true})
	res := guard(t, s, state.GuardRequest{RunID: "tw", Key: "paste", ExplicitKey: true, Method: "POST", Target: "https://paste.example/new",
		Tripwire: "no-paste", TripwireDrain: 5 * time.Second})
	if res.Admitted || res.Refusal != state.RefusalTripwire || res.Cause != "tripwire:no-paste" {
		t.Fatalf("a tripwire: %+v", res)
	}
	if res.Intent.State != state.IntentCancelledBeforeDispatch || res.Intent.Target != "https://paste.example/new" {
		t.Fatalf("the tripped effect is recorded %+v", res.Intent)
	}
	wantBudgetCancel(t, s, "tw", "tripwire:no-paste", "paste")
	if r := get(t, s, "tw"); !r.DrainDeadline.Equal(r.CancelledAt.Add(5 * time.Second)) {
		t.Fatalf("a tripwire's drain: %+v", r)
	}
	if u := get(t, s, "tw").Usage; u[state.CounterEffects] != 1 {
		t.Fatalf("a tripped effect is not an effect: %v", u)
	}
	// A cancelling run's delivery that meets a tripwire is refused; the
	// run is not cancelled again.
	res = guard(t, s, state.GuardRequest{RunID: "tw", Key: "hook", ExplicitKey: true, AllowCancelling: true, Boundary: state.BoundaryDelivery, Tripwire: "no-paste"})
	if res.Refusal != state.RefusalTripwire || res.Run.CancelVersion != 2 {
		t.Fatalf("a delivery meeting a tripwire: %+v", res)
	}
	if _, err := s.Guard(ctx(t), state.GuardRequest{RunID: "tw", Key: "x", ExplicitKey: true, Boundary: state.BoundaryHTTP, LeaseTTL: lease, Tripwire: "bad name"}); err == nil {
		t.Fatal("a tripwire name with a space was taken")
	}
}

func testBudgetConcurrent(t *testing.T, s state.Store) {
	const limit, workers, each = 10, 6, 5
	admitBudget(t, s, "burst", state.Budget{MaxEffects: limit})
	var wg sync.WaitGroup
	var mu sync.Mutex
	admitted, budget := 0, 0
	for w := range workers {
		wg.Go(func() {
			for i := range each {
				res, err := s.Guard(ctx(t), state.GuardRequest{RunID: "burst", Key: fmt.Sprintf("w%d-%d", w, i), ExplicitKey: true,
					Boundary: state.BoundaryHTTP, LeaseTTL: lease, LeaseOwner: "p", Actor: "p"})
				if err != nil {
					t.Errorf("guard: %v", err)
					return
				}
				mu.Lock()
				if res.Admitted {
					admitted++
				}
				if res.Refusal == state.RefusalBudgetExceeded {
					budget++
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if admitted != limit || budget != 1 {
		t.Fatalf("%d admitted and %d refused for the budget, want exactly %d and 1 (the rest refused by the cancel)", admitted, budget, limit)
	}
	wantBudgetCancel(t, s, "burst", "budget:max_effects", wantCrossing(t, s, "burst"))
	if u := get(t, s, "burst").Usage; u[state.CounterEffects] != limit {
		t.Fatalf("effects counted %d, want %d", u[state.CounterEffects], limit)
	}
}

// wantCrossing is the key of the one effect refused for the run's budget.
func wantCrossing(t *testing.T, s state.Store, id string) string {
	t.Helper()
	for _, e := range events(t, s, id) {
		if e.Kind == state.EventIntentRefused && e.Reason == "budget:max_effects" {
			return e.Intent
		}
	}
	t.Fatalf("no effect of %s was refused for its budget", id)
	return ""
}

func testBudgetRacesCancel(t *testing.T, s state.Store) {
	budgetWon, operatorWon := 0, 0
	for round := range 12 {
		run := fmt.Sprintf("rc%d", round)
		admitBudget(t, s, run, state.Budget{MaxEffects: 1})
		guard(t, s, state.GuardRequest{RunID: run, Key: "first", ExplicitKey: true})
		var wg sync.WaitGroup
		var res state.GuardResult
		var cres state.CancelResult
		wg.Go(func() {
			time.Sleep(time.Duration(round%4) * time.Millisecond / 2)
			res = guard(t, s, state.GuardRequest{RunID: run, Key: "second", ExplicitKey: true})
		})
		wg.Go(func() {
			time.Sleep(time.Duration(round%3) * time.Millisecond / 2)
			cres = cancel(t, s, run, time.Minute)
		})
		wg.Wait()
		var cancels []state.Event
		refused := false
		for _, e := range events(t, s, run) {
			switch {
			case e.Kind == state.EventRunCancelled:
				cancels = append(cancels, e)
			case e.Kind == state.EventIntentRefused && e.Intent == "second":
				refused = true
			}
		}
		if len(cancels) != 1 || !refused {
			t.Fatalf("%s: %d cancel events, refusal of the second effect recorded %v: want one cancel, and the refusal", run, len(cancels), refused)
		}
		switch c := cancels[0]; {
		case c.Actor == state.ActorStopgate:
			// The budget's step came first: the operator's cancel finds
			// the run cancelling and changes nothing.
			budgetWon++
			if cres.Changed || res.Refusal != state.RefusalBudgetExceeded || cres.Run.Reason != "budget:max_effects" {
				t.Fatalf("%s: the budget won, yet the cancel answered %+v and the guard %+v", run, cres, res)
			}
		default:
			operatorWon++
			if !cres.Changed || res.Refusal != state.RefusalRunNotActive || get(t, s, run).Reason != "stop pressed" {
				t.Fatalf("%s: the operator won, yet the cancel answered %+v and the guard %+v", run, cres, res)
			}
		}
		if in := intent(t, s, run, "second"); in.State != state.IntentCancelledBeforeDispatch {
			t.Fatalf("%s: the second effect is %s", run, in.State)
		}
	}
	t.Logf("budget first %d times, operator first %d times", budgetWon, operatorWon)
}

func testBudgetAutoAdmit(t *testing.T, s state.Store) {
	b := state.Budget{MaxEffects: 1}
	res := guard(t, s, state.GuardRequest{RunID: "aa", Key: "k0", ExplicitKey: true, AutoAdmit: true, Budget: b})
	if !res.Admitted || res.Run.Budget != b {
		t.Fatalf("auto-admitted with a budget: %+v", res)
	}
	// A guard of a run that has a row does not change its budget.
	res = guard(t, s, state.GuardRequest{RunID: "aa", Key: "k1", ExplicitKey: true, AutoAdmit: true, Budget: state.Budget{MaxEffects: 100}})
	if res.Refusal != state.RefusalBudgetExceeded {
		t.Fatalf("the second effect of an auto-admitted run with a budget of 1: %+v", res)
	}
}
