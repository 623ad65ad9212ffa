package filestore_test

import (
	"path/filepath"
	"testing"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/lincheck"
)

// TestLinearizable records histories of concurrent guards, cancels and
// reads through one embedded store (one process holds the file) and checks
// them against the model of a run (package lincheck).
func TestLinearizable(t *testing.T) {
	lincheck.Run(t, "filestore", lincheck.Seeds(t, 8), lincheck.Config{}, func(t *testing.T) []state.Store {
		s := open(t, filepath.Join(t.TempDir(), "stopgate.db"))
		t.Cleanup(func() { _ = s.Close() })
		return []state.Store{s}
	})
}
