package filestore_test

import (
	"context"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/statetest"
)

// A file written before the store kept totals (no totals bucket) is
// counted once at Open, row by row, and its totals then follow every step.
func TestAFileWrittenBeforeTotalsIsCountedAtOpen(t *testing.T) {
	path := filepath.Join(t.TempDir(), "stopgate.db")
	s := open(t, path)
	statetest.SomeRuns(t, s)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Update(func(tx *bolt.Tx) error { return tx.DeleteBucket([]byte("totals")) }); err != nil {
		t.Fatalf("dropping the totals, as an older file has none: %v", err)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}

	s = open(t, path)
	ctx := context.Background()
	check := func(when string) {
		t.Helper()
		got, err := s.Totals(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if want := statetest.TotalsOfRows(t, s, nil); !reflect.DeepEqual(got, want) {
			t.Fatalf("%s: totals %+v, want (from the rows) %+v", when, got, want)
		}
		if got.Runs[state.StatusUnknown] != 1 || got.UnknownIntents != 2 {
			t.Fatalf("%s: totals %+v, want the UNKNOWN run and its two effects", when, got)
		}
	}
	check("reopened")
	if _, err := s.Cancel(ctx, state.CancelRequest{RunID: "old-active", Actor: "op", DrainTimeout: time.Hour}); err != nil {
		t.Fatal(err)
	}
	check("a run counted at Open, cancelled")
}
