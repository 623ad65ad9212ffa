package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"html"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/testkit"
)

// clientsDir holds the CDP clients browser agents use, installed by
// scripts/test-deps (npm ci from its package-lock.json).
const clientsDir = "testdata/browser-clients"

// nodeClients finds node and the installed clients; their absence fails
// the test, with the way to install them.
func nodeClients(t *testing.T) string {
	t.Helper()
	node, err := exec.LookPath("node")
	if err != nil {
		t.Fatal("node is not installed: run scripts/test-deps (it needs Node.js 20 or later)")
	}
	for _, pkg := range []string{"puppeteer-core", "playwright-core"} {
		if _, err := os.Stat(filepath.Join(clientsDir, "node_modules", pkg, "package.json")); err != nil {
			t.Fatalf("%s is not installed in %s: run scripts/test-deps (npm ci there)", pkg, clientsDir)
		}
	}
	return node
}

// formSite is a shop on loopback with a form; it counts every request
// that reaches it.
type formSite struct {
	*httptest.Server
	hits atomic.Int64
}

func newFormSite(t *testing.T) *formSite {
	t.Helper()
	s := &formSite{}
	const form = `<form method="post" action="/submit"><input id="name" name="name"><button id="submit" type="submit" style="width:120px;height:40px">send</button></form>`
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/favicon.ico" {
			http.NotFound(w, r)
			return
		}
		s.hits.Add(1)
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		body := form
		if r.Method == http.MethodPost && r.URL.Path == "/submit" {
			body = `<p id="result">thanks ` + html.EscapeString(r.FormValue("name")) + `</p>` + form
		}
		fmt.Fprintf(w, `<!doctype html><title>shop</title><link rel="icon" href="data:,">%s`, body)
	}))
	t.Cleanup(s.Close)
	return s
}

// attempt is how one client call ended, as the scripts report it.
type attempt struct {
	OK    bool            `json:"ok"`
	Value json.RawMessage `json:"value"`
	Error string          `json:"error"`
}

// agent is a node script driving the run's browser through stopgate,
// stage by stage (testdata/browser-clients/steps.mjs).
type agent struct {
	t      *testing.T
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  *bufio.Scanner
	stderr *bytes.Buffer
}

func startAgent(t *testing.T, node, script, ws, site string) *agent {
	t.Helper()
	cmd := exec.Command(node, script, ws, site)
	cmd.Dir = clientsDir
	cmd.Env = append(testkit.CleanEnv(), "NO_PROXY=*")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	a := &agent{t: t, cmd: cmd, stdin: stdin, lines: bufio.NewScanner(stdout), stderr: &bytes.Buffer{}}
	a.lines.Buffer(make([]byte, 1<<20), 16<<20)
	cmd.Stderr = a.stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", script, err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return a
}

// stage reads the script's report of a stage, bounded.
func (a *agent) stage(want string) map[string]json.RawMessage {
	a.t.Helper()
	got := make(chan bool, 1)
	go func() { got <- a.lines.Scan() }()
	select {
	case ok := <-got:
		if !ok {
			a.t.Fatalf("the agent ended before stage %s: %v\n%s", want, a.lines.Err(), a.stderr)
		}
	case <-time.After(60 * time.Second):
		a.t.Fatalf("no stage %s from the agent within 60s\n%s", want, a.stderr)
	}
	var report map[string]json.RawMessage
	if err := json.Unmarshal(a.lines.Bytes(), &report); err != nil {
		a.t.Fatalf("agent said %q: %v", a.lines.Text(), err)
	}
	if string(report["stage"]) != `"`+want+`"` {
		a.t.Fatalf("agent reported stage %s, want %s: %s\n%s", report["stage"], want, a.lines.Text(), a.stderr)
	}
	a.t.Logf("stage %s: %s", want, a.lines.Text())
	return report
}

// goOn tells the script the next stage is set.
func (a *agent) goOn() {
	a.t.Helper()
	if _, err := io.WriteString(a.stdin, "go\n"); err != nil {
		a.t.Fatalf("write to the agent: %v", err)
	}
}

func (a *agent) attempt(report map[string]json.RawMessage, name string) attempt {
	a.t.Helper()
	var at attempt
	if err := json.Unmarshal(report[name], &at); err != nil {
		a.t.Fatalf("report has no attempt %s: %v", name, err)
	}
	return at
}

