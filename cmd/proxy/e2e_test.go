package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/cli"
	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/state"
)

// The end-to-end tests run the stopgate binary as an operator would: built
// once by TestMain, serving on free loopback ports, driven by its own CLI.

// binary is the stopgate built by TestMain.
var binary string

func TestMain(m *testing.M) {
	os.Exit(testkit.MainWithStopgate(m, "../..", &binary))
}

// anyPort asks the kernel for a free port when serve listens: a test
// never picks one and hands it on, which another test may take first.
const anyPort = "127.0.0.1:0"

// server is one `stopgate serve` process, on the ports it chose itself
// (its ready file's).
type server struct {
	*testkit.Process
	control string // http://host:port
	// dataDir is serve's --data-dir, where the CLI finds the operator
	// token (STOPGATE_DATA_DIR).
	dataDir string
}

// allowTestUpstreams are the one allow these tests need: their providers
// and sites listen on loopback (IPv4, and IPv6 for transparent mode's),
// which the proxy refuses by default.
var allowTestUpstreams = []string{"--allow-dest", "127.0.0.1", "--allow-dest", "::1"}

// startServe starts `stopgate serve` with args on fresh loopback ports,
// allowing the tests' loopback upstreams, and waits until /healthz answers.
func startServe(t *testing.T, args ...string) *server {
	t.Helper()
	return startServeIn(t, "", append(slices.Clone(allowTestUpstreams), args...)...)
}

// startServeAsShipped is startServe with nothing allowed but what args say.
func startServeAsShipped(t *testing.T, args ...string) *server {
	t.Helper()
	return startServeIn(t, "", args...)
}

// startServeIn starts serve in directory dir ("": the test's) with args,
// as given.
func startServeIn(t *testing.T, dir string, args ...string) *server {
	t.Helper()
	return startServeWith(t, dir, nil, args...)
}

// startServeWith starts serve in dir with env added to its clean
// environment, and args as given.
func startServeWith(t *testing.T, dir string, env []string, args ...string) *server {
	t.Helper()
	s := &server{}
	for i, a := range args[:max(len(args)-1, 0)] {
		if a == "--data-dir" {
			s.dataDir = args[i+1]
		}
	}
	s.Process = testkit.StartServe(t, binary, args, append(testkit.CleanEnv(), env...), dir)
	s.control = "http://" + s.Bound.Control
	return s
}

// stopgate runs one CLI command line against s and returns its exit code
// and output.
func (s *server) stopgate(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	env := []string{"STOPGATE_CONTROL=" + s.control}
	if s.dataDir != "" {
		env = append(env, "STOPGATE_DATA_DIR="+s.dataDir)
	}
	return runBinary(t, env, args...)
}

func runBinary(t *testing.T, env []string, args ...string) (int, string, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	cmd.Env = append(testkit.CleanEnv(), env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	if err != nil {
		ee, ok := err.(*exec.ExitError)
		if !ok {
			t.Fatalf("stopgate %q: %v", args, err)
		}
		code = ee.ExitCode()
	}
	return code, stdout.String(), stderr.String()
}

// operatorToken is the operator token serve wrote into its data directory,
// for a test that calls the control API without the CLI.
func (s *server) operatorToken(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(s.dataDir, control.OperatorTokenFile))
	if err != nil {
		t.Fatalf("the operator token of serve (--data-dir %q): %v", s.dataDir, err)
	}
	return strings.TrimSpace(string(b))
}

// asOperator calls the control API with the operator token: method on
// path, with body as JSON when there is one. It returns the status and the
// body of the answer.
func (s *server) asOperator(t *testing.T, method, path, body string) (int, []byte) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, s.control+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Authorization", "Bearer "+s.operatorToken(t))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// must runs a command line that must exit with code, and returns stdout
// (stderr when code is not 0).
func (s *server) must(t *testing.T, code int, args ...string) string {
	t.Helper()
	got, out, errOut := s.stopgate(t, args...)
	if got != code {
		t.Fatalf("stopgate %s: exit %d, want %d\nstdout: %s\nstderr: %s\nserve log:\n%s", strings.Join(args, " "), got, code, out, errOut, s.Log())
	}
	t.Logf("$ stopgate %s  (exit %d)\n%s%s", strings.Join(args, " "), got, out, errOut)
	if code == 0 {
		return out
	}
	return errOut
}

