package redisstore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/state"
)

// generalRules runs one step under the general rules of steps.lua alone,
// never the common path batch.lua writes out: what the batch is compared
// with. A test-only script, not part of the library.
var generalRules = newProgram("general", "", `
set_head(ARGV[1], ARGV[2], ARGV[3])
if ARGV[4] == 'g' then
  return {op_guard(4)}
end
return {op_finish(4)}
`)

// A batch is one call for any number of steps of any number of runs, with
// the common path written out. It must give every step the answer, and
// leave the record, that the general rules give the same steps one by one:
// this test sends one sequence one by one on a run, and in one call on two
// other runs (the call holds the sequence twice, a group per run), and
// compares each with the first.
func TestBatchAnswersAsStepsOneByOne(t *testing.T) {
	s, _ := testStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	guard := func(run, key string, explicit bool) state.GuardRequest {
		return state.GuardRequest{RunID: run, ObservedVersion: 1, Key: key, ExplicitKey: explicit, Boundary: state.BoundaryHTTP,
			Method: "POST", Target: "https://api.example/x", BodyDigest: "d", LeaseOwner: "p", LeaseTTL: time.Minute, Actor: "p",
			NotAfter: time.Now().Add(time.Minute)}
	}
	batched := []string{"batched", "batched-too"}
	for _, run := range append([]string{"one-by-one"}, batched...) {
		if _, err := s.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "t"}); err != nil {
			t.Fatal(err)
		}
		// Intents for the outcomes below, and a key seen before.
		for _, k := range []string{"a", "b", "seen"} {
			if _, err := s.Guard(ctx, guard(run, k, true)); err != nil {
				t.Fatal(err)
			}
		}
	}
	stale := guard("", "stale", true)
	stale.ObservedVersion = 7
	late := guard("", "late", true)
	late.NotAfter = time.Now().Add(-time.Second)
	// Another instance's guard and outcome: their own actor, lease owner
	// and TTL, which the call sends with them (codes G and F).
	theirs := guard("", "theirs", true)
	theirs.Actor, theirs.LeaseOwner, theirs.LeaseTTL = "q", "q-owner", 2*time.Minute
	steps := []BatchStep{
		{Code: 'g', Guard: theirs},
		{Code: 'l', Finish: state.FinishRequest{Key: "theirs", Attempt: 1, Outcome: state.IntentResponded, StatusCode: 201, Actor: "q"}},
		{Code: 'g', Guard: guard("", "base", false)},
		{Code: 'f', Finish: state.FinishRequest{Key: "a", Attempt: 1, Outcome: state.IntentResponded, StatusCode: 200, Actor: "p"}},
		{Code: 'g', Guard: late},
		{Code: 'g', Guard: guard("", "new", true)},
		{Code: 'l', Finish: state.FinishRequest{Key: "b", Attempt: 1, Outcome: state.IntentNotApplied, Source: state.SourceSafeMethod, Reason: "cut", Actor: "p"}},
		{Code: 'g', Guard: guard("", "base", false)},                                                             // the same derived base again: base.2
		{Code: 'l', Finish: state.FinishRequest{Key: "a", Attempt: 1, Outcome: state.IntentNotSent, Actor: "p"}}, // not in flight any more
		{Code: 'g', Guard: guard("", "seen", true)},                                                              // in progress
		{Code: 'g', Guard: stale},
		// Under the general rules from here: an outcome nobody waits for,
		// with its own actor.
		{Code: 'l', Finish: state.FinishRequest{Key: "new", Attempt: 1, Outcome: state.IntentResponded, StatusCode: 204, Actor: "p"}},
		{Code: 'f', Finish: state.FinishRequest{Key: "nothing", Attempt: 1, Outcome: state.IntentResponded, Actor: "p"}},
		{Code: 'g', Guard: guard("", "after", true)},
	}
	one := oneByOne(ctx, t, s, "one-by-one", steps)
	for i, got := range batchedAnswers(ctx, t, s, batched, steps) {
		run, j := batched[i/len(steps)], i%len(steps)
		if got != one[j] {
			t.Errorf("step %d of %s: batched %q, one by one %q", j, run, got, one[j])
		}
	}
	for _, run := range batched {
		sameRecords(ctx, t, s, "one-by-one", run)
	}
}

