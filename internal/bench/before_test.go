package bench

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestBeforeIsNamedByItsLabel(t *testing.T) {
	for _, tc := range []struct{ label, want string }{
		{"", "stopgate before"},
		{"before", "stopgate before"},
		{"f8b1e03", "stopgate before (f8b1e03)"},
	} {
		if got := (&Config{BeforeLabel: tc.label}).beforeName(); got != tc.want {
			t.Errorf("label %q: %q, want %q", tc.label, got, tc.want)
		}
	}
}

func TestConfigRefusesABeforeBinaryThatIsNotAFile(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "stopgate")
	if err := os.WriteFile(bin, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	ok := func() Config {
		return Config{Stopgate: bin, Baseline: bin, Repeats: 1, Window: time.Second, Conns: []int{1}}
	}
	for _, tc := range []struct {
		name, before, wantErr string
	}{
		{"none given", "", ""},
		{"a file", bin, ""},
		{"missing", filepath.Join(dir, "gone"), `the before (-before) binary "` + filepath.Join(dir, "gone") + `": not a file`},
		{"a directory", dir, `the before (-before) binary "` + dir + `": not a file`},
	} {
		cfg := ok()
		cfg.Before = tc.before
		err := cfg.check()
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
			t.Errorf("%s: error %v, want one saying %q", tc.name, err, tc.wantErr)
		}
	}
}

// The after ÷ before column is the median of each repeat's ratio, as every
// ratio of the instrument is: the two cases of a repeat met the machine in
// the same mood, two repeats did not. Here the ratio of the medians would
// read 0.90, the per-repeat ratios' median is 1.10.
func TestBeforeAndAfterDividesRepeatByRepeat(t *testing.T) {
	e := &env{cfg: &Config{Commit: "after1", Before: "/bin/before", BeforeLabel: "before1"}, figures: figures{}}
	rate := func(rs ...int) []loadResult {
		var out []loadResult
		for _, n := range rs {
			out = append(out, loadResult{Requests: n, Elapsed: time.Second, Latencies: []time.Duration{time.Millisecond}, CPU: []time.Duration{time.Duration(n) * time.Millisecond}})
		}
		return out
	}
	targets := []target{
		{key: "goproxy", baseline: true},
		{key: "before-embedded", store: "embedded", before: true},
		{key: "embedded", store: "embedded"},
	}
	scenarios := []scenario{{key: "http", label: "HTTP GET", method: http.MethodGet, conns: 64}}
	results := [][][]loadResult{{rate(1000, 1000, 1000), rate(100, 200, 300), rate(110, 180, 390)}}
	cells := e.summarizeMatrix(targets, scenarios, results)
	tb := e.beforeAfterTable(targets, scenarios, results, cells)
	if len(tb.rows) != 1 {
		t.Fatalf("%d rows, want 1: %q", len(tb.rows), tb.rows)
	}
	row := tb.rows[0]
	// A millisecond of CPU per request in every repeat; no Redis (embedded).
	for i, want := range []string{"HTTP GET", "64", "embedded", "1.10 (0.90–1.30)", "0.20 → 0.18", "1.00 ms → 1.00 ms", "1000 → 1000", "—"} {
		if row[i] != want {
			t.Errorf("column %q: %q, want %q", tb.header[i], row[i], want)
		}
	}
}
