package lincheck_test

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
	"github.com/stopgate/stopgate/state/lincheck"
)

func op(client int, call, ret int64, in lincheck.Input, out lincheck.Output) porcupine.Operation {
	return porcupine.Operation{ClientId: client, Call: call, Return: ret, Input: in, Output: out}
}

var (
	guard  = lincheck.Input{Run: "r", Kind: lincheck.Guard, Key: "k"}
	cancel = lincheck.Input{Run: "r", Kind: lincheck.Cancel}
	read   = lincheck.Input{Run: "r", Kind: lincheck.Read}

	admitted   = lincheck.Output{Admitted: true, Status: state.StatusActive, Version: 1}
	refused    = lincheck.Output{Refusal: state.RefusalRunNotActive, Status: state.StatusCancelling, Version: 2}
	cancelled  = lincheck.Output{Changed: true, Status: state.StatusCancelling, Version: 2}
	unchanged  = lincheck.Output{Status: state.StatusCancelling, Version: 2}
	ambiguous  = lincheck.Output{Ambiguous: true, Err: "deadline"}
	readActive = func(n int) lincheck.Output {
		return lincheck.Output{Status: state.StatusActive, Version: 1, Effects: n}
	}
	readCancelled = func(n int) lincheck.Output {
		return lincheck.Output{Status: state.StatusCancelling, Version: 2, Effects: n}
	}
)

// The model itself, on histories small enough to judge by hand.
func TestModel(t *testing.T) {
	const never = 1 << 40 // the return time of an ambiguous operation
	for _, tc := range []struct {
		name string
		ops  []porcupine.Operation
		want porcupine.CheckResult
	}{
		{"GuardOverlappingTheCancelMayBeAdmitted", []porcupine.Operation{
			op(0, 0, 10, cancel, cancelled), op(1, 5, 15, guard, admitted), op(2, 20, 21, read, readCancelled(1)),
		}, porcupine.Ok},
		{"GuardCalledAfterTheCancelReturnedIsNeverAdmitted", []porcupine.Operation{
			op(0, 0, 10, cancel, cancelled), op(1, 11, 15, guard, admitted),
		}, porcupine.Illegal},
		{"GuardRefusedBeforeAnyCancelIsIllegal", []porcupine.Operation{
			op(1, 0, 5, guard, refused), op(0, 6, 10, cancel, cancelled),
		}, porcupine.Illegal},
		{"AnAdmissionAppearingAfterAReadOfTheCancelledRowIsIllegal", []porcupine.Operation{
			op(1, 0, 30, guard, admitted), op(0, 1, 2, cancel, cancelled),
			op(2, 3, 4, read, readCancelled(0)), op(2, 31, 32, read, readCancelled(1)),
		}, porcupine.Illegal},
		{"SecondCancelChangesNothing", []porcupine.Operation{
			op(0, 0, 1, cancel, cancelled), op(1, 2, 3, cancel, unchanged),
		}, porcupine.Ok},
		{"CancellingTwiceIsIllegal", []porcupine.Operation{
			op(0, 0, 1, cancel, cancelled), op(1, 2, 3, cancel, lincheck.Output{Changed: true, Status: state.StatusCancelling, Version: 3}),
		}, porcupine.Illegal},
		{"TheVersionNeverGoesBack", []porcupine.Operation{
			op(0, 0, 1, cancel, cancelled), op(1, 2, 3, read, readActive(0)),
		}, porcupine.Illegal},
		{"AmbiguousCancelMayHaveHappened", []porcupine.Operation{
			op(0, 0, never, cancel, ambiguous), op(1, 5, 6, guard, refused), op(1, 7, 8, read, readCancelled(0)),
		}, porcupine.Ok},
		{"AmbiguousCancelMayNotHaveHappened", []porcupine.Operation{
			op(0, 0, never, cancel, ambiguous), op(1, 5, 6, guard, admitted), op(1, 7, 8, read, readActive(1)),
		}, porcupine.Ok},
		{"AmbiguousGuardMayBeAdmittedLate", []porcupine.Operation{
			op(1, 0, never, guard, ambiguous), op(2, 1, 2, read, readActive(0)), op(2, 3, 4, read, readActive(1)),
		}, porcupine.Ok},
		{"AmbiguousGuardIsNeverAdmittedAfterTheCancel", []porcupine.Operation{
			op(0, 0, 1, cancel, cancelled), op(1, 2, never, guard, ambiguous), op(2, 3, 4, read, readCancelled(1)),
		}, porcupine.Illegal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := porcupine.CheckOperationsTimeout(lincheck.Model(), tc.ops, 10*time.Second); got != tc.want {
				t.Fatalf("check: %s, want %s", got, tc.want)
			}
		})
	}
}

// readThenWrite is the bug the check is for: a guard that reads the row and
// then, in a second step, writes the intent without checking again, so a
// cancel can commit in between. It answers with the row it read, as such a
// guard would.
type readThenWrite struct {
	state.Store
	gap time.Duration
}

func (s readThenWrite) Guard(ctx context.Context, req state.GuardRequest) (state.GuardResult, error) {
	r, err := s.Get(ctx, req.RunID)
	if err != nil {
		return state.GuardResult{}, err
	}
	if r.Status != state.StatusActive || (req.ObservedVersion != 0 && req.ObservedVersion != r.CancelVersion) {
		return s.Store.Guard(ctx, req)
	}
	time.Sleep(s.gap) // a real gap is shorter; this one makes the test quick
	req.AllowCancelling = true
	res, err := s.Store.Guard(ctx, req)
	res.Run = r
	return res, err
}

func openFile(t *testing.T) state.Store {
	t.Helper()
	s, err := filestore.Open(filepath.Join(t.TempDir(), "lin.db"), filestore.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// TestReadThenWriteGuardIsCaught proves the check can fail: the same
// histories that the real stores pass are recorded through a guard made
// into a read followed by a write, and porcupine finds one that is not
// linearizable.
func TestReadThenWriteGuardIsCaught(t *testing.T) {
	store := readThenWrite{Store: openFile(t), gap: 2 * time.Millisecond}
	const maxSeeds = 20
	for seed := range maxSeeds {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		h, err := lincheck.Record(ctx, []state.Store{store}, "bug"+string(rune('a'+seed)), lincheck.Config{Seed: int64(seed), Ambiguous: -1})
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		if res, _ := lincheck.Check(h, 30*time.Second); res == porcupine.Illegal {
			t.Logf("lincheck: planted read-then-write guard caught at seed %d of %d (%d operations, %d admitted)", seed, maxSeeds, len(h.Ops), h.Admitted)
			return
		}
	}
	t.Fatalf("the read-then-write guard passed %d histories: the check cannot tell it from an atomic one", maxSeeds)
}
