package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/netns"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
)

// quickstartDoc is the page TestQuickstart runs.
const quickstartDoc = "../../docs/quickstart.md"

// skipMarker, on the line before a block, keeps it from the test (with
// the reason on the page).
const skipMarker = "<!-- quickstart-test: skip"

// shellBlocks are the ```sh blocks of a markdown page, in order, but those
// marked skip.
func shellBlocks(t *testing.T, path string) []string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var blocks []string
	var cur *strings.Builder
	prev := ""
	skip := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case cur == nil && line == "```sh":
			cur, skip = &strings.Builder{}, strings.HasPrefix(prev, skipMarker)
		case cur != nil && line == "```":
			if !skip {
				blocks = append(blocks, cur.String())
			}
			cur = nil
		case cur != nil:
			cur.WriteString(line + "\n")
		}
		if strings.TrimSpace(line) != "" {
			prev = line
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if cur != nil {
		t.Fatalf("%s: a ```sh block is not closed", path)
	}
	return blocks
}

// TestQuickstart runs docs/quickstart.md word for word, as a newcomer would
// after `make build`, as root with no sudo installed or used: every ```sh
// block, in order, in one bash, from a directory laid out like the clone
// (bin/stopgate, deploy/demo/). It runs in a network namespace of its own,
// so the page's default ports are free and its loopback is the page's
// alone. Then it checks the outcome against the record: each agent charged
// and was stopped at the cancel, and the provider received exactly the
// charges recorded as answered.
func TestQuickstart(t *testing.T) {
	if !netns.Enter(t) {
		return
	}
	runQuickstart(t, false)
}

// TestQuickstartAsAnOrdinaryUser runs the same page as uid 65534, in a
// directory of its own: the page needs no root.
func TestQuickstartAsAnOrdinaryUser(t *testing.T) {
	if !netns.Enter(t) {
		return
	}
	runQuickstart(t, true)
}