func TestEndToEnd(t *testing.T) {
	// The sweeper is slowed so that the walk shows the row exactly as the
	// cancel left it; moving it on is TestDrain*'s and the state suite's.
	s := startServe(t, "--data-dir", t.TempDir(), "--sweep-interval", "1m")
	s.must(t, 0, "admit", "r1")
	s.must(t, 0, "cancel", "r1", "--reason", "test")
	out := s.must(t, 0, "status", "r1", "--json")
	if !strings.Contains(out, `"status":"CANCELLING"`) || !strings.Contains(out, `"cancel_version":2`) {
		t.Fatalf("status --json: %s", out)
	}
	var row state.Run
	if err := json.Unmarshal([]byte(out), &row); err != nil || row.ID != "r1" || row.Reason != "test" {
		t.Fatalf("status --json is not the row: %v %s", err, out)
	}
	out = s.must(t, 0, "runs", "--status", "CANCELLING")
	if !strings.Contains(out, "r1") {
		t.Fatalf("runs --status CANCELLING does not list r1:\n%s", out)
	}
	s.must(t, 0, "status", "r1")

	msg := s.must(t, 1, "status", "nope")
	if !strings.Contains(msg, "run nope not found") {
		t.Errorf("unknown run: %q", msg)
	}
	msg = s.must(t, 1, "admit", "r1")
	if !strings.Contains(msg, "run_not_active") {
		t.Errorf("admit after cancel: %q", msg)
	}
	for _, tc := range []struct {
		args []string
		say  string
	}{
		{[]string{"frobnicate"}, `unknown verb "frobnicate"`},
		{[]string{"cancel", "r1", "--bogus"}, "flag provided but not defined: -bogus"},
		{[]string{"cancel"}, "missing RUN"},
		{[]string{"runs", "--status", "RUNNING"}, `--status "RUNNING"`},
	} {
		if msg := s.must(t, 2, tc.args...); !strings.Contains(msg, tc.say) {
			t.Errorf("stopgate %q: %q does not say %q", tc.args, msg, tc.say)
		}
	}

	// SIGTERM is a clean shutdown, store closed last.
	if err := s.Stop(); err != nil {
		t.Fatalf("stop: %v\n%s", err, s.Log())
	}
	if !strings.Contains(s.Log(), "store closed") {
		t.Errorf("serve log lacks the store close:\n%s", s.Log())
	}
}

func TestServeRefusesBadConfig(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	dir := t.TempDir()
	for _, tc := range []struct {
		env  []string
		args []string
		code int
		say  string
	}{
		{nil, []string{"--drain-timeout", "soon"}, 2, "-drain-timeout: want a duration"},
		{[]string{"STOPGATE_CONTROL_ADDR=nowhere"}, nil, 2, `STOPGATE_CONTROL_ADDR: "nowhere": want host:port`},
		{nil, []string{"--store", "postgres://db/x"}, 2, `--store: store URL "postgres://db/x": unknown scheme "postgres"`},
		{nil, []string{"--store", "redis://127.0.0.1:6379/notanumber"}, 2, "--store"},
		{nil, []string{"--control-addr", busy.Addr().String(), "--data-dir", dir}, 1, "--control-addr " + busy.Addr().String()},
	} {
		code, _, errOut := runBinary(t, tc.env, append([]string{"serve", "--proxy-addr", anyPort, "--browser-addr", anyPort}, tc.args...)...)
		if code != tc.code || !strings.Contains(errOut, tc.say) {
			t.Errorf("serve %q %q: exit %d, want %d saying %q; stderr:\n%s", tc.env, tc.args, code, tc.code, tc.say, errOut)
		}
	}
}