// A guard on the batch's common path answers only its key and time; its
// caller puts the record together from what it sent. That record must be
// the one the store keeps, field for field, whatever the guard's texts
// (its own or the call's head), its key (explicit, derived, a derived
// base again) or its lease's TTL (not a whole number of ms).
func TestBatchGuardAnswersTheRecordItStored(t *testing.T) {
	s, _ := testStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const run = "answered"
	if _, err := s.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "t"}); err != nil {
		t.Fatal(err)
	}
	guard := func(key string, explicit bool) state.GuardRequest {
		return state.GuardRequest{RunID: run, ObservedVersion: 1, Key: key, ExplicitKey: explicit, Boundary: state.BoundaryHTTP,
			Method: "GET", Target: "https://api.example/x?q=1", LeaseOwner: "p", LeaseTTL: time.Minute, Actor: "p",
			NotAfter: time.Now().Add(time.Minute)}
	}
	odd := guard("odd", true)
	odd.Method, odd.Target, odd.BodyDigest, odd.Boundary = "POST", "https://api.example/a\\b\nc", "sha256:00ff", state.BoundaryClaim
	odd.ObservedVersion = 0
	theirs := guard("theirs", true)
	theirs.Actor, theirs.LeaseOwner, theirs.LeaseTTL = "q", "q-owner\nline", 90*time.Second+1500*time.Microsecond
	var steps []BatchStep
	for _, g := range []state.GuardRequest{guard("x", true), guard("p", false), guard("p", false), odd, theirs, guard("p", false)} {
		steps = append(steps, BatchStep{Code: 'g', Guard: g})
	}
	keys, args := callArgs([]string{run}, steps)
	v, err := s.exec(ctx, batchProgram, keys, args...).Result()
	if err != nil {
		t.Fatal(err)
	}
	stored := map[string]state.Intent{}
	for _, in := range must2(s.Intents(ctx, run))(t) {
		stored[in.Key] = in
	}
	for i, x := range v.([]any) {
		r, err := parseReply(x)
		if err != nil {
			t.Fatal(err)
		}
		if r.admitted.key == "" {
			t.Errorf("step %d left the common path: %+v", i, r)
			continue
		}
		res, err := s.guardResult(ctx, steps[i].Guard, r)
		if err != nil {
			t.Fatal(err)
		}
		if got, want := fmt.Sprintf("%+v", res.Intent), fmt.Sprintf("%+v", stored[res.Intent.Key]); got != want {
			t.Errorf("step %d answered\n  %s\nthe store keeps\n  %s", i, got, want)
		}
	}
}

// The batch's tables live as long as the library and every call refills
// them: a call must answer its own steps only, and read afresh every count
// it moves, whatever the call before it held at the same places.
func TestBatchCallsInheritNothingFromTheCallBefore(t *testing.T) {
	s, _ := testStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if !s.Functions() {
		t.Skip("this Redis runs the programs as scripts: nothing outlives a call")
	}
	const run = "refilled"
	if _, err := s.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "t"}); err != nil {
		t.Fatal(err)
	}
	guard := func(key string) BatchStep {
		return BatchStep{Code: 'g', Guard: state.GuardRequest{ObservedVersion: 1, Key: key, ExplicitKey: true, Boundary: state.BoundaryHTTP,
			Method: "GET", Target: "https://api.example/x", LeaseOwner: "p", LeaseTTL: time.Minute, Actor: "p",
			NotAfter: time.Now().Add(time.Minute)}}
	}
	done := func(key string) BatchStep {
		return BatchStep{Code: 'f', Finish: state.FinishRequest{Key: key, Attempt: 1, Outcome: state.IntentResponded, StatusCode: 200, Actor: "p"}}
	}
	// Each call after the first holds fewer steps than the one before,
	// and the last two name the same count at the same offset.
	for i, call := range [][]BatchStep{
		{guard("a"), guard("b"), guard("c"), guard("d")},
		{done("a"), done("b"), guard("e")},
		{done("c"), done("d")},
		{done("e")},
	} {
		keys, err := s.CallBatch(ctx, run, call)
		if err != nil {
			t.Fatalf("call %d: %v", i+1, err)
		}
		if len(keys) != len(call) {
			t.Fatalf("call %d: %d answers for %d steps", i+1, len(keys), len(call))
		}
	}
	r := must2(s.Get(ctx, run))(t)
	if got := r.Intents[state.IntentResponded]; got != 5 || r.Intents[state.IntentInFlight] != 0 {
		t.Errorf("counts after five outcomes: %v; want 5 RESPONDED and none in flight", r.Intents)
	}
}

