package filestore

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/statetest"
)

// Steps that arrive while a commit is under way share the next one; a step
// that fails after writing rolls that shared transaction back, and the
// others are then committed one by one: none is lost, none applied twice,
// and the failed step leaves nothing behind.
func TestGroupCommitIsolatesAFailedStep(t *testing.T) {
	s, err := Open(filepath.Join(t.TempDir(), "s.db"), Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	put := func(t *txn, k string) error {
		b, err := t.tx.CreateBucketIfNotExists([]byte("test"))
		if err != nil {
			return err
		}
		return t.put(b, []byte(k), []byte("1"))
	}
	runs := map[string]int{}
	var mu sync.Mutex
	step := func(k string, fail bool) func(t *txn) error {
		return func(t *txn) error {
			mu.Lock()
			runs[k]++
			mu.Unlock()
			if err := put(t, k); err != nil {
				return err
			}
			if fail {
				return errors.New("failed after writing")
			}
			return nil
		}
	}

	// The first step holds its commit until the others are queued.
	queued := func() int {
		s.w.mu.Lock()
		defer s.w.mu.Unlock()
		return len(s.w.queue)
	}
	var wg sync.WaitGroup
	errs := map[string]error{}
	do := func(k string, fn func(t *txn) error) {
		wg.Go(func() {
			err := s.update(ctx, "test", fn)
			mu.Lock()
			errs[k] = err
			mu.Unlock()
		})
	}
	started := make(chan struct{})
	do("a", func(t *txn) error {
		close(started)
		deadline := time.Now().Add(10 * time.Second)
		for queued() < 3 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		return step("a", false)(t)
	})
	<-started // a's commit is under way
	do("b", step("b", false))
	do("c", step("c", true))
	do("d", step("d", false))
	wg.Wait()

	if errs["a"] != nil || errs["b"] != nil || errs["d"] != nil {
		t.Fatalf("steps that did not fail got errors: %v", errs)
	}
	if errs["c"] == nil || errors.Is(errs["c"], state.ErrUnavailable) {
		t.Fatalf("the failed step got %v, want its own error", errs["c"])
	}
	err = s.db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket([]byte("test"))
		for k, want := range map[string]bool{"a": true, "b": true, "c": false, "d": true} {
			if got := b != nil && b.Get([]byte(k)) != nil; got != want {
				t.Errorf("key %s written: %v, want %v", k, got, want)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// b, c and d went into one commit (c ran there, and again alone after
	// the rollback); a step queued behind c in it never ran there.
	if runs["a"] != 1 || runs["c"] != 2 || runs["b"] < 1 || runs["b"] > 2 || runs["d"] < 1 || runs["d"] > 2 {
		t.Fatalf("step runs %v: want a once, c twice (shared, then alone), b and d once or twice", runs)
	}
}

// Steps of one commit on one run share its row (read once, written once):
// each sees what the steps before it saved, and a step that changes the
// row and then fails without writing leaves no trace of its change.
func TestGroupCommitSharesTheRowOfARun(t *testing.T) {
	s, err := Open(filepath.Join(t.TempDir(), "s.db"), Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	if _, err := s.Admit(ctx, state.AdmitRequest{RunID: "r", Actor: "t"}); err != nil {
		t.Fatal(err)
	}
	queued := func() int {
		s.w.mu.Lock()
		defer s.w.mu.Unlock()
		return len(s.w.queue)
	}
	var wg sync.WaitGroup
	started := make(chan struct{})
	wg.Go(func() {
		_ = s.update(ctx, "hold", func(t *txn) error {
			close(started)
			deadline := time.Now().Add(10 * time.Second)
			for queued() < 3 && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
			return nil
		})
	})
	<-started
	var mu sync.Mutex
	var counts []int
	for _, key := range []string{"k1", "k2"} {
		wg.Go(func() {
			g, err := s.Guard(ctx, state.GuardRequest{RunID: "r", Key: key, ExplicitKey: true, Boundary: state.BoundaryHTTP,
				LeaseOwner: "p", LeaseTTL: time.Minute, Actor: "p"})
			if err != nil || !g.Admitted {
				t.Errorf("guard %s: %+v %v", key, g, err)
				return
			}
			mu.Lock()
			counts = append(counts, g.Run.Intents[state.IntentInFlight])
			mu.Unlock()
		})
	}
	wg.Go(func() {
		err := s.update(ctx, "meddle", func(t *txn) error {
			r, _, err := t.run("r")
			if err != nil {
				return err
			}
			r.row.Status = state.StatusCompleted
			r.count(state.IntentInFlight, 99)
			return errors.New("refused before writing")
		})
		if err == nil {
			t.Error("the meddling step succeeded")
		}
	})
	wg.Wait()

	slices.Sort(counts)
	if !slices.Equal(counts, []int{1, 2}) {
		t.Fatalf("the guards saw %v intents in flight, want 1 and 2", counts)
	}
	r, err := s.Get(ctx, "r")
	if err != nil || r.Status != state.StatusActive || r.Intents[state.IntentInFlight] != 2 || len(r.Intents) != 1 {
		t.Fatalf("row after the commit: %+v %v", r, err)
	}
}

// A read waits for an outcome queued by FinishLater even once that outcome
// has left the queue for a commit still under way: a bbolt read begun
// before the commit ends would not see it.
func TestReadWaitsForAnOutcomeInTheCommitUnderWay(t *testing.T) {
	s, err := Open(filepath.Join(t.TempDir(), "s.db"), Options{Logger: slog.New(slog.DiscardHandler), OutcomeDelay: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	statetest.ReadWaitsForAQueuedOutcome(t, s, func() func() {
		// A step behind the outcome leads a commit that carries both, and
		// holds it.
		inCommit, release := make(chan struct{}), make(chan struct{})
		held := make(chan struct{})
		go func() {
			defer close(held)
			_ = s.update(context.Background(), "hold", func(*txn) error {
				close(inCommit)
				<-release
				return nil
			})
		}()
		<-inCommit
		return func() { close(release); <-held }
	})
}
