package bench_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/bench"
)

// buildBinaries builds stopgate and plain-goproxy into dir.
func buildBinaries(t *testing.T, dir string) {
	t.Helper()
	bins := map[string]string{
		"stopgate":      "github.com/stopgate/stopgate/cmd/proxy",
		"plain-goproxy": "github.com/stopgate/stopgate/internal/bench/cmd/plain-goproxy",
	}
	for name, pkg := range bins {
		out, err := exec.Command("go", "build", "-o", filepath.Join(dir, name), pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go build %s: %v\n%s", pkg, err, out)
		}
	}
}

// toyRun runs the instrument on cfg at toy sizes (a warm-up of 50ms,
// windows of 150ms) against the binaries buildBinaries put in dir, working
// in dir/work, for 3 minutes at most; out and log get what it prints.
func toyRun(dir string, cfg bench.Config, out, log *bytes.Buffer) error {
	cfg.Stopgate, cfg.Baseline, cfg.WorkDir = filepath.Join(dir, "stopgate"), filepath.Join(dir, "plain-goproxy"), filepath.Join(dir, "work")
	cfg.Warmup, cfg.Window = 50*time.Millisecond, 150*time.Millisecond
	cfg.Commit, cfg.Out, cfg.Log = "test", out, log
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	return bench.Run(ctx, cfg)
}

// mustToyRun is toyRun's output and log, or the end of the test.
func mustToyRun(t *testing.T, dir string, cfg bench.Config) (out, log string) {
	t.Helper()
	var o, l bytes.Buffer
	if err := toyRun(dir, cfg, &o, &l); err != nil {
		t.Fatalf("%v\nlog:\n%s\nout:\n%s", err, l.String(), o.String())
	}
	return o.String(), l.String()
}