// A request repeated (a poll) names each dispatch base.n; a batch names
// the dispatches of its guards for the whole call at once. Whatever the
// order of its bases, a name an explicit key took first, or a step that
// leaves the common path between them, each guard must get the name, and
// the run the records and counters, that the general rules give one by
// one.
func TestBatchNamesRepeatedRequestsAsStepsOneByOne(t *testing.T) {
	s, _ := testStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	guard := func(key string, explicit bool) BatchStep {
		return BatchStep{Code: 'g', Guard: state.GuardRequest{ObservedVersion: 1, Key: key, ExplicitKey: explicit, Boundary: state.BoundaryHTTP,
			Method: "GET", Target: "https://api.example/poll", LeaseOwner: "p", LeaseTTL: time.Minute, Actor: "p",
			NotAfter: time.Now().Add(time.Minute)}}
	}
	poll := func(base string) BatchStep { return guard(base, false) }
	done := func(key string) BatchStep {
		return BatchStep{Code: 'f', Finish: state.FinishRequest{Key: key, Attempt: 1, Outcome: state.IntentResponded, StatusCode: 200, Actor: "p"}}
	}
	stale := poll("p")
	stale.Guard.ObservedVersion = 7
	cases := []struct {
		name   string
		before []BatchStep
		steps  []BatchStep
		// atOnce: the call names every dispatch from its one read of the
		// counters, and counts none one by one (HINCRBY).
		atOnce bool
	}{
		{"a base used before, in a row, with outcomes between", []BatchStep{poll("p"), poll("p")},
			[]BatchStep{poll("p"), done("p.3"), poll("p"), poll("p"), done("p.4")}, true},
		{"a base new to the run, in a row", nil,
			[]BatchStep{poll("p"), poll("p"), poll("p")}, true},
		{"a name an explicit key took is skipped", []BatchStep{poll("p"), guard("p.3", true)},
			[]BatchStep{poll("p"), poll("p"), poll("p")}, false},
		{"a base again after another", []BatchStep{poll("a")},
			[]BatchStep{poll("a"), poll("b"), poll("a"), poll("a"), poll("b")}, false},
		{"the general rules after named dispatches", []BatchStep{poll("p")},
			[]BatchStep{poll("p"), poll("p"), stale, poll("p")}, false},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			one, batched := fmt.Sprintf("one-%d", i), fmt.Sprintf("batched-%d", i)
			for _, run := range []string{one, batched} {
				if _, err := s.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "t"}); err != nil {
					t.Fatal(err)
				}
				oneByOne(ctx, t, s, run, c.before)
			}
			want := oneByOne(ctx, t, s, one, c.steps)
			if err := s.rdb.ConfigResetStat(ctx).Err(); err != nil {
				t.Fatal(err)
			}
			for j, got := range batchedAnswers(ctx, t, s, []string{batched}, c.steps) {
				if got != want[j] {
					t.Errorf("step %d: batched %q, one by one %q", j, got, want[j])
				}
			}
			stats := must2(s.rdb.Info(ctx, "commandstats").Result())(t)
			if counted := strings.Contains(stats, "cmdstat_hincrby:"); c.atOnce && counted {
				t.Errorf("the call counted dispatches one by one:\n%s", stats)
			}
			// The counters carry on alike: the next dispatch of each base
			// gets the same name on both runs.
			next := []BatchStep{poll("p"), poll("a"), poll("b")}
			if a, b := oneByOne(ctx, t, s, one, next), oneByOne(ctx, t, s, batched, next); fmt.Sprint(a) != fmt.Sprint(b) {
				t.Errorf("the next dispatches: after one by one %q, after the batch %q", a, b)
			}
			var intents [2]string
			for k, run := range []string{one, batched} {
				for _, in := range must2(s.Intents(ctx, run))(t) {
					intents[k] += fmt.Sprintf("%s %s; ", in.Key, in.State)
				}
			}
			if intents[0] != intents[1] {
				t.Errorf("intents: one by one %s, batched %s", intents[0], intents[1])
			}
		})
	}
}

// answer is what a step's reply says, the run's name written RUN, so that
// the answers of two runs compare.
func (st BatchStep) answer(ctx context.Context, s *Store, run string, r reply) string {
	if st.Code == 'g' {
		req := st.Guard
		req.RunID = run
		res, err := s.guardResult(ctx, req, r)
		return strings.ReplaceAll(fmt.Sprintf("%v %s %s %s %d %v", res.Admitted, res.Refusal, res.Intent.Key, res.Intent.State, res.Intent.Attempts, err), run, "RUN")
	}
	req := st.Finish
	req.RunID = run
	if st.Code == 'l' {
		// An outcome nobody waits for is told its error alone.
		return strings.ReplaceAll(fmt.Sprintf("%s %v", req.Key, failure(req.RunID, req.Key, r)), run, "RUN")
	}
	in, err := finishResult(req, r)
	return strings.ReplaceAll(fmt.Sprintf("%s %s %d %s %v", in.Key, in.State, in.Attempts, in.Source, err), run, "RUN")
}

// oneByOne runs steps on run one at a time under the general rules alone,
// and answers them.
func oneByOne(ctx context.Context, t *testing.T, s *Store, run string, steps []BatchStep) []string {
	t.Helper()
	var out []string
	for _, st := range steps {
		a := st.args(run)
		args := append([]any{a.texts.actor, a.texts.owner, a.texts.ttl, string(st.Code)}, a.own...)
		v, err := generalRules.script.Run(ctx, s.scripter, keysOf(run).list(), args...).Result()
		if err != nil {
			t.Fatal(err)
		}
		r, err := parseReply(v.([]any)[0])
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, st.answer(ctx, s, run, r))
	}
	return out
}

