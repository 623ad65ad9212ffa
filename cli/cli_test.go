package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/redirect"
	"github.com/stopgate/stopgate/serve"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
)

// These run the CLI in-process against a real control API over the real
// embedded store; e2e_test.go runs the built binary.

func TestParseInterspersed(t *testing.T) {
	tests := []struct {
		args    []string
		pos     []string
		reason  string
		wait    bool
		wantErr bool
	}{
		{args: []string{"r1"}, pos: []string{"r1"}},
		{args: []string{"r1", "--reason", "x", "--wait"}, pos: []string{"r1"}, reason: "x", wait: true},
		{args: []string{"--reason=x", "r1", "--wait"}, pos: []string{"r1"}, reason: "x", wait: true},
		{args: []string{"-wait", "r1", "r2"}, pos: []string{"r1", "r2"}, wait: true},
		{args: []string{"--", "--wait"}, pos: []string{"--wait"}},
		{args: []string{"r1", "--reason", "--", "--wait"}, pos: []string{"r1"}, reason: "--", wait: true},
		{args: []string{"r1", "--bogus"}, wantErr: true},
		{args: []string{"r1", "--reason"}, wantErr: true},
	}
	for _, tc := range tests {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		fs.SetOutput(&bytes.Buffer{})
		reason := fs.String("reason", "", "")
		wait := fs.Bool("wait", false, "")
		pos, err := parseInterspersed(fs, tc.args)
		if (err != nil) != tc.wantErr {
			t.Errorf("%q: err %v, want error %v", tc.args, err, tc.wantErr)
			continue
		}
		if tc.wantErr {
			continue
		}
		if !slices.Equal(pos, tc.pos) || *reason != tc.reason || *wait != tc.wait {
			t.Errorf("%q: got %q reason=%q wait=%v; want %q reason=%q wait=%v", tc.args, pos, *reason, *wait, tc.pos, tc.reason, tc.wait)
		}
	}
}

func env(m map[string]string) func(string) string {
	return func(k string) string { return m[k] }
}

// harness is a control API on the embedded store, and a CLI pointed at it
// with the operator token in $STOPGATE_CONTROL_TOKEN.
type harness struct {
	store *filestore.Store
	url   string
	token string
}

// harnessToken is the operator token of a harness made without one.
const harnessToken = "sgop_harness-operator-token"

