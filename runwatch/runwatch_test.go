package runwatch_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/runwatch"
	"github.com/stopgate/stopgate/state"
)

// holder records the rows it is handed for the runs it holds.
type holder struct {
	mu   sync.Mutex
	runs []string
	got  []state.Run
}

func (h *holder) Holds(run string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Contains(h.runs, run)
}

func (h *holder) Runs() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.runs)
}

func (h *holder) Enforce(row state.Run) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.got = append(h.got, row)
}

func (h *holder) last(run string) (state.Run, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for i := len(h.got) - 1; i >= 0; i-- {
		if h.got[i].ID == run {
			return h.got[i], true
		}
	}
	return state.Run{}, false
}

func (h *holder) count(run string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, r := range h.got {
		if r.ID == run {
			n++
		}
	}
	return n
}

func admitAndCancel(t *testing.T, s state.Store, run string, drain time.Duration) {
	t.Helper()
	if _, err := s.Admit(context.Background(), state.AdmitRequest{RunID: run, Actor: "t"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Cancel(context.Background(), state.CancelRequest{RunID: run, Actor: "t", DrainTimeout: drain}); err != nil {
		t.Fatal(err)
	}
}

// TestOneBroadcastReachesEveryHolder: a cancel (here, the tombstone of a
// run never admitted) reaches each holder of the run through the one
// subscription, long before the re-check interval; a holder that does not
// hold the run is not bothered.
func TestOneBroadcastReachesEveryHolder(t *testing.T) {
	store := testkit.FileStore(t)
	w := runwatch.New(store, runwatch.Options{Interval: time.Hour, Logger: testkit.Logger()})
	a, b, other := &holder{}, &holder{}, &holder{runs: []string{"x"}}
	for _, h := range []*holder{a, b, other} {
		w.Add(h)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx)
	// The subscription is made as Run starts; a cancel before it would
	// only be seen by the re-check, an hour away, and cancelling that run
	// again broadcasts nothing: each try cancels a run never seen before.
	try := 0
	var run string
	testkit.Eventually(t, 5*time.Second, "a cancel reaches both holders", func() bool {
		try++
		run = fmt.Sprintf("r-%d", try)
		for _, h := range []*holder{a, b} {
			h.mu.Lock()
			h.runs = append(h.runs, run)
			h.mu.Unlock()
		}
		_, _ = store.Cancel(context.Background(), state.CancelRequest{RunID: run, Actor: "t", DrainTimeout: time.Minute})
		time.Sleep(50 * time.Millisecond)
		ra, okA := a.last(run)
		rb, okB := b.last(run)
		return okA && okB && ra.Status == state.StatusCancelled && rb.Status == state.StatusCancelled
	})
	if other.count(run) != 0 {
		t.Fatalf("a holder of another run was handed %s's row", run)
	}
}

// TestReCheckFindsWhatNoBroadcastSaid: a run that moves on without a
// broadcast (the sweeper, or a broadcast lost) reaches its holders at the
// next re-check.
func TestReCheckFindsWhatNoBroadcastSaid(t *testing.T) {
	store := testkit.FileStore(t)
	admitAndCancel(t, store, "quiet", time.Minute)
	w := runwatch.New(store, runwatch.Options{Interval: 50 * time.Millisecond, Logger: testkit.Logger()})
	h := &holder{runs: []string{"quiet"}}
	w.Add(h)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx)
	testkit.Eventually(t, 5*time.Second, "the re-check hands over the cancelled row", func() bool {
		r, ok := h.last("quiet")
		return ok && r.Status == state.StatusCancelling && r.CancelVersion == 2
	})
}

// TestDeadlineIsReadAgain: a holder handed a draining row is handed it
// again just after the drain deadline, without waiting for the re-check.
func TestDeadlineIsReadAgain(t *testing.T) {
	store := testkit.FileStore(t)
	if _, err := store.Admit(context.Background(), state.AdmitRequest{RunID: "d", Actor: "t"}); err != nil {
		t.Fatal(err)
	}
	if _, err := store.Guard(context.Background(), state.GuardRequest{RunID: "d", Key: "k", ExplicitKey: true, Boundary: state.BoundaryHTTP, LeaseTTL: time.Hour, LeaseOwner: "t"}); err != nil {
		t.Fatal(err)
	}
	w := runwatch.New(store, runwatch.Options{Interval: time.Hour, Logger: testkit.Logger()})
	h := &holder{runs: []string{"d"}}
	w.Add(h)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx)
	// The draining row reaches the holder by a check, not the broadcast: a
	// cancel made before Run has subscribed would be heard by nobody, and
	// the re-check is an hour away.
	if _, err := store.Cancel(context.Background(), state.CancelRequest{RunID: "d", Actor: "t", DrainTimeout: 200 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	w.Check(ctx, "d")
	first := h.count("d")
	if first == 0 {
		t.Fatal("the check did not hand the row to its holder")
	}
	testkit.Eventually(t, 5*time.Second, "the row is read again after its drain deadline", func() bool {
		r, _ := h.last("d")
		return h.count("d") > first && time.Now().After(r.DrainDeadline)
	})
}

// TestObserveHandsARowOver: a row already read elsewhere (a refused
// guard) reaches the holders without a store read.
func TestObserveHandsARowOver(t *testing.T) {
	w := runwatch.New(testkit.FileStore(t), runwatch.Options{Interval: time.Hour})
	h := &holder{runs: []string{"o"}}
	w.Add(h)
	w.Observe(context.Background(), state.Run{ID: "o", Status: state.StatusCancelling, CancelVersion: 2})
	w.Observe(context.Background(), state.Run{ID: "not-held", Status: state.StatusCancelling})
	if r, ok := h.last("o"); !ok || r.CancelVersion != 2 || h.count("not-held") != 0 {
		t.Fatalf("observed rows handed over: %+v", h.got)
	}
}

// TestHeardIsToldOfEveryCancelHeldOrNot: the broadcast names every
// cancelled run to Heard, also those nothing here holds (the sweeper
// follows each to the end of its drain).
func TestHeardIsToldOfEveryCancelHeldOrNot(t *testing.T) {
	store := testkit.FileStore(t)
	var mu sync.Mutex
	heard := map[string]bool{}
	w := runwatch.New(store, runwatch.Options{Interval: time.Hour, Logger: testkit.Logger(), Heard: func(run string) {
		mu.Lock()
		defer mu.Unlock()
		heard[run] = true
	}})
	held := &holder{}
	w.Add(held)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx)
	// A cancel made before the subscription is not broadcast to it: each
	// try cancels runs never seen before (tombstones, each broadcast).
	try := 0
	testkit.Eventually(t, 5*time.Second, "a held and a free cancel heard", func() bool {
		try++
		h, f := fmt.Sprintf("held-%d", try), fmt.Sprintf("free-%d", try)
		held.mu.Lock()
		held.runs = append(held.runs, h)
		held.mu.Unlock()
		for _, run := range []string{h, f} {
			if _, err := store.Cancel(context.Background(), state.CancelRequest{RunID: run, Actor: "t"}); err != nil {
				t.Fatal(err)
			}
		}
		time.Sleep(50 * time.Millisecond)
		mu.Lock()
		defer mu.Unlock()
		return heard[h] && heard[f]
	})
}
