package proxy

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/telemetry"
)

// TestFlowSetHoldsWhatIsOpenAndCutsItByRun: the registry holds each open
// flow once, whatever order flows open and close in, forgets a run whose
// last flow closed, and a row cuts every open flow of its run and no other.
func TestFlowSetHoldsWhatIsOpenAndCutsItByRun(t *testing.T) {
	s := newFlowSet(telemetry.New(telemetry.Options{}).Metrics())
	open := func(run string) (*flow, context.Context) {
		ctx, cut := context.WithCancelCause(context.Background())
		t.Cleanup(func() { cut(nil) })
		f := &flow{id: identity{run: run}, method: "POST", cut: cut}
		s.add(f)
		s.add(f) // twice is once
		return f, ctx
	}
	holds := func(want ...string) {
		t.Helper()
		got := s.Runs()
		slices.Sort(got)
		if !slices.Equal(got, want) {
			t.Fatalf("holds runs %v, want %v", got, want)
		}
		for _, run := range want {
			if !s.Holds(run) {
				t.Fatalf("does not hold %s", run)
			}
		}
	}
	a1, _ := open("a")
	a2, _ := open("a")
	a3, _ := open("a")
	b1, _ := open("b")
	holds("a", "b")
	for _, f := range []*flow{a2, a2, a3} { // the middle one, twice, then the first
		s.remove(f)
		holds("a", "b")
	}
	s.remove(a1)
	holds("b")
	s.remove(b1)
	holds()

	_, c1 := open("c")
	_, c2 := open("c")
	_, c3 := open("c")
	_, d1 := open("d")
	s.Enforce(state.Run{ID: "c", Status: state.StatusCancelled, CancelledAt: time.Now()})
	for i, ctx := range []context.Context{c1, c2, c3} {
		if cutOf(ctx) == nil {
			t.Errorf("flow %d of the cancelled run was not cut", i+1)
		}
	}
	if cutOf(d1) != nil {
		t.Error("a flow of another run was cut")
	}
	s.cutAll("shutdown")
	if ce := cutOf(d1); ce == nil || ce.reason != "shutdown" {
		t.Errorf("cut all left %v", ce)
	}
}
