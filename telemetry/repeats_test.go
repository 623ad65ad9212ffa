package telemetry

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// TestRepeatedWarningsAreSaidOnceAWindow: a warning logged every second
// (a loop retrying a store that is down) passes once, then once a window
// with the count held back; another component's, or another message, is
// its own kind; lines below warn all pass.
func TestRepeatedWarningsAreSaidOnceAWindow(t *testing.T) {
	var buf bytes.Buffer
	clock := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	h := Repeats(slog.NewTextHandler(&buf, nil), 30*time.Second).(*repeats)
	h.seen.now = func() time.Time { return clock }
	log := slog.New(h)
	sweeper, reconciler := log.With("component", "sweeper"), log.With("component", "reconciler")
	for range 90 {
		sweeper.Warn("sweep: cannot list draining runs", "err", "redis: connection refused")
		reconciler.Warn("reconcile: cannot list draining runs", "err", "redis: connection refused")
		sweeper.Info("an ordinary line")
		clock = clock.Add(time.Second)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	count := func(s string) int {
		n := 0
		for _, l := range lines {
			if strings.Contains(l, s) {
				n++
			}
		}
		return n
	}
	if n := count("sweep: cannot list"); n != 3 {
		t.Errorf("the sweeper's warning: %d lines in 90 s, want 3 (at 0 s, 30 s, 60 s)", n)
	}
	if n := count("reconcile: cannot list"); n != 3 {
		t.Errorf("the reconciler's warning: %d lines, want 3", n)
	}
	if n := count("repeated=29"); n != 4 {
		t.Errorf("lines saying 29 were held back: %d, want 4 (two kinds, twice)\n%s", n, buf.String())
	}
	if n := count("an ordinary line"); n != 90 {
		t.Errorf("info lines: %d, want all 90", n)
	}
	if !h.Enabled(context.Background(), slog.LevelInfo) {
		t.Error("the handler disabled what its inner one enables")
	}
}
