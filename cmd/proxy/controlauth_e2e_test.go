package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/internal/testkit"
)

// The control plane is closed by default, and yet usable: these run the
// real binary as `make run` does (serve in a directory, its data in
// ./stopgate-data) and its CLI from the same directory.

// cliIn runs the stopgate CLI in dir with env (over the test's environment
// without STOPGATE_* variables).
func cliIn(t *testing.T, dir string, env []string, args ...string) (int, string, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	cmd.Env, cmd.Dir = append(testkit.CleanEnv(), env...), dir
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode(), stdout.String(), stderr.String()
	} else if err != nil {
		t.Fatalf("stopgate %q: %v", args, err)
	}
	return 0, stdout.String(), stderr.String()
}

// mustIn runs a command line that must exit with code, and returns its
// stdout (exit 0) or its stderr.
func (s *server) mustIn(t *testing.T, dir string, env []string, code int, args ...string) string {
	t.Helper()
	got, out, errOut := cliIn(t, dir, append([]string{"STOPGATE_CONTROL=" + s.control}, env...), args...)
	if got != code {
		t.Fatalf("stopgate %s (in %s, %q): exit %d, want %d\nstdout: %s\nstderr: %s\nserve log:\n%s", strings.Join(args, " "), dir, env, got, code, out, errOut, s.Log())
	}
	if code == 0 {
		return out
	}
	return errOut
}