// TestPuppeteerAgent and TestPlaywrightAgent: an agent on puppeteer-core
// or playwright-core connects to stopgate browser --run R, fills and
// submits a form; after the cancel its next goto, click and evaluate fail
// with an error that names the run, its state and the refusal code, while
// it can still look at the page; once the run is CANCELLED the same, until
// the browser's linger ends and it is disconnected. The site sees nothing
// after the cancel.
func TestPuppeteerAgent(t *testing.T) {
	testAgent(t, "puppeteer.mjs", []string{"screenshot", "accessibility", "cdp_dom"})
}

func TestPlaywrightAgent(t *testing.T) {
	testAgent(t, "playwright.mjs", []string{"cdp_screenshot", "cdp_accessibility", "cdp_dom"})
}

func testAgent(t *testing.T, script string, reads []string) {
	node := nodeClients(t)
	chromium := testkit.Chromium(t)
	site := newFormSite(t)
	const run = "agent-1"
	s := startServe(t, "--data-dir", t.TempDir(), "--chromium", chromium, "--browser-linger", "5s", "--recheck-interval", "200ms")
	ws, _, _ := strings.Cut(s.must(t, 0, "browser", "--run", run), "\n")

	a := startAgent(t, node, script, ws, site.URL)
	if got := a.stage("active")["result"]; string(got) != `"thanks Ada"` {
		t.Fatalf("the form's result while ACTIVE: %s", got)
	}
	before := site.hits.Load()
	if before != 2 {
		t.Fatalf("the site saw %d requests while ACTIVE, want 2 (the form and its submission)", before)
	}

	// A worker's claim keeps the run CANCELLING until it is let go.
	s.must(t, 0, "claim", run, "hold", "--worker", "test")
	s.must(t, 0, "cancel", run, "--reason", "operator stop")
	a.goOn()
	// refused checks that each action failed with stopgate's refusal
	// naming the run, one of the states and the refusal code, and that
	// each read worked.
	refused := func(report map[string]json.RawMessage, stage string, states ...string) {
		t.Helper()
		for _, name := range []string{"goto", "click", "evaluate"} {
			at := a.attempt(report, name)
			named := false
			for _, st := range states {
				named = named || strings.Contains(at.Error, fmt.Sprintf("run_not_active: run %s is %s at cancel_version 2", run, st))
			}
			if at.OK || !named || !strings.Contains(at.Error, "stopgate refused ") {
				t.Errorf("%s %s while %s: %+v; want stopgate's refusal naming run %s, its state (%s) and the code run_not_active",
					script, name, stage, at, run, strings.Join(states, " or "))
			}
		}
		for _, name := range reads {
			if at := a.attempt(report, name); !at.OK {
				t.Errorf("%s read %s while %s failed: %s", script, name, stage, at.Error)
			}
		}
	}
	refused(a.stage("cancelling"), "CANCELLING", "CANCELLING")

	// The claim lets go: nothing is in flight, the sweeper makes the run
	// CANCELLED, and its browser lingers.
	finishIntent(t, s, run, "claim:hold")
	waitStatus(t, s, run, "CANCELLED")
	a.goOn()
	cancelled := a.stage("cancelled")
	// Playwright keeps the failure of its page helper script, so its
	// evaluate says the state that refused it first.
	refused(cancelled, "CANCELLED", "CANCELLED", "CANCELLING")
	if string(cancelled["disconnected"]) != "true" {
		t.Errorf("%s was not disconnected when the browser's linger ended", script)
	}
	closed := a.stage("closed")
	for _, name := range []string{"goto", "click", "evaluate"} {
		if at := a.attempt(closed, name); at.OK {
			t.Errorf("%s %s after the browser stopped succeeded", script, name)
		}
	}
	if n := site.hits.Load(); n != before {
		t.Errorf("the site saw %d requests after the cancel", n-before)
	}
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(s.Log(), "browser stopped") {
		if time.Now().After(deadline) {
			t.Fatalf("serve did not stop the browser after its linger:\n%s", s.Log())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// finishIntent records an in-flight intent NOT_SENT, as its worker would.
func finishIntent(t *testing.T, s *server, run, key string) {
	t.Helper()
	if code, body := s.asOperator(t, http.MethodPatch, "/v1/runs/"+run+"/intents/"+key, `{"outcome":"not_sent"}`); code != http.StatusOK {
		t.Fatalf("PATCH intent %s: %d %s", key, code, body)
	}
}

// waitStatus polls the run's status until it is want (bounded).
func waitStatus(t *testing.T, s *server, run, want string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	for {
		var row struct {
			Status string `json:"status"`
		}
		_, out, _ := s.stopgate(t, "status", run, "--json")
		if json.Unmarshal([]byte(out), &row) == nil && row.Status == want {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("run %s is %s, not %s, after 15s", run, row.Status, want)
		case <-time.After(100 * time.Millisecond):
		}
	}
}
