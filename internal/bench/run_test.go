package bench_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/bench"
)

// The whole instrument, at toy sizes, against the real binaries: every
// phase runs, every row is printed, and no measured request failed or went
// around the guard.
func TestInstrumentRunsEveryPhaseAgainstTheBinaries(t *testing.T) {
	dir := t.TempDir()
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
	// The peers as on a machine that could not have them: one whose deps
	// step said why, one not given at all.
	const offline = "go install github.com/stripe/smokescreen@v0.1.0 failed: offline"
	if err := os.WriteFile(filepath.Join(dir, "smokescreen.why"), []byte(offline+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var out, log bytes.Buffer
	cfg := bench.Config{
		Stopgate: filepath.Join(dir, "stopgate"), Baseline: filepath.Join(dir, "plain-goproxy"), WorkDir: filepath.Join(dir, "work"),
		Repeats: 1, Warmup: 50 * time.Millisecond, Window: 150 * time.Millisecond, Conns: []int{1, 4}, Post: true, RunPerConn: true,
		Cancels: 3, MemRuns: 20, MemIntents: 20, StoredSmall: 10, StoredLarge: 30, StoredLargeEmbedded: 30, FatIntents: 40,
		Smokescreen: filepath.Join(dir, "smokescreen"), Commit: "test", Out: &out, Log: &log,
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := bench.Run(ctx, cfg); err != nil {
		t.Fatalf("%v\nlog:\n%s\nout:\n%s", err, log.String(), out.String())
	}
	text := out.String()
	// Cells are padded to their column's width: compare with single spaces.
	flat := strings.Join(strings.Fields(text), " ")
	for _, want := range []string{
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
		"| 4 | smokescreen | not measured: " + offline + " |",
		"| 4, a run each | stopgate, Redis everysec |",
		"- smokescreen not measured: " + offline + ".",
	} {
		if !strings.Contains(flat, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	for _, notWanted := range []string{"| HTTPS GET (MITM) | smokescreen", "| HTTPS GET (MITM) | Squid"} {
		if strings.Contains(flat, notWanted) {
			t.Errorf("output has %q: the peers do not intercept HTTPS", notWanted)
		}
	}
	// Every measured row (the tables with others' CPU) ends with its error
	// count, which must be 0.
	rows := 0
	for _, line := range strings.Split(text, "\n") {
		if !strings.Contains(line, " cores |") {
			continue
		}
		rows++
		cells := strings.Split(strings.Trim(line, "|"), "|")
		if got := strings.TrimSpace(cells[len(cells)-1]); got != "0" {
			t.Errorf("row with %s errors: %s", got, line)
		}
	}
	// Six scenarios through five targets, and six stored conditions.
	if want := 6*5 + 6; rows != want {
		t.Errorf("%d measured rows, want %d:\n%s", rows, want, text)
	}
	if t.Failed() {
		t.Logf("output:\n%s\nlog:\n%s", text, log.String())
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
	var out, log bytes.Buffer
	cfg := bench.Config{
		Stopgate: filepath.Join(dir, "stopgate"), Baseline: filepath.Join(dir, "plain-goproxy"), WorkDir: filepath.Join(dir, "work"),
		Smokescreen: peers["smokescreen"], Squid: peers["squid"],
		Repeats: 1, Warmup: 50 * time.Millisecond, Window: 150 * time.Millisecond, Conns: []int{1, 4}, RunPerConn: true,
		Skip: []string{"cancel", "memory", "stored"}, Commit: "test", Out: &out, Log: &log,
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := bench.Run(ctx, cfg); err != nil {
		t.Fatalf("%v\nlog:\n%s\nout:\n%s", err, log.String(), out.String())
	}
	text := out.String()
	if strings.Contains(text, "not measured: ") {
		t.Errorf("a peer was not measured:\n%s", text)
	}
	// The main table's measured rows: traffic, case, conns, req/s,
	// × plain goproxy, × smokescreen, … errors.
	peerRows := map[string]int{}
	rows := 0
	for _, line := range strings.Split(text, "\n") {
		if !strings.Contains(line, " cores |") {
			continue
		}
		rows++
		cells := strings.Split(strings.Trim(line, "|"), "|")
		for i := range cells {
			cells[i] = strings.TrimSpace(cells[i])
		}
		traffic, label, smokescreenRatio := cells[0], cells[1], cells[5]
		if got := cells[len(cells)-1]; got != "0" {
			t.Errorf("row with %s errors: %s", got, line)
		}
		for _, peer := range []string{"smokescreen v", "Squid "} {
			if strings.HasPrefix(label, peer) {
				peerRows[peer]++
				if strings.HasPrefix(traffic, "HTTPS") {
					t.Errorf("a peer in an HTTPS row: %s", line)
				}
			}
		}
		wantRatio := !strings.HasPrefix(traffic, "HTTPS") && !strings.HasPrefix(label, "smokescreen")
		if hasRatio := smokescreenRatio != "—"; hasRatio != wantRatio {
			t.Errorf("× smokescreen %q in: %s", smokescreenRatio, line)
		}
	}
	// Three plain-HTTP scenarios through seven targets, two HTTPS through five.
	if want := 3*7 + 2*5; rows != want {
		t.Errorf("%d measured rows, want %d", rows, want)
	}
	for _, peer := range []string{"smokescreen v", "Squid "} {
		if peerRows[peer] != 3 {
			t.Errorf("%d rows of %s…, want one per plain-HTTP scenario (3)", peerRows[peer], peer)
		}
	}
	if t.Failed() {
		t.Logf("output:\n%s\nlog:\n%s", text, log.String())
	}
}