func runQuickstart(t *testing.T, ordinary bool) {
	for _, tool := range []string{"bash", "python3", "node", "curl", "setpriv"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is not installed: make test-deps installs what the quickstart needs", tool)
		}
	}
	dir, err := os.MkdirTemp("", "stopgate-quickstart-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for src, dst := range map[string]string{
		binary:                          "bin/stopgate",
		"../../deploy/demo/upstream.py": "deploy/demo/upstream.py",
		"../../deploy/demo/agent.py":    "deploy/demo/agent.py",
		"../../deploy/demo/agent.js":    "deploy/demo/agent.js",
	} {
		copyFile(t, src, filepath.Join(dir, dst))
	}
	argv := []string{"bash", "-c"}
	if ordinary {
		if out, err := exec.Command("chown", "-R", sandboxUID+":"+sandboxUID, dir).CombinedOutput(); err != nil {
			t.Fatalf("chown: %v %s", err, out)
		}
		argv = append([]string{"setpriv", "--reuid", sandboxUID, "--regid", sandboxUID, "--clear-groups", "--"}, argv...)
	}

	blocks := shellBlocks(t, quickstartDoc)
	if len(blocks) < 5 {
		t.Fatalf("%s: %d shell blocks; the page lost its steps", quickstartDoc, len(blocks))
	}
	script := "set -euxo pipefail\n" + strings.Join(blocks, "")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, argv[0], append(argv[1:], script)...)
	cmd.Dir = dir
	cmd.Env = append(testkit.CleanEnv(), "HOME="+dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 10 * time.Second
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err = cmd.Run()
	// The page's last block stops what it started; whatever is left of the
	// group is killed, and waited for, before the store is read.
	defer func() { _ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }()
	waitGroupGone(t, cmd.Process.Pid, 15*time.Second)
	logs := func() string {
		var b strings.Builder
		for _, f := range []string{"stopgate.log", "provider.log", "python-agent.log", "node-agent.log"} {
			c, _ := os.ReadFile(filepath.Join(dir, f))
			fmt.Fprintf(&b, "--- %s\n%s", f, c)
		}
		return b.String()
	}
	if err != nil {
		t.Fatalf("the quickstart failed: %v\n%s\n%s", err, out.String(), logs())
	}
	t.Logf("the quickstart's output:\n%s", out.String())

	// The refused curl, as the page shows it.
	for _, want := range []string{"HTTP/1.1 409 Conflict", "X-Stopgate-Refusal: run_not_active", `"error":"run_not_active"`, `"recorded":"CANCELLED_BEFORE_DISPATCH"`} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the quickstart's output has no %q", want)
		}
	}
	// Each agent charged before the cancel and stopped at it: refused by the
	// guard, or told by exec's SIGTERM, whichever came first.
	for _, agent := range []string{"python", "node"} {
		b, _ := os.ReadFile(filepath.Join(dir, agent+"-agent.log"))
		refused := regexp.MustCompile(agent+` agent: charge \d+: 409 run_not_active: \{"error":"run_not_active"`).Match(b) && strings.Contains(string(b), agent+" agent: refused, stopping")
		told := strings.Contains(string(b), agent+" agent: SIGTERM (the run was cancelled), stopping")
		if !regexp.MustCompile(agent+` agent: charge 1: 200`).Match(b) || !(refused || told) {
			t.Errorf("%s agent: want a charge answered 200, then a 409 run_not_active or exec's SIGTERM, and a stop; its log:\n%s", agent, b)
		}
	}

	// The record against the provider: no effect reached it unrecorded, none
	// after the cancel, and every agent's refusal is recorded.
	store, err := filestore.Open(filepath.Join(dir, "stopgate-data", "stopgate.db"), filestore.Options{Logger: slog.New(slog.DiscardHandler), Timeout: 5 * time.Second})
	if err != nil {
		t.Fatalf("the quickstart's store: %v\n%s", err, logs())
	}
	defer store.Close()
	rctx, rcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer rcancel()
	run, err := store.Get(rctx, "run_1")
	if err != nil || run.Status != state.StatusCancelled {
		t.Errorf("run_1: %+v %v, want CANCELLED", run, err)
	}
	intents, err := store.Intents(rctx, "run_1")
	if err != nil {
		t.Fatal(err)
	}
	responded, refused := 0, 0
	for _, in := range intents {
		switch in.State {
		case state.IntentResponded:
			responded++
		case state.IntentCancelledBeforeDispatch:
			refused++
		default:
			t.Errorf("intent %s %s %s: %s, want RESPONDED or CANCELLED_BEFORE_DISPATCH", in.Key, in.Method, in.Target, in.State)
		}
		if in.Method == "EXEC" {
			// exec's own record that it started an agent: no charge.
			responded--
		}
	}
	provider, _ := os.ReadFile(filepath.Join(dir, "provider.log"))
	received := strings.Count(string(provider), "provider received POST /charge")
	if received != responded || received < 3 {
		t.Errorf("the provider received %d charges, the record answered %d (want equal, and one of each agent at least):\n%s", received, responded, logs())
	}
	if refused < 1 {
		t.Errorf("%d refusals recorded, want the curl's at least", refused)
	}
}

// lockFile holds an exclusive lock on path until the returned func is
// called, waiting at most wait for it.
func lockFile(t *testing.T, path string, wait time.Duration) func() {
	t.Helper()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(wait)
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { _ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN); _ = f.Close() }
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) || time.Now().After(deadline) {
			_ = f.Close()
			t.Fatalf("lock %s: %v (another quickstart test held it for %s)", path, err, wait)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func copyFile(t *testing.T, src, dst string) {
	t.Helper()
	in, err := os.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		t.Fatal(err)
	}
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
}

// waitGroupGone waits (bounded) until no process of group pgid is left.
func waitGroupGone(t *testing.T, pgid int, wait time.Duration) {
	t.Helper()
	deadline := time.Now().Add(wait)
	for syscall.Kill(-pgid, 0) == nil {
		if time.Now().After(deadline) {
			_ = syscall.Kill(-pgid, syscall.SIGKILL)
			t.Logf("processes of the quickstart were still running %s after it ended: killed", wait)
			time.Sleep(500 * time.Millisecond)
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}