func newHarness(t *testing.T, token string) *harness {
	t.Helper()
	if token == "" {
		token = harnessToken
	}
	store, err := filestore.Open(filepath.Join(t.TempDir(), "stopgate.db"), filestore.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatalf("open store: %v", err)
	}
	t.Cleanup(func() { _ = store.Close() })
	h, err := control.New(control.Options{Store: store, Token: token, DrainTimeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &harness{store: store, url: srv.URL, token: token}
}

// cli runs one command line in-process and returns exit code and output.
func (h *harness) cli(t *testing.T, extraEnv map[string]string, args ...string) (int, string, string) {
	t.Helper()
	e := map[string]string{"STOPGATE_CONTROL": h.url, "USER": "tester", "STOPGATE_CONTROL_TOKEN": h.token}
	for k, v := range extraEnv {
		e[k] = v
	}
	var stdout, stderr bytes.Buffer
	c := newCLI(&stdout, &stderr, env(e))
	c.pollEvery = 20 * time.Millisecond
	c.waitSlack = 500 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	code := c.run(ctx, args)
	return code, stdout.String(), stderr.String()
}

func (h *harness) want(t *testing.T, args []string, code int, stdoutHas, stderrHas string) string {
	t.Helper()
	got, out, errOut := h.cli(t, nil, args...)
	if got != code || !strings.Contains(out, stdoutHas) || !strings.Contains(errOut, stderrHas) {
		t.Fatalf("stopgate %q: exit %d, want %d\nstdout: %s\nstderr: %s\nwant stdout to have %q, stderr %q", args, got, code, out, errOut, stdoutHas, stderrHas)
	}
	return out
}

func TestVerbs(t *testing.T) {
	h := newHarness(t, "")
	h.want(t, []string{"admit", "r1"}, 0, "admitted r1: ACTIVE at cancel_version 1", "")
	h.want(t, []string{"admit", "r1"}, 0, "r1 was already ACTIVE at cancel_version 1", "")
	h.want(t, []string{"status", "r1"}, 0, "cancel_version  1", "")
	h.want(t, []string{"cancel", "r1", "--reason", "test", "--drain", "45"}, 0, "r1 is CANCELLING at cancel_version 2", "")
	h.want(t, []string{"cancel", "--reason", "again", "r1"}, 0, "r1 was already CANCELLING at cancel_version 2; nothing changed", "")
	out := h.want(t, []string{"status", "--json", "r1"}, 0, `"status":"CANCELLING"`, "")
	if !strings.Contains(out, `"cancel_version":2`) || !strings.Contains(out, `"reason":"test"`) || strings.Count(out, "\n") != 1 {
		t.Errorf("status --json: %s", out)
	}
	h.want(t, []string{"status", "r1"}, 0, "reason          test", "")
	h.want(t, []string{"admit", "r1"}, 1, "", "run_not_active: run r1 is CANCELLING at cancel_version 2")
	h.want(t, []string{"runs", "--status", "cancelling"}, 0, "r1", "")
	h.want(t, []string{"runs", "--status", "ACTIVE"}, 0, "no runs", "")
	h.want(t, []string{"runs", "--json"}, 0, `{"runs":[{"run_id":"r1"`, "")

	// complete reads the version itself, and the API refuses a stale one.
	h.want(t, []string{"admit", "r2"}, 0, "admitted", "")
	h.want(t, []string{"complete", "r2", "--version", "3"}, 1, "", "stale_version")
	h.want(t, []string{"complete", "r2"}, 0, "completed r2 at cancel_version 1", "")
	h.want(t, []string{"complete", "r1"}, 1, "", "run_not_active")
	h.want(t, []string{"cancel", "r2"}, 1, "", "run_not_active: run r2 is COMPLETED")

	// The actor reaches the audit log.
	out = h.want(t, []string{"audit", "r1"}, 0, "Events (2):", "")
	for _, s := range []string{"cli:tester", "run.cancel", "ACTIVE -> CANCELLING", "Intents (0):"} {
		if !strings.Contains(out, s) {
			t.Errorf("audit lacks %q:\n%s", s, out)
		}
	}
	out = h.want(t, []string{"audit", "r1", "--json"}, 0, `{"run":{"run_id":"r1"`, "")
	if !strings.Contains(out, `"intents":[]`) || !strings.Contains(out, `"events":[{`) {
		t.Errorf("audit --json: %s", out)
	}

	h.want(t, []string{"status", "nope"}, 1, "", "run nope not found")
	// A typo is not a stop: the tombstone is written, but cancel says no
	// run was stopped and exits 4, unless the tombstone is meant.
	h.want(t, []string{"cancel", "ghost"}, ExitTombstone, "ghost was never admitted: recorded CANCELLED at cancel_version 2",
		"ghost was never admitted: no run of that id was stopped")
	h.want(t, []string{"admit", "ghost"}, 1, "", "run_not_active: run ghost is CANCELLED")
	h.want(t, []string{"cancel", "ghost"}, 0, "ghost was already CANCELLED at cancel_version 2; nothing changed", "")
	// Each tombstone in a millisecond of its own, so that --sort updated
	// below has an order to show.
	time.Sleep(2 * time.Millisecond)
	h.want(t, []string{"cancel", "ghost2", "--tombstone"}, 0, "ghost2 was never admitted: recorded CANCELLED at cancel_version 2", "")
	time.Sleep(2 * time.Millisecond)
	out = h.want(t, []string{"cancel", "ghost3", "--json"}, ExitTombstone, `"tombstone":true`, "never admitted")
	if strings.Count(out, "\n") != 1 {
		t.Errorf("cancel --json of a tombstone: %s", out)
	}

	// runs: by id prefix, time, order and count.
	out = h.want(t, []string{"runs", "--prefix", "ghost", "--sort", "updated", "--limit", "2"}, 0, "… and 1 more (--limit 2)", "")
	if !strings.Contains(out, "ghost3") || !strings.Contains(out, "ghost2") || strings.Contains(out, "ghost ") || strings.Index(out, "ghost3") > strings.Index(out, "ghost2") {
		t.Errorf("runs --prefix ghost --sort updated --limit 2: want ghost3 then ghost2:\n%s", out)
	}
	h.want(t, []string{"runs", "--since", "1h", "--prefix", "r"}, 0, "r2", "")
	h.want(t, []string{"runs", "--since", "2999-01-01T00:00:00Z"}, 0, "no runs", "")
	h.want(t, []string{"runs", "--since", "yesterday"}, ExitUsage, "", "--since: \"yesterday\" is neither an RFC 3339 time")
	h.want(t, []string{"runs", "--sort", "name"}, ExitUsage, "", "--sort \"name\": want id, updated or created")
	h.want(t, []string{"runs", "--limit", "-1"}, ExitUsage, "", "--limit")
}

func TestUsageErrors(t *testing.T) {
	h := newHarness(t, "")
	for _, tc := range []struct {
		args []string
		say  string
	}{
		{nil, "Usage:"},
		{[]string{"frobnicate"}, `unknown verb "frobnicate"`},
		{[]string{"admit"}, "stopgate admit: missing RUN"},
		{[]string{"admit", "a", "b"}, "want one RUN, got 2"},
		{[]string{"admit", "bad id"}, "run id"},
		{[]string{"cancel", "r1", "--drain", "soon"}, "drain_timeout: want a duration"},
		{[]string{"cancel", "r1", "--drain", "-3s"}, "negative"},
		{[]string{"cancel", "r1", "--bogus"}, "flag provided but not defined: -bogus"},
		{[]string{"complete", "r1", "--version", "x"}, "-version"},
		{[]string{"runs", "r1"}, "takes no arguments"},
		{[]string{"runs", "--status", "RUNNING"}, `--status "RUNNING"`},
		{[]string{"status", "r1", "--control", "ftp://x"}, "--control (or STOPGATE_CONTROL)"},
		{[]string{"help", "nope"}, `unknown verb "nope"`},
	} {
		code, _, errOut := h.cli(t, nil, tc.args...)
		if code != ExitUsage || !strings.Contains(errOut, tc.say) {
			t.Errorf("stopgate %q: exit %d, stderr %q; want %d saying %q", tc.args, code, errOut, ExitUsage, tc.say)
		}
	}
	if code, out, _ := h.cli(t, nil, "help", "cancel"); code != 0 || !strings.Contains(out, "-drain") || !strings.Contains(out, "--wait") {
		t.Errorf("help cancel: %d %s", code, out)
	}
	if code, out, _ := h.cli(t, nil, "cancel", "-h"); code != 0 || !strings.Contains(out, "Usage: stopgate cancel") {
		t.Errorf("cancel -h: %d %s", code, out)
	}
	if code, out, _ := h.cli(t, nil, "help"); code != 0 || !strings.Contains(out, "stopgate serve") {
		t.Errorf("help: %d %s", code, out)
	}
}

// TestCLIFindsItsToken: the client verbs take the token from the command
// line, a file or the environment, else from serve's data directory, and
// say after a 401 which token they sent.
func TestCLIFindsItsToken(t *testing.T) {
	const token = "sgop_the-servers-operator-token"
	h := newHarness(t, token)
	h.want(t, []string{"admit", "r1"}, 0, "admitted", "")
	// The directory serve would have written, elsewhere and here.
	dataDir, cwd := t.TempDir(), t.TempDir()
	t.Chdir(cwd)
	for _, dir := range []string{dataDir, filepath.Join(cwd, "stopgate-data")} {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, control.OperatorTokenFile), []byte(token+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	tokenFile := filepath.Join(dataDir, control.OperatorTokenFile)
	emptyDir := t.TempDir()
	for _, tc := range []struct {
		name      string
		env       map[string]string
		args      []string
		code      int
		stderrHas string
	}{
		{"TokenFlag", nil, []string{"--token", token}, 0, ""},
		{"TokenFileFlag", nil, []string{"--token-file", tokenFile}, 0, ""},
		{"ControlTokenVariable", map[string]string{"STOPGATE_CONTROL_TOKEN": token}, nil, 0, ""},
		{"ControlTokenFileVariable", map[string]string{"STOPGATE_CONTROL_TOKEN_FILE": tokenFile}, nil, 0, ""},
		{"OlderTokenVariable", map[string]string{"STOPGATE_TOKEN": token}, nil, 0, ""},
		{"DataDirFlag", nil, []string{"--data-dir", dataDir}, 0, ""},
		{"DataDirVariable", map[string]string{"STOPGATE_DATA_DIR": dataDir}, nil, 0, ""},
		{"DefaultDataDirHere", nil, nil, 0, ""},
		{"FlagBeatsTheFile", nil, []string{"--token", "sgop_wrong", "--data-dir", dataDir}, 1, "The token from --token was refused"},
		{"NoTokenAnywhere", nil, []string{"--control", "http://localhost:1"}, 1, "cannot reach"},
		{"ExplicitDataDirWithoutToken", nil, []string{"--data-dir", emptyDir}, 1, "the operator token: open " + filepath.Join(emptyDir, control.OperatorTokenFile)},
		{"EmptyTokenFile", nil, []string{"--token-file", filepath.Join(emptyDir, "absent")}, 2, "--token-file: open"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := map[string]string{"STOPGATE_CONTROL_TOKEN": ""}
			maps.Copy(e, tc.env)
			code, out, errOut := h.cli(t, e, append([]string{"status", "r1"}, tc.args...)...)
			if code != tc.code || !strings.Contains(errOut, tc.stderrHas) {
				t.Fatalf("exit %d, want %d with stderr saying %q\nstdout: %s\nstderr: %s", code, tc.code, tc.stderrHas, out, errOut)
			}
			if code == 0 && !strings.Contains(out, "ACTIVE") {
				t.Fatalf("stdout: %s", out)
			}
		})
	}

	// Without the directory here, nothing is sent, and the 401 says where
	// the token would have been.
	t.Chdir(emptyDir)
	code, _, errOut := h.cli(t, map[string]string{"STOPGATE_CONTROL_TOKEN": ""}, "status", "r1")
	if code != ExitError || !strings.Contains(errOut, "unauthorized") || !strings.Contains(errOut, "No token was sent") || !strings.Contains(errOut, "STOPGATE_DATA_DIR") {
		t.Fatalf("exit %d, stderr %q; want a 401 that says no token was sent and where to find one", code, errOut)
	}
}

// TestCLISendsTheLocalTokenOnlyToThisMachine: the operator token found in
// ./stopgate-data is never sent to a control API on another host unless
// the data directory is named.
func TestCLISendsTheLocalTokenOnlyToThisMachine(t *testing.T) {
	cwd := t.TempDir()
	t.Chdir(cwd)
	if err := os.MkdirAll("stopgate-data", 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join("stopgate-data", control.OperatorTokenFile), []byte("sgop_local\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := newCLI(io.Discard, io.Discard, env(nil))
	for _, tc := range []struct {
		control, dataDir, want string
	}{
		{"http://127.0.0.1:8081", "", "sgop_local"},
		{"http://localhost:8081", "", "sgop_local"},
		{"http://[::1]:8081", "", "sgop_local"},
		{"https://stopgate.internal:8081", "", ""},
		{"http://10.0.0.7:8081", "", ""},
		{"http://10.0.0.7:8081", "stopgate-data", "sgop_local"},
	} {
		got, _, err := c.findToken(&verbOpts{control: tc.control, dataDir: tc.dataDir})
		if err != nil || got != tc.want {
			t.Errorf("--control %s --data-dir %q: token %q, %v; want %q", tc.control, tc.dataDir, got, err, tc.want)
		}
	}
}

func TestUnreachableControl(t *testing.T) {
	h := newHarness(t, "")
	code, _, errOut := h.cli(t, map[string]string{"STOPGATE_CONTROL": "http://127.0.0.1:1"}, "status", "r1")
	if code != ExitError || !strings.Contains(errOut, "cannot reach the control API at http://127.0.0.1:1") {
		t.Errorf("exit %d, stderr %q", code, errOut)
	}
}

// sweep ticks the run on the real store, as serve's sweeper
// will, until the test ends.
func sweep(t *testing.T, store state.Store, runID string) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			_, _ = store.Tick(ctx, state.TickRequest{RunID: runID, Actor: "sweeper:test"})
			select {
			case <-ctx.Done():
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
}

func TestCancelWait(t *testing.T) {
	h := newHarness(t, "")
	ctx := context.Background()

	t.Run("Cancelled", func(t *testing.T) {
		h.want(t, []string{"admit", "drained"}, 0, "admitted", "")
		sweep(t, h.store, "drained")
		out := h.want(t, []string{"cancel", "drained", "--wait"}, 0, "drained is CANCELLED (drained) at cancel_version 2", "")
		if !strings.Contains(out, "intents: none") {
			t.Errorf("summary lacks the counts:\n%s", out)
		}
	})

	t.Run("Tombstone", func(t *testing.T) {
		h.want(t, []string{"cancel", "never-seen", "--wait", "--json"}, ExitTombstone, `"status":"CANCELLED"`, "never admitted")
		h.want(t, []string{"cancel", "never-seen-2", "--wait", "--json", "--tombstone"}, 0, `"status":"CANCELLED"`, "")
	})

	t.Run("Unknown", func(t *testing.T) {
		h.want(t, []string{"admit", "cut"}, 0, "admitted", "")
		g, err := h.store.Guard(ctx, state.GuardRequest{RunID: "cut", Key: "charge-42", ExplicitKey: true, Boundary: state.BoundaryHTTP,
			Method: "POST", Target: "https://api.example.com/v1/charges", LeaseOwner: "proxy:test", LeaseTTL: time.Minute, Actor: "proxy:test"})
		if err != nil || !g.Admitted {
			t.Fatalf("guard: %+v %v", g, err)
		}
		sweep(t, h.store, "cut")
		code, out, errOut := h.cli(t, nil, "cancel", "cut", "--drain", "0s", "--wait")
		if code != ExitUnknown {
			t.Fatalf("exit %d, want %d\n%s\n%s", code, ExitUnknown, out, errOut)
		}
		for _, s := range []string{"cut is UNKNOWN (drain_timeout)", "UNKNOWN=1", "charge-42", "https://api.example.com/v1/charges", "stopgate resolve cut charge-42 --applied|--not-applied"} {
			if !strings.Contains(out, s) {
				t.Errorf("summary lacks %q:\n%s", s, out)
			}
		}
	})

	t.Run("StillCancellingAtBound", func(t *testing.T) {
		h.want(t, []string{"admit", "stuck"}, 0, "admitted", "")
		// No sweeper: nothing moves the run on, and the wait must end.
		start := time.Now()
		h.want(t, []string{"cancel", "stuck", "--drain", "0", "--wait"}, 1, "stuck is CANCELLING", "stuck is still CANCELLING after waiting")
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("wait took %s, want it bounded by the drain plus the slack", d)
		}
	})
}

// TestSafeText: text from the record never drives the terminal.
func TestSafeText(t *testing.T) {
	if got := safe("stop\x1b[2Jnow"); strings.ContainsRune(got, 0x1b) {
		t.Errorf("escape passed through: %q", got)
	}
	if got := safe("plain reason"); got != "plain reason" {
		t.Errorf("plain text changed: %q", got)
	}
}

// TestActorWithoutUSERIsTheOSUser: with $USER unset (cron, systemd, a
// container), the audit log still names who ran the CLI: the OS's name for
// this process's user, not a bare "cli".
func TestActorWithoutUSERIsTheOSUser(t *testing.T) {
	c := newCLI(io.Discard, io.Discard, func(string) string { return "" })
	u, err := user.Current()
	want := "cli:uid-" + strconv.Itoa(os.Getuid())
	if err == nil && u.Username != "" {
		want = "cli:" + u.Username
	}
	if got := c.actor(); got != want {
		t.Fatalf("actor() = %q, want %q", got, want)
	}
	if got := newCLI(io.Discard, io.Discard, func(k string) string { return map[string]string{"USER": "alice"}[k] }).actor(); got != "cli:alice" {
		t.Fatalf("actor() with USER=alice = %q", got)
	}
}

// neverBinder fails the test if the control API gets as far as binding.
type neverBinder struct{ t *testing.T }

func (b neverBinder) Bind(uint32, string, int64, time.Duration) (redirect.Binding, error) {
	b.t.Error("a uid out of range reached Bind")
	return redirect.Binding{}, nil
}

func (b neverBinder) Renew(string) (redirect.Binding, error) {
	return redirect.Binding{}, redirect.ErrNoBinding
}

func (b neverBinder) Unbind(string) error { return redirect.ErrNoBinding }

// TestBoundsAreRefusedTheSameByEveryEdge: the bounds package state and
// package redirect own — a cancel's drain of at most 7 days, a uid from 0
// to 2^32-2 — are refused with their owner's words by serve's flags, the
// CLI's verbs and the control API alike.
func TestBoundsAreRefusedTheSameByEveryEdge(t *testing.T) {
	store := testkit.FileStore(t)
	api, err := control.New(control.Options{Store: store, Open: true, DrainTimeout: time.Minute, Transparent: neverBinder{t}, Logger: testkit.Logger()})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	post := func(path, body string) (int, string) {
		resp, err := http.Post(srv.URL+path, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var r struct{ Error, Message string }
		_ = json.NewDecoder(resp.Body).Decode(&r)
		return resp.StatusCode, r.Error + ": " + r.Message
	}
	cli := func(args ...string) (int, string) {
		var stdout, stderr bytes.Buffer
		c := newCLI(&stdout, &stderr, env(map[string]string{"STOPGATE_CONTROL": srv.URL}))
		return c.run(context.Background(), args), stderr.String()
	}

	tooLong := state.MaxDrainTimeout + time.Hour
	drainWords := state.Why(state.CheckDrainTimeout(tooLong))
	if _, err := serve.ParseConfig([]string{"--drain-timeout", tooLong.String()}, env(nil)); err == nil || !strings.Contains(err.Error(), drainWords) {
		t.Errorf("serve --drain-timeout %s: %v, want %q", tooLong, err, drainWords)
	}
	if code, out := cli("cancel", "r", "--drain", tooLong.String()); code != 2 || !strings.Contains(out, drainWords) {
		t.Errorf("stopgate cancel --drain %s: exit %d %s, want 2 and %q", tooLong, code, out, drainWords)
	}
	if code, msg := post("/v1/runs/r/cancel", `{"drain_timeout":"`+tooLong.String()+`"}`); code != http.StatusBadRequest || !strings.Contains(msg, drainWords) {
		t.Errorf("POST /v1/runs/r/cancel with a drain of %s: %d %s, want 400 and %q", tooLong, code, msg, drainWords)
	}
	if _, err := store.Get(context.Background(), "r"); err == nil {
		t.Errorf("a refused cancel wrote a row")
	}

	const uid = int64(redirect.MaxUID) + 1
	uidWords := redirect.CheckUID(uid)
	if code, out := cli("redirect", "install", "--uid", "4294967295", "--port", "1"); code != 2 || !strings.Contains(out, uidWords) {
		t.Errorf("stopgate redirect --uid %d: exit %d %s, want 2 and %q", uid, code, out, uidWords)
	}
	if code, out := cli("exec", "--run", "r", "--isolate", "--uid", "4294967295", "--", "true"); code != 2 || !strings.Contains(out, uidWords) {
		t.Errorf("stopgate exec --uid %d: exit %d %s, want 2 and %q", uid, code, out, uidWords)
	}
	if code, msg := post("/v1/transparent/bindings", `{"uid":4294967295,"run_id":"r"}`); code != http.StatusBadRequest || !strings.Contains(msg, uidWords) {
		t.Errorf("POST /v1/transparent/bindings uid %d: %d %s, want 400 and %q", uid, code, msg, uidWords)
	}
}