// expectOutput fails the test for each of wants the output text lacks,
// and is text with every run of white space one space: cells are padded
// to their column's width, wants are written with single spaces.
func expectOutput(t *testing.T, text string, wants ...string) (flat string) {
	t.Helper()
	flat = strings.Join(strings.Fields(text), " ")
	for _, want := range wants {
		if !strings.Contains(flat, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	return flat
}

// The whole instrument, at toy sizes, against the real binaries: every
// phase runs, every row is printed, and no measured request failed or went
// around the guard.
func TestInstrumentRunsEveryPhaseAgainstTheBinaries(t *testing.T) {
	dir := t.TempDir()
	buildBinaries(t, dir)
	// The peers as on a machine that could not have them: one whose deps
	// step said why, one not given at all.
	const offline = "go install github.com/stripe/smokescreen@v0.1.0 failed: offline"
	if err := os.WriteFile(filepath.Join(dir, "smokescreen.why"), []byte(offline+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := bench.Config{
		Repeats: 1, Conns: []int{1, 4}, Post: true, RunPerConn: true,
		Cancels: 3, MemRuns: 20, MemIntents: 20, StoredSmall: 10, StoredLarge: 30, StoredLargeEmbedded: 30, FatIntents: 40,
		Smokescreen: filepath.Join(dir, "smokescreen"),
	}
	text, log := mustToyRun(t, dir, cfg)
	flat := expectOutput(t, text,
		"| HTTP GET | direct (no proxy) | 1 |",
		"| HTTPS GET (MITM) | plain goproxy MITM | 4 |",
		"| HTTP POST 64 B | stopgate, Redis always | 4 |",
		"| HTTP GET, a run per connection | plain goproxy | 4 |",
		"| HTTP GET, a run per connection | stopgate, Redis everysec | 4 |",
		"stopgate, embedded store", "stopgate, Redis everysec",
		"### Cancel → last cut connection", "cancel acknowledged (202 read)",
		"### Redis memory", "intents (RESPONDED GETs, one run)",
		"Redis everysec, 30 runs stored, a new run", "embedded store, 10 runs stored, a run holding 40 intents",
		"### How the stored data was loaded",
		"### Issue 9 targets, against this run",
		"| Redis everysec, HTTP GET ×4 |", "| cancel acknowledged → last cut connection, 3 instances |",
		"| Redis: 30 runs stored vs 10 |", "| embedded: 30 runs stored vs 10 |",
		"| HTTP GET | smokescreen | 1 | not measured | — |",
		"| HTTP GET, a run per connection | Squid | 4 | not measured | — |",
		"| 4, a run each | Squid | not measured: no binary given (-squid) |",
		"### Beside the peers: plain-HTTP GETs",
		"| 4 | smokescreen | not measured: "+offline+" |",
		"| 4, a run each | stopgate, Redis everysec |",
		"- smokescreen not measured: "+offline+".",
	)
	for _, notWanted := range []string{"| HTTPS GET (MITM) | smokescreen", "| HTTPS GET (MITM) | Squid"} {
		if strings.Contains(flat, notWanted) {
			t.Errorf("output has %q: the peers do not intercept HTTPS", notWanted)
		}
	}
	// Every measured row (the tables with others' CPU) ends with its error
	// count, which must be 0.
	rows := mainTableRows(text)
	for _, cells := range rows {
		if got := cells[len(cells)-1]; got != "0" {
			t.Errorf("row with %s errors: %q", got, cells)
		}
	}
	// Six scenarios through five targets, and six stored conditions.
	if want := 6*5 + 6; len(rows) != want {
		t.Errorf("%d measured rows, want %d:\n%s", len(rows), want, text)
	}
	if t.Failed() {
		t.Logf("output:\n%s\nlog:\n%s", text, log)
	}
}

// The peers measured for real, beside the others in the same run:
// scripts/bench-deps builds smokescreen and links Squid into the
// repository's bin/ (make bench runs it; make test does not).
func TestPeersAreMeasuredBesideTheOthersInOneRun(t *testing.T) {
	peers := map[string]string{}
	for _, name := range []string{"smokescreen", "squid"} {
		path, err := filepath.Abs(filepath.Join("..", "..", "bin", name))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(path); err != nil {
			t.Skipf("no %s: scripts/bench-deps builds the peers (make bench runs it)", path)
		}
		peers[name] = path
	}
	dir := t.TempDir()
	buildBinaries(t, dir)
	cfg := bench.Config{
		Smokescreen: peers["smokescreen"], Squid: peers["squid"],
		Repeats: 1, Conns: []int{1, 4}, RunPerConn: true,
		Skip: []string{"cancel", "memory", "stored"},
	}
	text, log := mustToyRun(t, dir, cfg)
	if strings.Contains(text, "not measured: ") {
		t.Errorf("a peer was not measured:\n%s", text)
	}
	// The main table's measured rows: traffic, case, conns, req/s,
	// × plain goproxy, × smokescreen, … errors.
	peerRows := map[string]int{}
	rows := mainTableRows(text)
	for _, cells := range rows {
		traffic, label, smokescreenRatio := cells[0], cells[1], cells[5]
		if got := cells[len(cells)-1]; got != "0" {
			t.Errorf("row with %s errors: %q", got, cells)
		}
		for _, peer := range []string{"smokescreen v", "Squid "} {
			if strings.HasPrefix(label, peer) {
				peerRows[peer]++
				if strings.HasPrefix(traffic, "HTTPS") {
					t.Errorf("a peer in an HTTPS row: %q", cells)
				}
			}
		}
		wantRatio := !strings.HasPrefix(traffic, "HTTPS") && !strings.HasPrefix(label, "smokescreen")
		if hasRatio := smokescreenRatio != "—"; hasRatio != wantRatio {
			t.Errorf("× smokescreen %q in: %q", smokescreenRatio, cells)
		}
	}
	// Three plain-HTTP scenarios through seven targets, two HTTPS through five.
	if want := 3*7 + 2*5; len(rows) != want {
		t.Errorf("%d measured rows, want %d", len(rows), want)
	}
	for _, peer := range []string{"smokescreen v", "Squid "} {
		if peerRows[peer] != 3 {
			t.Errorf("%d rows of %s…, want one per plain-HTTP scenario (3)", peerRows[peer], peer)
		}
	}
	if t.Failed() {
		t.Logf("output:\n%s\nlog:\n%s", text, log)
	}
}

// mainTableRows are the measured rows of the main table (the ones with
// others' CPU), split into trimmed cells.
func mainTableRows(text string) [][]string {
	var rows [][]string
	for _, line := range strings.Split(text, "\n") {
		if !strings.Contains(line, " cores |") {
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		for i := range cells {
			cells[i] = strings.TrimSpace(cells[i])
		}
		rows = append(rows, cells)
	}
	return rows
}

// tableRows are the body rows of the table titled title, split into
// trimmed cells.
func tableRows(text, title string) [][]string {
	_, rest, ok := strings.Cut(text, "### "+title+"\n\n")
	if !ok {
		return nil
	}
	var rows [][]string
	for i, line := range strings.Split(rest, "\n") {
		if !strings.HasPrefix(line, "|") {
			break
		}
		if i < 2 {
			continue // the header and its separator
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		for i := range cells {
			cells[i] = strings.TrimSpace(cells[i])
		}
		rows = append(rows, cells)
	}
	return rows
}

// The before binary in the same run as the after (here the same binary
// twice: this proves the wiring, not a speed): each store's before case
// is measured in every scenario just ahead of its after case, on its own
// data directory and redis-server, is in the short table beside the peers,
// and every case has its row in the before-and-after table.
func TestBeforeBinaryIsMeasuredBesideTheAfterInOneRun(t *testing.T) {
	dir := t.TempDir()
	buildBinaries(t, dir)
	work := filepath.Join(dir, "work")
	cfg := bench.Config{
		Before: filepath.Join(dir, "stopgate"), BeforeLabel: "rev1",
		Repeats: 2, Conns: []int{1, 4}, RunPerConn: true,
		Skip: []string{"cancel", "memory", "stored"},
	}
	text, log := mustToyRun(t, dir, cfg)
	stores := []string{"embedded store", "Redis everysec", "Redis always"}

	// Five scenarios (GET ×1, ×4, a run per connection ×4, HTTPS ×1, ×4)
	// through direct, plain goproxy and the six stopgate cases.
	rows := mainTableRows(text)
	if want := 5 * 8; len(rows) != want {
		t.Errorf("%d measured rows, want %d", len(rows), want)
	}
	befores := 0
	for i, r := range rows {
		if got := r[len(r)-1]; got != "0" {
			t.Errorf("row with %s errors: %q", got, r)
		}
		store, ok := strings.CutPrefix(r[1], "stopgate before (rev1), ")
		if !ok {
			continue
		}
		befores++
		if r[4] == "—" {
			t.Errorf("a before row without its × plain goproxy: %q", r)
		}
		if i+1 >= len(rows) || rows[i+1][1] != "stopgate, "+store || rows[i+1][0] != r[0] || rows[i+1][2] != r[2] {
			t.Errorf("before row %q is not followed by its after row", r)
		}
		if redis := r[11]; (store == "embedded store") != (redis == "—") {
			t.Errorf("before row %q: Redis CPU %q", r, redis)
		}
	}
	if want := 5 * 3; befores != want {
		t.Errorf("%d before rows, want %d", befores, want)
	}
	flat := strings.Join(strings.Fields(text), " ")
	for _, store := range stores {
		for _, want := range []string{"| 1 | stopgate before (rev1), " + store + " |", "| 4, a run each | stopgate before (rev1), " + store + " |"} {
			if !strings.Contains(flat, want) {
				t.Errorf("the table beside the peers lacks %q", want)
			}
		}
	}

	// traffic, conns, store, after ÷ before, × plain goproxy, p50, proxy
	// CPU, Redis CPU.
	ba := tableRows(text, "Before and after")
	if want := 5 * 3; len(ba) != want {
		t.Errorf("%d before-and-after rows, want %d", len(ba), want)
	}
	for _, r := range ba {
		if len(r) != 8 {
			t.Errorf("before-and-after row of %d cells: %q", len(r), r)
			continue
		}
		// Two repeats: a median with its (min–max).
		median, spread, ok := strings.Cut(r[3], " ")
		if x, err := strconv.ParseFloat(median, 64); err != nil || x <= 0 || !ok || !strings.HasPrefix(spread, "(") {
			t.Errorf("after ÷ before %q in %q", r[3], r)
		}
		for _, c := range r[4:7] {
			if !strings.Contains(c, " → ") {
				t.Errorf("cell %q in %q is not before → after", c, r)
			}
		}
		if (r[2] == "embedded") != (r[7] == "—") {
			t.Errorf("Redis CPU %q for store %q", r[7], r[2])
		}
	}
	// Their own processes: a log of each, and a redis-server of each Redis case.
	for _, name := range []string{"stopgate-before-embedded.log", "stopgate-before-everysec.log", "stopgate-before-always.log", "redis-before-everysec", "redis-before-always"} {
		if _, err := os.Stat(filepath.Join(work, name)); err != nil {
			t.Errorf("the before cases' %s: %v", name, err)
		}
	}
	if t.Failed() {
		t.Logf("output:\n%s\nlog:\n%s", text, log)
	}
}

// A before binary from before a flag the instrument passes existed is not
// started without it (it would then be measured doing something else than
// the after binary): the run ends with the binary's own error. The older
// binary here is the built one behind a script that refuses --allow-dest
// as a stopgate without the flag does.
func TestBeforeBinaryThatLacksAFlagEndsTheRunWithItsOwnError(t *testing.T) {
	dir := t.TempDir()
	buildBinaries(t, dir)
	older := filepath.Join(dir, "stopgate-older")
	script := "#!/bin/sh\n" +
		"for a in \"$@\"; do\n" +
		"  if [ \"$a\" = --allow-dest ]; then\n" +
		"    echo 'stopgate serve: flag provided but not defined: -allow-dest' >&2\n" +
		"    echo \"Run 'stopgate help serve' for usage.\" >&2\n" +
		"    exit 2\n" +
		"  fi\n" +
		"done\n" +
		"exec " + filepath.Join(dir, "stopgate") + " \"$@\"\n"
	if err := os.WriteFile(older, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := bench.Config{
		Before: older, BeforeLabel: "old1",
		Repeats: 1, Conns: []int{1},
		Skip: []string{"cancel", "memory", "stored"},
	}
	var out, log bytes.Buffer
	err := toyRun(dir, cfg, &out, &log)
	if err == nil {
		t.Fatalf("the run went on with a before binary that refused --allow-dest:\n%s", out.String())
	}
	for _, want := range []string{"the before binary " + older + " (stopgate before (old1))", "flag provided but not defined: -allow-dest"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
	if strings.Contains(out.String(), "no --allow-dest flag: it was started without one") {
		t.Errorf("the after binary was started without --allow-dest:\n%s", out.String())
	}
}

// The budget cases at toy sizes: the same processes under runs the policy
// gives a million effects, each checked to have had the budget, beside the
// same cases without, in the main table and in a table of their own.
func TestBudgetCasesSitBesideTheSameCasesWithout(t *testing.T) {
	dir := t.TempDir()
	buildBinaries(t, dir)
	cfg := bench.Config{
		Repeats: 1, Conns: []int{4}, RunPerConn: true, Budget: true,
		Skip: []string{"cancel", "memory", "stored"},
	}
	text, log := mustToyRun(t, dir, cfg)
	flat := expectOutput(t, text,
		"| HTTP GET | stopgate, embedded store, budget 1M effects | 4 |",
		"| HTTPS GET (MITM) | stopgate, Redis everysec, budget 1M effects | 4 |",
		"| HTTP GET, a run per connection | stopgate, Redis everysec, budget 1M effects | 4 |",
		"### A budget of a million effects, beside the same runs without",
		"| HTTP GET | 4 | embedded |", "| HTTPS GET (MITM) | 4 | Redis everysec |",
	)
	if strings.Contains(flat, "Redis always, budget") {
		t.Error("a budget case on Redis always: the budget cases are the embedded store's and everysec's")
	}
	if t.Failed() {
		t.Logf("output:\n%s\nlog:\n%s", text, log)
	}
}