// TestCancelSurvivesKill9OfStopgateAndRedis: an acknowledged cancel is in
// the store, not in a process; killing both processes does not undo it.
func TestCancelSurvivesKill9OfStopgateAndRedis(t *testing.T) {
	t.Run("Redis", func(t *testing.T) {
		redis := redisserver.Start(t, redisserver.Options{AppendFsyncAlways: true, Password: testRedisPassword})
		s := startServe(t, "--store", "redis://"+redis.Addr()+"/0", "--store-password-file", passwordFile(t), "--require-durable", "--data-dir", t.TempDir())
		if !strings.Contains(s.Log(), "durable=true") {
			t.Errorf("serve did not report the Redis persistence:\n%s", s.Log())
		}
		crashAndCheck(t, s, redis.Restart)
	})
	t.Run("Embedded", func(t *testing.T) {
		s := startServe(t, "--data-dir", t.TempDir())
		crashAndCheck(t, s, func() {})
	})
}

func crashAndCheck(t *testing.T, s *server, crashStore func()) {
	s.must(t, 0, "admit", "r1")
	s.must(t, 0, "cancel", "r1", "--reason", "kill -9 test")

	s.Kill9()
	crashStore()
	s.Start()

	out := s.must(t, 0, "status", "r1", "--json")
	var row state.Run
	if err := json.Unmarshal([]byte(out), &row); err != nil {
		t.Fatalf("status --json: %v: %s", err, out)
	}
	if row.CancelVersion != 2 || row.Status == state.StatusActive || row.Reason != "kill -9 test" {
		t.Fatalf("after kill -9 the row is %s/%d (%q), want cancelled at version 2", row.Status, row.CancelVersion, row.Reason)
	}
	if msg := s.must(t, 1, "admit", "r1"); !strings.Contains(msg, "run_not_active") {
		t.Fatalf("admit after restart: %q", msg)
	}
}

// TestRequireDurableRefusesRedisWithoutFsync: Redis without the AOF may
// lose an acknowledged cancel, so --require-durable does not start on it.
func TestRequireDurableRefusesRedisWithoutFsync(t *testing.T) {
	redis := redisserver.Start(t, redisserver.Options{})
	code, _, errOut := runBinary(t, nil, "serve", "--proxy-addr", anyPort, "--control-addr", anyPort,
		"--store", redis.URL(), "--require-durable", "--data-dir", t.TempDir())
	if code != cli.ExitError || !strings.Contains(errOut, "--require-durable") {
		t.Fatalf("exit %d, want %d naming --require-durable; stderr:\n%s", code, cli.ExitError, errOut)
	}
}

// TestServeTellsTheAddressesItBoundInTheReadyFile: every listener on port
// 0 gets a port of its own, the ready file names each, what it names
// answers, and the file is gone once serve has stopped.
func TestServeTellsTheAddressesItBoundInTheReadyFile(t *testing.T) {
	s := startServe(t, "--data-dir", t.TempDir(), "--metrics-addr", anyPort)
	b := s.Bound
	ports := map[string]bool{}
	for _, a := range []string{b.Proxy, b.Control, b.Browser, b.Metrics} {
		host, port, err := net.SplitHostPort(a)
		if err != nil || host != "127.0.0.1" || port == "0" || ports[port] {
			t.Fatalf("ready file %+v: %q is not a port of its own", b, a)
		}
		ports[port] = true
	}
	for _, url := range []string{"http://" + b.Control + "/healthz", "http://" + b.Metrics + "/metrics"} {
		resp, err := http.Get(url)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %v %v", url, resp, err)
		}
		resp.Body.Close()
	}
	if !strings.Contains(s.Log(), "addr="+b.Proxy) {
		t.Errorf("the start line does not say the proxy's bound address %s:\n%s", b.Proxy, s.Log())
	}
	file := s.Args()[slices.Index(s.Args(), "--ready-file")+1]
	if err := s.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(file); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the ready file after serve stopped: %v", err)
	}
}
