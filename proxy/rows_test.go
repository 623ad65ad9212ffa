package proxy

import (
	"testing"

	"github.com/stopgate/stopgate/state"
)

// TestSeenRowsForgetsTheRunLeastRecentlyUsed: the memory of runs seen
// leave ACTIVE is bounded, and what it forgets when full is the run learned
// or asked about longest ago, never the one just asked about; a row never
// goes back to an earlier version.
func TestSeenRowsForgetsTheRunLeastRecentlyUsed(t *testing.T) {
	s := newSeenRows(2)
	row := func(id string, v int64) state.Run {
		return state.Run{ID: id, Status: state.StatusCancelling, CancelVersion: v}
	}
	s.learn(row("a", 2))
	s.learn(row("b", 2))
	if _, ok := s.get("a"); !ok { // a is now the most recently used
		t.Fatal("a forgotten with room to spare")
	}
	s.learn(row("c", 2))
	if _, ok := s.get("b"); ok {
		t.Error("b, used longest ago, is still kept past the bound")
	}
	for _, id := range []string{"a", "c"} {
		if _, ok := s.get(id); !ok {
			t.Errorf("%s forgotten instead of b", id)
		}
	}
	s.learn(row("a", 3))
	s.learn(row("a", 2))
	if got, _ := s.get("a"); got.CancelVersion != 3 {
		t.Errorf("a went back to version %d", got.CancelVersion)
	}
	s.learn(state.Run{ID: "d", Status: state.StatusActive, CancelVersion: 1})
	if _, ok := s.get("d"); ok {
		t.Error("an ACTIVE row was kept")
	}
}