func TestFreshServeIsClosedAndItsCLIWorksWithoutPassingAToken(t *testing.T) {
	repo := t.TempDir() // where `make run` runs, and the operator types
	s := startServeIn(t, repo)
	alice := []string{"USER=alice"}

	// The operator types no token: the CLI finds serve's in ./stopgate-data.
	s.mustIn(t, repo, alice, 0, "admit", "r1")
	s.mustIn(t, repo, alice, 0, "admit", "r2")
	if out := s.mustIn(t, repo, nil, 0, "status", "r1"); !strings.Contains(out, "ACTIVE") {
		t.Fatalf("status r1: %s", out)
	}
	dataDir := filepath.Join(repo, "stopgate-data")
	secrets := map[string][]byte{}
	for _, name := range []string{control.OperatorTokenFile, control.ReadTokenFile, control.RunTokenSecretFile} {
		path := filepath.Join(dataDir, name)
		st, err := os.Stat(path)
		if err != nil {
			t.Fatalf("serve did not write %s: %v", name, err)
		}
		if st.Mode().Perm() != 0o600 {
			t.Errorf("%s has mode %o, want 0600", name, st.Mode().Perm())
		}
		if secrets[name], err = os.ReadFile(path); err != nil {
			t.Fatal(err)
		}
		if strings.Contains(s.Log(), strings.TrimSpace(string(secrets[name]))) {
			t.Errorf("the serve log shows the secret of %s", name)
		}
	}
	operatorToken := strings.TrimSpace(string(secrets[control.OperatorTokenFile]))
	readToken := strings.TrimSpace(string(secrets[control.ReadTokenFile]))

	// Anyone else on the machine, with no token: 401 on the API, and the
	// probes, the scraper and the CA stay open.
	hc := &http.Client{Timeout: 5 * time.Second}
	// (The console at / sends such a visitor on to its login form.)
	for path, want := range map[string]int{"/v1/runs": 401, "/v1/runs/r1": 401, "/healthz": 200, "/readyz": 200, "/metrics": 200, "/v1/ca": 200, "/": 200} {
		resp, err := hc.Get(s.control + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("GET %s without a token: %d, want %d", path, resp.StatusCode, want)
		}
		if path == "/" && resp.Request.URL.Path != "/login" {
			t.Errorf("GET / without a token ended at %s, want the console's login form", resp.Request.URL)
		}
	}
	req, _ := http.NewRequest("POST", s.control+"/v1/runs/r1/cancel", strings.NewReader(`{}`))
	req.Header.Set(control.ActorHeader, "operator")
	if resp, err := hc.Do(req); err != nil || resp.StatusCode != 401 {
		t.Fatalf("a cancel without a token: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
	elsewhere := t.TempDir()
	if msg := s.mustIn(t, elsewhere, nil, 1, "cancel", "r1"); !strings.Contains(msg, "unauthorized") || !strings.Contains(msg, "No token was sent") {
		t.Errorf("cancel from another directory without a token: %q", msg)
	}

	// A worker: its run token is its one credential, and names its run.
	runToken := strings.TrimSpace(s.mustIn(t, repo, nil, 0, "token", "r1"))
	// USER=operator makes the CLI claim to be "cli:operator": it must not matter.
	worker := []string{"STOPGATE_CONTROL_TOKEN=" + runToken, "USER=operator"}
	s.mustIn(t, elsewhere, worker, 0, "claim", "r1", "s1")
	s.mustIn(t, elsewhere, worker, 0, "status", "r1")
	for _, args := range [][]string{
		{"cancel", "r1"}, {"complete", "r1", "--version", "1"}, {"resolve", "r1", "claim:s1", "--not-applied"},
		{"token", "r1"}, {"admit", "r3"}, {"status", "r2"}, {"cancel", "r2"}, {"claim", "r2", "s1"}, {"runs"},
	} {
		if msg := s.mustIn(t, elsewhere, worker, 1, args...); !strings.Contains(msg, "forbidden") {
			t.Errorf("worker of r1: stopgate %s: %q, want forbidden", strings.Join(args, " "), msg)
		}
	}
	// The read-only token reads and changes nothing.
	reader := []string{"STOPGATE_CONTROL_TOKEN=" + readToken}
	if out := s.mustIn(t, elsewhere, reader, 0, "runs"); !strings.Contains(out, "r1") || !strings.Contains(out, "r2") {
		t.Errorf("runs with the read-only token: %s", out)
	}
	s.mustIn(t, elsewhere, reader, 0, "audit", "r1")
	if msg := s.mustIn(t, elsewhere, reader, 1, "cancel", "r2"); !strings.Contains(msg, "forbidden") {
		t.Errorf("cancel with the read-only token: %q", msg)
	}

	// The record: both runs ACTIVE, every actor the token's.
	var audit control.Audit
	if err := json.Unmarshal([]byte(s.mustIn(t, repo, nil, 0, "audit", "r1", "--json")), &audit); err != nil {
		t.Fatal(err)
	}
	if audit.Run.Status != "ACTIVE" || audit.Run.CancelVersion != 1 {
		t.Errorf("r1 is %s/%d after the worker's tries, want ACTIVE/1", audit.Run.Status, audit.Run.CancelVersion)
	}
	actors := map[string]string{}
	for _, e := range audit.Events {
		actors[e.Kind+" "+e.Intent] = e.Actor
	}
	if a := actors["run.admitted "]; a != "operator (cli:alice)" {
		t.Errorf("admit recorded by %q, want \"operator (cli:alice)\": %v", a, actors)
	}
	for k, a := range actors {
		if strings.HasSuffix(k, "claim:s1") && a != "worker:r1" {
			t.Errorf("%s recorded by %q, want worker:r1 (the worker's CLI claimed cli:operator)", k, a)
		}
	}
	if out := s.mustIn(t, repo, nil, 0, "status", "r2", "--json"); !strings.Contains(out, `"status":"ACTIVE"`) {
		t.Errorf("r2 after the worker of r1 tried to cancel it: %s", out)
	}

	// A restart reads the same secrets; nothing is overwritten.
	if err := s.Stop(); err != nil {
		t.Fatal(err)
	}
	s.Start()
	for name, before := range secrets {
		after, err := os.ReadFile(filepath.Join(dataDir, name))
		if err != nil || !bytes.Equal(before, after) {
			t.Errorf("%s changed across a restart (%v)", name, err)
		}
	}
	s.mustIn(t, repo, nil, 0, "status", "r1")
	s.mustIn(t, elsewhere, []string{"STOPGATE_CONTROL_TOKEN=" + operatorToken}, 0, "status", "r1")
	s.mustIn(t, elsewhere, worker, 0, "status", "r1") // the run token outlives the restart
}

// TestServeWarnsAboutSecretsOnTheCommandLine: a secret given as a flag is
// visible to every user in ps; serve says so, and takes files without a word.
func TestServeWarnsAboutSecretsOnTheCommandLine(t *testing.T) {
	const token = "sgop_given-on-the-command-line"
	dataDir := t.TempDir()
	s := startServe(t, "--data-dir", dataDir, "--control-token", token, "--run-token-secret", strings.Repeat("k", 32))
	for _, flag := range []string{"--control-token", "--run-token-secret"} {
		if !strings.Contains(s.Log(), "a secret is on the command line") || !strings.Contains(s.Log(), "flag="+flag) {
			t.Errorf("no warning about %s in the serve log:\n%s", flag, s.Log())
		}
	}
	if _, err := os.Stat(filepath.Join(dataDir, control.OperatorTokenFile)); err == nil {
		t.Errorf("serve wrote an operator token although it was given one")
	}
	s.mustIn(t, t.TempDir(), []string{"STOPGATE_CONTROL_TOKEN=" + token}, 0, "admit", "r1")
	if msg := s.mustIn(t, t.TempDir(), []string{"STOPGATE_DATA_DIR=" + dataDir}, 1, "status", "r1"); !strings.Contains(msg, "the operator token: open") {
		t.Errorf("the CLI pointed at a data dir without the token: %q", msg)
	}

	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	quiet := startServe(t, "--data-dir", t.TempDir(), "--control-token-file", tokenFile)
	if strings.Contains(quiet.Log(), "on the command line") {
		t.Errorf("serve warned about a token from a file:\n%s", quiet.Log())
	}
	quiet.mustIn(t, t.TempDir(), []string{"STOPGATE_CONTROL_TOKEN_FILE=" + tokenFile}, 0, "admit", "r1")
}

// TestControlAuthNoneIsOpenAndSaysSo: opening the control plane is a flag,
// logged loudly, and the record says nobody proved who they were.
func TestControlAuthNoneIsOpenAndSaysSo(t *testing.T) {
	s := startServe(t, "--data-dir", t.TempDir(), "--control-auth", "none")
	if !strings.Contains(s.Log(), "THE CONTROL API IS OPEN") || !strings.Contains(s.Log(), "level=WARN") {
		t.Errorf("no loud warning in the serve log:\n%s", s.Log())
	}
	elsewhere := t.TempDir()
	s.mustIn(t, elsewhere, []string{"USER=bob"}, 0, "admit", "r1")
	out := s.mustIn(t, elsewhere, nil, 0, "audit", "r1")
	if !strings.Contains(out, "anonymous (cli:bob)") {
		t.Errorf("audit of an open control plane does not say anonymous:\n%s", out)
	}
}
