package redisstore_test

import (
	"context"
	"errors"
	"reflect"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
	"github.com/stopgate/stopgate/state/statetest"
)

// forgetTotals makes the store's data look written before totals were
// kept: no totals, no mark of a walk done, no row counted.
func forgetTotals(t *testing.T, addr string, runs []string) {
	t.Helper()
	admin := raw(t, addr)
	ctx := tctx(t)
	if err := admin.Del(ctx, "sg:totals", "sg:{index}:tallied").Err(); err != nil {
		t.Fatal(err)
	}
	for _, id := range runs {
		if err := admin.HDel(ctx, redisstore.KeysOf(id)[0], "g").Err(); err != nil {
			t.Fatal(err)
		}
	}
}

func wantTotalsOfRows(t *testing.T, s state.Store, when string) state.Totals {
	t.Helper()
	got, err := s.Totals(context.Background())
	if err != nil {
		t.Fatalf("%s: %v", when, err)
	}
	if want := statetest.TotalsOfRows(t, s, nil); !reflect.DeepEqual(got, want) {
		t.Fatalf("%s: totals %+v, want (from the rows) %+v", when, got, want)
	}
	return got
}

// A store written before totals were kept is counted once, in the
// background, by the walk Open starts; until it is done the totals are
// unavailable, not wrong.
func TestRunsStoredBeforeTotalsAreCountedByTheWalk(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	s := open(t, srv.URL(), redisstore.Options{})
	runs := statetest.SomeRuns(t, s)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	forgetTotals(t, srv.Addr(), runs)

	s = open(t, srv.URL(), redisstore.Options{})
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := s.Totals(tctx(t))
		if err == nil {
			break
		}
		if !errors.Is(err, state.ErrUnavailable) || time.Now().After(deadline) {
			t.Fatalf("totals while the walk counts: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	got := wantTotalsOfRows(t, s, "after the walk")
	if got.Runs[state.StatusUnknown] != 1 || got.UnknownIntents != 2 {
		t.Fatalf("totals %+v, want the UNKNOWN run and its two effects", got)
	}
	must(s.Cancel(tctx(t), state.CancelRequest{RunID: "old-active", Actor: "op", DrainTimeout: time.Hour}))(t)
	wantTotalsOfRows(t, s, "a counted run cancelled")
}

// A step that changes a total of a run never counted (its walk not done,
// or a row an older stopgate wrote) counts the row as it stands first, in
// the same call: the totals stay those of the rows.
func TestAStepCountsItsUncountedRunFirst(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	s := open(t, srv.URL(), redisstore.Options{})
	statetest.SomeRuns(t, s)
	before := wantTotalsOfRows(t, s, "written")
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	// old-unknown never counted: its row lacks g, the totals lack it.
	admin := raw(t, srv.Addr())
	ctx := tctx(t)
	if err := admin.HDel(ctx, redisstore.KeysOf("old-unknown")[0], "g").Err(); err != nil {
		t.Fatal(err)
	}
	if err := admin.HIncrBy(ctx, "sg:totals", "runs:UNKNOWN", -1).Err(); err != nil {
		t.Fatal(err)
	}
	if err := admin.HIncrBy(ctx, "sg:totals", "intents:UNKNOWN", -2).Err(); err != nil {
		t.Fatal(err)
	}

	s = open(t, srv.URL(), redisstore.Options{})
	if _, err := s.Resolve(ctx, state.ResolveRequest{RunID: "old-unknown", Key: "u1", Applied: true, Source: "operator", Actor: "op"}); err != nil {
		t.Fatal(err)
	}
	got, err := s.Totals(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := statetest.TotalsOfRows(t, s, map[string]int64{state.ResolutionOperator: 1})
	if !reflect.DeepEqual(got, want) || got.UnknownIntents != before.UnknownIntents-1 {
		t.Fatalf("totals after a step on an uncounted run %+v, want (from the rows) %+v", got, want)
	}
	if v := must(admin.HGet(ctx, redisstore.KeysOf("old-unknown")[0], "g").Result())(t); v != "1" {
		t.Fatalf("the row's counted mark after the step: %q", v)
	}
}