// batchedAnswers runs steps on each of runs in one call of the batch
// program, a group per run, and answers them, run after run.
func batchedAnswers(ctx context.Context, t *testing.T, s *Store, runs []string, steps []BatchStep) []string {
	t.Helper()
	keys, args := callArgs(runs, steps)
	v, err := s.exec(ctx, batchProgram, keys, args...).Result()
	if err != nil {
		t.Fatal(err)
	}
	if n := len(v.([]any)); n != len(runs)*len(steps) {
		t.Fatalf("%d answers for %d steps", n, len(runs)*len(steps))
	}
	var out []string
	for i, x := range v.([]any) {
		r, err := parseReply(x)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, steps[i%len(steps)].answer(ctx, s, runs[i/len(steps)], r))
	}
	return out
}

// sameRecords checks that runs a and b hold the same row, intents and
// events, and that b's common steps wrote their events as one entry of the
// audit stream where a wrote one entry for each.
func sameRecords(ctx context.Context, t *testing.T, s *Store, a, b string) {
	t.Helper()
	rowA := must2(s.Get(ctx, a))(t)
	rowB := must2(s.Get(ctx, b))(t)
	if fmt.Sprint(rowA.Intents) != fmt.Sprint(rowB.Intents) || rowA.Status != rowB.Status {
		t.Errorf("rows differ: one by one %+v, batched %+v", rowA, rowB)
	}
	insA := must2(s.Intents(ctx, a))(t)
	insB := must2(s.Intents(ctx, b))(t)
	if len(insA) != len(insB) {
		t.Fatalf("%d intents one by one, %d batched", len(insA), len(insB))
	}
	for i := range insA {
		x, y := insA[i], insB[i]
		if x.Key != y.Key || x.State != y.State || x.Attempts != y.Attempts || x.Refusals != y.Refusals || x.Reason != y.Reason ||
			x.Source != y.Source || x.StatusCode != y.StatusCode || x.LeaseOwner != y.LeaseOwner {
			t.Errorf("intent %d: one by one %+v, batched %+v", i, x, y)
		}
	}
	evA := must2(s.Events(ctx, a))(t)
	evB := must2(s.Events(ctx, b))(t)
	if len(evA) != len(evB) {
		t.Fatalf("%d events one by one, %d batched", len(evA), len(evB))
	}
	// The events of the batch's common steps (the first seven with an
	// event, up to the outcome for a record no longer in flight) are one
	// entry of the audit stream; one by one, each is an entry of its own.
	lenA := must2(s.rdb.XLen(ctx, keysOf(a).events).Result())(t)
	lenB := must2(s.rdb.XLen(ctx, keysOf(b).events).Result())(t)
	if lenA-lenB != 6 {
		t.Errorf("%d stream entries one by one, %d batched: want the seven common steps' events in one entry", lenA, lenB)
	}
	for i := range evA {
		x, y := evA[i], evB[i]
		if x.Kind != y.Kind || x.From != y.From || x.To != y.To || x.Intent != y.Intent || x.Reason != y.Reason || x.Version != y.Version ||
			x.Actor != y.Actor {
			t.Errorf("event %d: one by one %+v, batched %+v", i, x, y)
		}
	}
}

