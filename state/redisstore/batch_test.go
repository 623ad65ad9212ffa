package redisstore

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/state"
)

// generalRules runs one step under the general rules of steps.lua alone,
// never the common path batch.lua writes out: what the batch is compared
// with. A test-only script, not part of the library.
var generalRules = newProgram("general", `
if ARGV[2] == 'g' then
  return {op_guard(2)}
end
return {op_finish(2)}
`)

// A batch is one call for any number of steps of a run, with the common
// path written out. It must give every step the answer, and leave the
// record, that the general rules give the same steps one by one: this test
// sends one sequence both ways, on two runs, and compares.
func TestBatchAnswersAsStepsOneByOne(t *testing.T) {
	addr := testServer(t)
	s, err := Open(context.Background(), "redis://"+addr+"/0", Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	guard := func(run, key string, explicit bool) state.GuardRequest {
		return state.GuardRequest{RunID: run, ObservedVersion: 1, Key: key, ExplicitKey: explicit, Boundary: state.BoundaryHTTP,
			Method: "POST", Target: "https://api.example/x", BodyDigest: "d", LeaseOwner: "p", LeaseTTL: time.Minute, Actor: "p",
			NotAfter: time.Now().Add(time.Minute)}
	}
	for _, run := range []string{"one-by-one", "batched"} {
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
	type step struct {
		code byte
		g    state.GuardRequest
		f    state.FinishRequest
	}
	steps := []step{
		{code: 'g', g: guard("", "base", false)},
		{code: 'f', f: state.FinishRequest{Key: "a", Attempt: 1, Outcome: state.IntentResponded, StatusCode: 200, Actor: "p"}},
		{code: 'g', g: late},
		{code: 'g', g: guard("", "new", true)},
		{code: 'f', f: state.FinishRequest{Key: "b", Attempt: 1, Outcome: state.IntentNotApplied, Source: state.SourceSafeMethod, Reason: "cut", Actor: "p"}},
		{code: 'g', g: guard("", "base", false)},                                                            // the same derived base again: base.2
		{code: 'f', f: state.FinishRequest{Key: "a", Attempt: 1, Outcome: state.IntentNotSent, Actor: "p"}}, // not in flight any more
		{code: 'g', g: guard("", "seen", true)},                                                             // in progress
		{code: 'g', g: stale},
		{code: 'f', f: state.FinishRequest{Key: "nothing", Attempt: 1, Outcome: state.IntentResponded, Actor: "p"}},
		{code: 'g', g: guard("", "after", true)},
	}
	answer := func(run string, r reply, st step) string {
		if st.code == 'g' {
			req := st.g
			req.RunID = run
			res, err := s.guardResult(ctx, req, r)
			return strings.ReplaceAll(fmt.Sprintf("%v %s %s %s %d %v", res.Admitted, res.Refusal, res.Intent.Key, res.Intent.State, res.Intent.Attempts, err), run, "RUN")
		}
		req := st.f
		req.RunID = run
		in, err := finishResult(req, r)
		return strings.ReplaceAll(fmt.Sprintf("%s %s %d %s %v", in.Key, in.State, in.Attempts, in.Source, err), run, "RUN")
	}
	argsOf := func(run string, st step) []any {
		if st.code == 'g' {
			req := st.g
			req.RunID = run
			return guardArgs(req)
		}
		req := st.f
		req.RunID = run
		return finishArgs(req)
	}

	var one []string
	for _, st := range steps {
		args := append([]any{1, string(st.code)}, argsOf("one-by-one", st)...)
		v, err := generalRules.script.Run(ctx, s.scripter, keysOf("one-by-one").list(), args...).Result()
		if err != nil {
			t.Fatal(err)
		}
		r, err := parseReply(v.([]any)[0])
		if err != nil {
			t.Fatal(err)
		}
		one = append(one, answer("one-by-one", r, st))
	}
	args := []any{len(steps)}
	for _, st := range steps {
		args = append(args, string(st.code))
		args = append(args, argsOf("batched", st)...)
	}
	v, err := s.exec(ctx, batchProgram, keysOf("batched").list(), args...).Result()
	if err != nil {
		t.Fatal(err)
	}
	for i, x := range v.([]any) {
		r, err := parseReply(x)
		if err != nil {
			t.Fatal(err)
		}
		if got := answer("batched", r, steps[i]); got != one[i] {
			t.Errorf("step %d: batched %q, one by one %q", i, got, one[i])
		}
	}

	rowA := must2(s.Get(ctx, "one-by-one"))(t)
	rowB := must2(s.Get(ctx, "batched"))(t)
	if fmt.Sprint(rowA.Intents) != fmt.Sprint(rowB.Intents) || rowA.Status != rowB.Status {
		t.Errorf("rows differ: one by one %+v, batched %+v", rowA, rowB)
	}
	insA := must2(s.Intents(ctx, "one-by-one"))(t)
	insB := must2(s.Intents(ctx, "batched"))(t)
	if len(insA) != len(insB) {
		t.Fatalf("%d intents one by one, %d batched", len(insA), len(insB))
	}
	for i := range insA {
		a, b := insA[i], insB[i]
		if a.Key != b.Key || a.State != b.State || a.Attempts != b.Attempts || a.Refusals != b.Refusals || a.Reason != b.Reason || a.Source != b.Source || a.StatusCode != b.StatusCode {
			t.Errorf("intent %d: one by one %+v, batched %+v", i, a, b)
		}
	}
	evA := must2(s.Events(ctx, "one-by-one"))(t)
	evB := must2(s.Events(ctx, "batched"))(t)
	if len(evA) != len(evB) {
		t.Fatalf("%d events one by one, %d batched", len(evA), len(evB))
	}
	// The events of the batch's common steps (the first five with an
	// event, up to the outcome for a record no longer in flight) are one
	// entry of the audit stream; one by one, each is an entry of its own.
	lenA := must2(s.rdb.XLen(ctx, keysOf("one-by-one").events).Result())(t)
	lenB := must2(s.rdb.XLen(ctx, keysOf("batched").events).Result())(t)
	if lenA-lenB != 4 {
		t.Errorf("%d stream entries one by one, %d batched: want the five common steps' events in one entry", lenA, lenB)
	}
	for i := range evA {
		a, b := evA[i], evB[i]
		if a.Kind != b.Kind || a.From != b.From || a.To != b.To || a.Intent != b.Intent || a.Reason != b.Reason || a.Version != b.Version {
			t.Errorf("event %d: one by one %+v, batched %+v", i, a, b)
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