// An error in one run's steps (here a row that is not a hash) answers
// those steps with it, as a call of that run alone would fail, and leaves
// the other runs of the call answered and recorded.
func TestBatchKeepsAFailingRunToItself(t *testing.T) {
	s, _ := testStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, run := range []string{"before", "after"} {
		if _, err := s.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "t"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.rdb.Set(ctx, keysOf("broken").row, "not a hash", 0).Err(); err != nil {
		t.Fatal(err)
	}
	guard := func(run string) state.GuardRequest {
		return state.GuardRequest{RunID: run, Key: "k", ExplicitKey: true, Boundary: state.BoundaryHTTP, Method: "POST",
			Target: "https://api.example/x", LeaseOwner: "p", LeaseTTL: time.Minute, Actor: "p", NotAfter: time.Now().Add(time.Minute)}
	}
	runs := []string{"before", "broken", "after"}
	var sent []*step
	for _, run := range runs {
		sent = append(sent, &step{run: run, code: 'g', args: guardArgs(guard(run))})
	}
	keys, args := batchCall(sent)
	v, err := s.exec(ctx, batchProgram, keys, args...).Result()
	if err != nil {
		t.Fatalf("the call failed as a whole: %v", err)
	}
	for i, run := range runs {
		r, err := parseReply(v.([]any)[i])
		if run == "broken" {
			if !redis.HasErrorPrefix(err, "WRONGTYPE") {
				t.Errorf("broken run answered %+v, %v; want its WRONGTYPE error", r, err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%s: %v", run, err)
		}
		res, err := s.guardResult(ctx, guard(run), r)
		if err != nil || !res.Admitted {
			t.Errorf("%s: admitted %v, err %v; want admitted", run, res.Admitted, err)
		}
		if in := must2(s.Intents(ctx, run))(t); len(in) != 1 || in[0].State != state.IntentInFlight {
			t.Errorf("%s holds %+v; want the one intent IN_FLIGHT", run, in)
		}
	}
}

// Guards of many runs made at the same time share calls on one Redis: the
// fleet's case, one agent per run, costs Redis fewer calls than steps.
func TestGuardsOfManyRunsShareCalls(t *testing.T) {
	s, _ := testStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const runs = 64
	for i := range runs {
		if _, err := s.Admit(ctx, state.AdmitRequest{RunID: fmt.Sprintf("run-%d", i), Actor: "t"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.rdb.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	start := make(chan struct{})
	errs := make(chan error, runs)
	for i := range runs {
		go func() {
			<-start
			res, err := s.Guard(ctx, state.GuardRequest{RunID: fmt.Sprintf("run-%d", i), Key: "k", ExplicitKey: true,
				Boundary: state.BoundaryHTTP, Method: "GET", Target: "https://api.example/x", LeaseOwner: "p",
				LeaseTTL: time.Minute, Actor: "p", NotAfter: time.Now().Add(time.Minute)})
			if err == nil && !res.Admitted {
				err = fmt.Errorf("run-%d refused: %s", i, res.Refusal)
			}
			errs <- err
		}()
	}
	close(start)
	for range runs {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	stats := must2(s.rdb.Info(ctx, "commandstats").Result())(t)
	calls := 0
	for _, line := range strings.Split(stats, "\n") {
		if rest, ok := strings.CutPrefix(line, "cmdstat_fcall:calls="); ok {
			calls, _ = strconv.Atoi(rest[:strings.IndexByte(rest, ',')])
		}
	}
	if calls == 0 || calls > runs/2 {
		t.Errorf("%d guards of %d runs took %d calls; want them to share calls (at most %d)", runs, runs, calls, runs/2)
	}
}

func TestByRunKeepsEachRunsOrder(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"", ""},
		{"a", "a"},
		{"aab", "aab"},
		{"aba", "aab"},
		{"abcabc", "aabbcc"},
		{"bba", "bba"},
		{"abbca", "aabbc"},
	} {
		var steps []*step
		for i, r := range tc.in {
			steps = append(steps, &step{run: string(r), op: strconv.Itoa(i)})
		}
		var got, order []string
		for _, st := range byRun(steps) {
			got = append(got, st.run)
			order = append(order, st.run+st.op)
		}
		if strings.Join(got, "") != tc.want {
			t.Errorf("byRun(%q) = %q, want %q", tc.in, strings.Join(got, ""), tc.want)
		}
		// Within a run, the steps keep the order they came in.
		last := map[string]int{}
		for _, st := range byRun(steps) {
			i, _ := strconv.Atoi(st.op)
			if p, ok := last[st.run]; ok && p > i {
				t.Errorf("byRun(%q) put step %d of %s after step %d: %v", tc.in, p, st.run, i, order)
			}
			last[st.run] = i
		}
	}
}

func must2[T any](v T, err error) func(testing.TB) T {
	return func(t testing.TB) T {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
}

// testStore opens a store on a redis-server of its own, and says where
// that server listens.
func testStore(t *testing.T) (*Store, string) {
	t.Helper()
	addr := testServer(t)
	s, err := Open(context.Background(), "redis://"+addr+"/0", Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s, addr
}

// testServer starts a redis-server for the package's own tests (the
// internal/redisserver helper imports nothing of ours, but the external
// test package owns the other helpers).
func testServer(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	cmd := exec.Command("redis-server", "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", t.TempDir())
	if err := cmd.Start(); err != nil {
		t.Fatalf("start redis-server: %v", err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err == nil {
			_ = c.Close()
			return addr
		}
		if time.Now().After(deadline) {
			t.Fatalf("redis-server on %s did not listen within 10s", addr)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A run with many intents in flight keeps its lease set a skiplist (the
// marker of prelude.lua), and the marker changes nothing else: it is never
// due, never an intent, and leaves with the last intent in flight, whether
// that ends by an outcome, by lease expiry or by the drain's deadline.
func TestManyLeasesKeepTheLeaseSetASkiplist(t *testing.T) {
	s, addr := testStore(t)
	admin := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { _ = admin.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	guards := func(prefix string, n int, ttl time.Duration) []BatchStep {
		var steps []BatchStep
		for i := range n {
			steps = append(steps, BatchStep{Code: 'g', Guard: state.GuardRequest{ObservedVersion: 1,
				Key: fmt.Sprintf("%s%02d", prefix, i), ExplicitKey: true, Boundary: state.BoundaryHTTP, Method: "GET",
				Target: "https://api.example/x", LeaseOwner: "p", LeaseTTL: ttl, Actor: "p", NotAfter: time.Now().Add(time.Minute)}})
		}
		return steps
	}
	finishes := func(keys []string) []BatchStep {
		var steps []BatchStep
		for _, k := range keys {
			steps = append(steps, BatchStep{Code: 'f', Finish: state.FinishRequest{Key: k, Attempt: 1,
				Outcome: state.IntentResponded, StatusCode: 200, Actor: "p"}})
		}
		return steps
	}
	leases := func(run string) string { return KeysOf(run)[4] }
	encoding := func(run string) string {
		t.Helper()
		enc, err := admin.ObjectEncoding(ctx, leases(run)).Result()
		if errors.Is(err, redis.Nil) {
			return "none"
		}
		if err != nil {
			t.Fatal(err)
		}
		return enc
	}
	admit := func(run string) {
		t.Helper()
		if _, err := s.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "t"}); err != nil {
			t.Fatal(err)
		}
	}
	unknown := func(run string, keys []string) {
		t.Helper()
		for _, k := range keys {
			if in := must2(s.Intent(ctx, run, k))(t); in.State != state.IntentUnknown {
				t.Errorf("%s of %s is %s, want UNKNOWN", k, run, in.State)
			}
		}
		if n := must2(admin.Exists(ctx, leases(run)).Result())(t); n != 0 {
			t.Errorf("%s keeps a lease set with nothing in flight: %v", run, must2(admin.ZRangeWithScores(ctx, leases(run), 0, -1).Result())(t))
		}
	}

	t.Run("outcomes", func(t *testing.T) {
		admit("busy")
		first := must2(s.CallBatch(ctx, "busy", guards("a", 15, time.Minute)))(t)
		if enc := encoding("busy"); enc != "listpack" {
			t.Fatalf("15 in flight: the set is a %s, want a listpack", enc)
		}
		last := must2(s.CallBatch(ctx, "busy", guards("b", 1, time.Minute)))(t)
		if enc := encoding("busy"); enc != "skiplist" {
			t.Fatalf("16 in flight: the set is a %s, want a skiplist", enc)
		}
		must2(s.CallBatch(ctx, "busy", finishes(first)))(t)
		if n := must2(admin.ZCard(ctx, leases("busy")).Result())(t); n != 2 {
			t.Fatalf("one in flight: %d members, want its lease and the marker", n)
		}
		must2(s.CallBatch(ctx, "busy", finishes(last)))(t)
		if n := must2(admin.Exists(ctx, leases("busy")).Result())(t); n != 0 {
			t.Fatal("nothing in flight, yet the lease set (its marker) is still there")
		}
	})

	t.Run("lease expiry", func(t *testing.T) {
		admit("lapsed")
		keys := must2(s.CallBatch(ctx, "lapsed", guards("k", 20, time.Millisecond)))(t)
		time.Sleep(20 * time.Millisecond)
		if _, err := s.Tick(ctx, state.TickRequest{RunID: "lapsed", Actor: "sweeper"}); err != nil {
			t.Fatal(err)
		}
		unknown("lapsed", keys)
	})

	t.Run("drain deadline", func(t *testing.T) {
		admit("drained")
		keys := must2(s.CallBatch(ctx, "drained", guards("k", 20, time.Minute)))(t)
		if _, err := s.Cancel(ctx, state.CancelRequest{RunID: "drained", Actor: "op", Reason: "stop", DrainTimeout: time.Millisecond}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
		run := must2(s.Tick(ctx, state.TickRequest{RunID: "drained", Actor: "sweeper"}))(t)
		if run.Status != state.StatusUnknown || run.Intents[state.IntentUnknown] != 20 || run.Intents[state.IntentInFlight] != 0 {
			t.Fatalf("after the drain deadline: %s with counts %v, want UNKNOWN with the 20 intents UNKNOWN", run.Status, run.Intents)
		}
		unknown("drained", keys)
	})
}

// A run with one effect in flight at a time keeps its lease in the row
// (field l), not in the lease set: no set is written for it. Every rule
// that reads leases must find the lone one as it finds the set's: an
// outcome lets it go (on the common path or under the general rules),
// its expiry turns it UNKNOWN, a drain's deadline cuts it, a renewal
// extends it; and once many are in flight it joins the set beside the
// marker, so that whichever intent leaves last takes the marker with it.
func TestALoneLeaseIsKeptInTheRow(t *testing.T) {
	s, addr := testStore(t)
	admin := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { _ = admin.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	leaseMark, leaseMarkAt := luaString(t, "LEASE_MARK"), luaInt(t, "LEASE_MARK_AT")
	guard := func(key string, ttl time.Duration) BatchStep {
		return BatchStep{Code: 'g', Guard: state.GuardRequest{ObservedVersion: 1, Key: key, ExplicitKey: true,
			Boundary: state.BoundaryHTTP, Method: "GET", Target: "https://api.example/x", LeaseOwner: "p", LeaseTTL: ttl,
			Actor: "p", NotAfter: time.Now().Add(time.Minute)}}
	}
	done := func(key string) BatchStep {
		return BatchStep{Code: 'f', Finish: state.FinishRequest{Key: key, Attempt: 1, Outcome: state.IntentResponded,
			StatusCode: 200, Actor: "p"}}
	}
	call := func(run string, steps ...BatchStep) {
		t.Helper()
		must2(s.CallBatch(ctx, run, steps))(t)
	}
	// leases is the run's lone lease and its lease set, marker included.
	leases := func(run string) string {
		t.Helper()
		set := must2(admin.ZRange(ctx, KeysOf(run)[4], 0, -1).Result())(t)
		for i, m := range set {
			if m == leaseMark {
				set[i] = "marker"
			}
		}
		slices.Sort(set)
		return fmt.Sprintf("lone %q, set %v", admin.HGet(ctx, KeysOf(run)[0], "l").Val(), set)
	}
	expect := func(run, want string) {
		t.Helper()
		if got := leases(run); got != want {
			t.Fatalf("%s: %s; want %s", run, got, want)
		}
	}
	states := func(run string, want map[state.IntentState]int) {
		t.Helper()
		r := must2(s.Get(ctx, run))(t)
		if fmt.Sprint(r.Intents) != fmt.Sprint(want) {
			t.Fatalf("%s counts %v; want %v", run, r.Intents, want)
		}
		var n int
		for _, in := range must2(s.Intents(ctx, run))(t) {
			n++
			if in.State == state.IntentInFlight && in.LeaseExpires.IsZero() {
				t.Errorf("%s: IN_FLIGHT %s has no lease", run, in.Key)
			}
		}
		if n == 0 {
			t.Fatalf("%s has no intents", run)
		}
	}
	admit := func(run string) {
		t.Helper()
		if _, err := s.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "t"}); err != nil {
			t.Fatal(err)
		}
	}

	t.Run("one request at a time", func(t *testing.T) {
		admit("serial")
		call("serial", guard("a", time.Minute))
		expect("serial", `lone "a", set []`)
		// One connection: the outcome rides with the next request's guard.
		call("serial", done("a"), guard("b", time.Minute))
		expect("serial", `lone "b", set []`)
		// A second request while the first is in flight goes to the set.
		call("serial", guard("c", time.Minute))
		expect("serial", `lone "b", set [c]`)
		call("serial", done("b"), done("c"))
		expect("serial", `lone "", set []`)
		states("serial", map[state.IntentState]int{state.IntentResponded: 3})
	})

	t.Run("an outcome under the general rules", func(t *testing.T) {
		admit("general")
		call("general", guard("a", time.Minute))
		// A stale guard leaves the common path: the outcome after it
		// runs under the general rules.
		stale := guard("stale", time.Minute)
		stale.Guard.ObservedVersion = 7
		keys, args := callArgs([]string{"general"}, []BatchStep{stale, done("a")})
		if err := s.exec(ctx, batchProgram, keys, args...).Err(); err != nil {
			t.Fatal(err)
		}
		expect("general", `lone "", set []`)
		states("general", map[state.IntentState]int{state.IntentCancelledBeforeDispatch: 1, state.IntentResponded: 1})
	})

	t.Run("lease expiry", func(t *testing.T) {
		admit("lapsed")
		call("lapsed", guard("a", time.Millisecond))
		time.Sleep(20 * time.Millisecond)
		must2(s.Tick(ctx, state.TickRequest{RunID: "lapsed", Actor: "sweeper"}))(t)
		expect("lapsed", `lone "", set []`)
		states("lapsed", map[state.IntentState]int{state.IntentUnknown: 1})
		// A second tick finds nothing more to expire.
		must2(s.Tick(ctx, state.TickRequest{RunID: "lapsed", Actor: "sweeper"}))(t)
		states("lapsed", map[state.IntentState]int{state.IntentUnknown: 1})
	})

	t.Run("renewal", func(t *testing.T) {
		admit("renewed")
		call("renewed", guard("a", 50*time.Millisecond))
		res := must2(s.Renew(ctx, state.RenewRequest{Owner: "p", TTL: time.Minute, Refs: []state.IntentRef{{RunID: "renewed", Key: "a"}}}))(t)
		if len(res.Renewed) != 1 {
			t.Fatalf("renewed %+v; want a", res)
		}
		expect("renewed", `lone "a", set []`)
		time.Sleep(100 * time.Millisecond)
		must2(s.Tick(ctx, state.TickRequest{RunID: "renewed", Actor: "sweeper"}))(t)
		states("renewed", map[state.IntentState]int{state.IntentInFlight: 1})
	})

	t.Run("drain deadline", func(t *testing.T) {
		admit("drained")
		call("drained", guard("a", time.Minute), guard("b", time.Minute))
		expect("drained", `lone "a", set [b]`)
		if _, err := s.Cancel(ctx, state.CancelRequest{RunID: "drained", Actor: "op", Reason: "stop", DrainTimeout: time.Millisecond}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
		run := must2(s.Tick(ctx, state.TickRequest{RunID: "drained", Actor: "sweeper"}))(t)
		if run.Status != state.StatusUnknown {
			t.Fatalf("after the drain deadline: %s; want UNKNOWN", run.Status)
		}
		expect("drained", `lone "", set []`)
		states("drained", map[state.IntentState]int{state.IntentUnknown: 2})
	})

	t.Run("many in flight, the lone one last out", func(t *testing.T) {
		admit("crowded")
		call("crowded", guard("lone", time.Minute))
		var more, outs []BatchStep
		for i := range leaseMarkAt {
			more = append(more, guard(fmt.Sprintf("k%02d", i), time.Minute))
			outs = append(outs, done(fmt.Sprintf("k%02d", i)))
		}
		call("crowded", more...)
		if got := leases("crowded"); !strings.HasPrefix(got, `lone "", set [k00`) || !strings.Contains(got, " lone marker]") {
			t.Fatalf("%d in flight: %s; want the lone lease in the set beside the marker", leaseMarkAt+1, got)
		}
		call("crowded", outs...)
		expect("crowded", `lone "", set [lone marker]`)
		call("crowded", done("lone"))
		expect("crowded", `lone "", set []`)
		states("crowded", map[state.IntentState]int{state.IntentResponded: leaseMarkAt + 1})
	})
}

// luaString and luaInt read a constant of prelude.lua (local NAME = 'text'
// or a number), so that a test names the value the programs use.
func luaString(t *testing.T, name string) string {
	t.Helper()
	m := regexp.MustCompile(`(?m)^local ` + name + ` = '([^']*)'$`).FindStringSubmatch(preludeLua)
	if m == nil {
		t.Fatalf("prelude.lua defines no text %s", name)
	}
	return m[1]
}

func luaInt(t *testing.T, name string) int {
	t.Helper()
	m := regexp.MustCompile(`(?m)^local ` + name + ` = (\d+)$`).FindStringSubmatch(preludeLua)
	if m == nil {
		t.Fatalf("prelude.lua defines no number %s", name)
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

// A guard's method, target and digest reach the programs escaped, a line
// each, as its record stores them; the general rules read them back
// before they decide, so a text with a newline or a backslash is recorded
// as it was sent, on either path.
func TestGuardTextsAreRecordedAsSentOnEitherPath(t *testing.T) {
	s, _ := testStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	odd := state.GuardRequest{ObservedVersion: 1, ExplicitKey: true, Boundary: state.BoundaryHTTP,
		Method: "PO\\ST", Target: "https://api.example/a\\b\nc\\n", BodyDigest: "d\n", LeaseOwner: "p", LeaseTTL: time.Minute,
		Actor: "p", NotAfter: time.Now().Add(time.Minute)}
	for _, path := range []string{"general", "common"} {
		run := "texts-" + path
		if _, err := s.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "t"}); err != nil {
			t.Fatal(err)
		}
		g := odd
		g.Key = "k"
		step := []BatchStep{{Code: 'g', Guard: g}}
		if path == "general" {
			oneByOne(ctx, t, s, run, step)
		} else {
			must2(s.CallBatch(ctx, run, step))(t)
		}
		in := must2(s.Intent(ctx, run, "k"))(t)
		if in.Method != odd.Method || in.Target != odd.Target || in.BodyDigest != odd.BodyDigest {
			t.Errorf("%s path recorded %q %q %q; want %q %q %q", path, in.Method, in.Target, in.BodyDigest,
				odd.Method, odd.Target, odd.BodyDigest)
		}
	}
}

// The programs' clock is TIME's answer in milliseconds, its text put
// together from TIME's own texts: the microseconds' first three of six
// digits, zeros included, follow the seconds.
func TestClockTextIsTheServersTimeInMilliseconds(t *testing.T) {
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: testServer(t)})
	t.Cleanup(func() { _ = c.Close() })
	for _, tc := range []struct{ usec, want string }{
		{"0", "1796098403000"},
		{"999", "1796098403000"},
		{"1000", "1796098403001"},
		{"5012", "1796098403005"},
		{"99999", "1796098403099"},
		{"100000", "1796098403100"},
		{"999999", "1796098403999"},
	} {
		got, err := c.Eval(ctx, preludeLua+"\nreturn ms_text(ARGV[1], ARGV[2])", nil, "1796098403", tc.usec).Text()
		if err != nil {
			t.Fatal(err)
		}
		if got != tc.want {
			t.Errorf("ms_text(1796098403, %s) = %s; want %s", tc.usec, got, tc.want)
		}
	}
}
