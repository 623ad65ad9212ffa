package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"io"
	"log/slog"
	"maps"
	"net/http/httptest"
	"os"
	"os/user"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
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

func TestServeConfig(t *testing.T) {
	cfg, err := parseServeConfig(nil, env(nil))
	if err != nil {
		t.Fatalf("defaults: %v", err)
	}
	want := serveConfig{ProxyAddr: "127.0.0.1:8080", ControlAddr: "127.0.0.1:8081", BrowserAddr: "127.0.0.1:8082",
		Chromium: "/usr/bin/chromium", BrowserLinger: 30 * time.Second, BrowserMax: 8, BrowserIsolation: "namespaces", BrowserUID: 2147000000,
		DataDir: "./stopgate-data", ControlAuth: "token",
		DrainTimeout: 30 * time.Second, AutoAdmit: true, LogLevel: slog.LevelInfo,
		LeaseTTL: 15 * time.Second, StoreTimeout: 2 * time.Second, RecheckInterval: 2 * time.Second, SweepInterval: time.Second, Retention: 7 * 24 * time.Hour, LogFormat: "text",
		MaxBody: 256 << 20, MaxConns: 1024, MaxConnsPerRun: 256, MaxWatches: 1024, MaxWatchesPerRun: 64, TunnelHandshakeTimeout: 10 * time.Second, ClientIdleTimeout: 2 * time.Minute}
	if !reflect.DeepEqual(cfg, want) {
		t.Fatalf("defaults %+v, want %+v", cfg, want)
	}
	if sc := cfg.storeConfig(); sc.URL != "" || sc.DataDir != "./stopgate-data" {
		t.Errorf("default store %+v, want the embedded store in ./stopgate-data", sc)
	}

	e := env(map[string]string{
		"STOPGATE_CONTROL_ADDR": "127.0.0.1:9001", "STOPGATE_DRAIN_TIMEOUT": "5s", "STOPGATE_AUTO_ADMIT": "false",
		"STOPGATE_STORE": "redis://127.0.0.1:6379/0", "STOPGATE_REQUIRE_DURABLE": "true", "STOPGATE_LOG_LEVEL": "debug",
		"STOPGATE_CONTROL_TOKEN": "tok-0123456789abcdef", "STOPGATE_RUN": "static-1",
	})
	cfg, err = parseServeConfig([]string{"--control-addr", "127.0.0.1:9002"}, e)
	if err != nil {
		t.Fatalf("env: %v", err)
	}
	if cfg.ControlAddr != "127.0.0.1:9002" {
		t.Errorf("flag did not win over env: %s", cfg.ControlAddr)
	}
	if cfg.DrainTimeout != 5*time.Second || cfg.AutoAdmit || !cfg.RequireDurable || cfg.LogLevel != slog.LevelDebug ||
		cfg.Store != "redis://127.0.0.1:6379/0" || cfg.ControlToken != "tok-0123456789abcdef" || cfg.Run != "static-1" || cfg.SecretsOnCommandLine != "" {
		t.Errorf("env not applied: %+v", cfg)
	}
	// --allow-dest repeats; its variable lists with commas; a flag wins over the variable.
	cfg, err = parseServeConfig(nil, env(map[string]string{"STOPGATE_ALLOW_DEST": "10.0.0.0/8, api.internal:8443"}))
	if err != nil || !reflect.DeepEqual(cfg.AllowDest, []string{"10.0.0.0/8", "api.internal:8443"}) {
		t.Errorf("STOPGATE_ALLOW_DEST: %q %v", cfg.AllowDest, err)
	}
	cfg, err = parseServeConfig([]string{"--allow-dest", "127.0.0.1", "--allow-dest", "fd00::/8"}, env(map[string]string{"STOPGATE_ALLOW_DEST": "10.0.0.0/8"}))
	if err != nil || !reflect.DeepEqual(cfg.AllowDest, []string{"127.0.0.1", "fd00::/8"}) {
		t.Errorf("--allow-dest twice: %q %v", cfg.AllowDest, err)
	}
	cfg, err = parseServeConfig([]string{"--auto-admit=true", "--drain-timeout", "0s"}, e)
	if err != nil || !cfg.AutoAdmit || cfg.DrainTimeout != 0 {
		t.Errorf("flags over env: %+v, %v", cfg, err)
	}

	// Secrets read from files: the file's value, not the path, is the secret.
	tokenFile, emptyFile := filepath.Join(t.TempDir(), "token"), filepath.Join(t.TempDir(), "empty")
	if err := os.WriteFile(tokenFile, []byte("file-0123456789abcd\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(emptyFile, []byte("\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err = parseServeConfig([]string{"--control-token-file", tokenFile, "--run-token-secret", strings.Repeat("s", 32)}, env(nil))
	if err != nil || cfg.ControlToken != "file-0123456789abcd" || cfg.SecretsOnCommandLine != "--run-token-secret" {
		t.Errorf("token from a file: %+v %v; want the file's token, and --run-token-secret named as on the command line", cfg, err)
	}
	cfg, err = parseServeConfig([]string{"--control-token", "0123456789abcdef0"}, env(map[string]string{"STOPGATE_RUN_TOKEN_SECRET_FILE": tokenFile + "-absent"}))
	if err == nil || !strings.Contains(err.Error(), "STOPGATE_RUN_TOKEN_SECRET_FILE") {
		t.Errorf("a missing secret file named in the environment: %+v %v", cfg, err)
	}
	cfg, err = parseServeConfig([]string{"--control-token", "0123456789abcdef0"}, env(nil))
	if err != nil || cfg.SecretsOnCommandLine != "--control-token" {
		t.Errorf("--control-token on the command line: %q %v", cfg.SecretsOnCommandLine, err)
	}
	// The Redis password: from a file or the environment, for every URL
	// form; a password in --store on the command line is named for the
	// warning, the same URL in STOPGATE_STORE is not.
	for _, tc := range []struct {
		args []string
		env  map[string]string
	}{
		{[]string{"--store", "redis://127.0.0.1:6379/0", "--store-password-file", tokenFile}, nil},
		{[]string{"--store", "redis-cluster://n1:7000,n2:7001"}, map[string]string{"STOPGATE_STORE_PASSWORD": "file-0123456789abcd"}},
		{nil, map[string]string{"STOPGATE_STORE": "redis-sentinel://s1:26379/0?master=m", "STOPGATE_STORE_PASSWORD_FILE": tokenFile}},
	} {
		cfg, err = parseServeConfig(tc.args, env(tc.env))
		if err != nil || cfg.storeConfig().Password != "file-0123456789abcd" || cfg.SecretsOnCommandLine != "" {
			t.Errorf("store password %q %v: %q (on the command line %q) %v", tc.args, tc.env, cfg.StorePassword, cfg.SecretsOnCommandLine, err)
		}
	}
	cfg, err = parseServeConfig([]string{"--store", "redis://:hunter2@127.0.0.1:6379/0"}, env(nil))
	if err != nil || cfg.SecretsOnCommandLine != "--store" {
		t.Errorf("a password in --store on the command line: %q %v", cfg.SecretsOnCommandLine, err)
	}
	cfg, err = parseServeConfig([]string{"--store", "redis-sentinel://s1:26379/0?master=m&sentinel_password=hunter2"}, env(nil))
	if err != nil || cfg.SecretsOnCommandLine != "--store" {
		t.Errorf("a sentinel password in --store on the command line: %q %v", cfg.SecretsOnCommandLine, err)
	}
	cfg, err = parseServeConfig(nil, env(map[string]string{"STOPGATE_STORE": "redis://:hunter2@127.0.0.1:6379/0"}))
	if err != nil || cfg.SecretsOnCommandLine != "" {
		t.Errorf("a password in STOPGATE_STORE: %q %v", cfg.SecretsOnCommandLine, err)
	}

	bad := []struct {
		args []string
		env  map[string]string
		say  string
	}{
		{[]string{"--drain-timeout", "soon"}, nil, "-drain-timeout: want a duration"},
		{nil, map[string]string{"STOPGATE_DRAIN_TIMEOUT": "soon"}, "STOPGATE_DRAIN_TIMEOUT=\"soon\": want a duration"},
		{[]string{"--drain-timeout", "-1s"}, nil, "--drain-timeout: drain timeout -1s is negative"},
		{nil, map[string]string{"STOPGATE_AUTO_ADMIT": "maybe"}, "STOPGATE_AUTO_ADMIT=\"maybe\": want true or false"},
		{[]string{"--control-addr", "localhost"}, nil, "--control-addr: \"localhost\": want host:port"},
		{nil, map[string]string{"STOPGATE_PROXY_ADDR": "127.0.0.1:http"}, "STOPGATE_PROXY_ADDR: \"127.0.0.1:http\": port"},
		{[]string{"--proxy-addr", "127.0.0.1:99999"}, nil, "--proxy-addr"},
		{[]string{"--proxy-addr", "127.0.0.1:9000", "--control-addr", "127.0.0.1:9000"}, nil, "different ports"},
		{[]string{"--browser-addr", "127.0.0.1:8080"}, nil, "--browser-addr: \"127.0.0.1:8080\" is also the proxy address"},
		{nil, map[string]string{"STOPGATE_BROWSER_ADDR": "nowhere"}, "STOPGATE_BROWSER_ADDR: \"nowhere\": want host:port"},
		{[]string{"--chromium", ""}, nil, "--chromium: is empty"},
		{[]string{"--browser-linger", "-1s"}, nil, "--browser-linger: -1s is negative"},
		{nil, map[string]string{"STOPGATE_BROWSER_MAX": "0"}, "STOPGATE_BROWSER_MAX: 0: want a positive number of browsers"},
		{[]string{"--browser-isolation", "chroot"}, nil, "--browser-isolation: isolation \"chroot\": want namespaces or none"},
		{[]string{"--browser-isolation", "none", "--require-run-token"}, nil, "--browser-isolation: none leaves each browser's egress listener open to every local process"},
		{[]string{"--browser-uid", "0"}, nil, "--browser-uid: 0: want a uid other than root's"},
		{nil, map[string]string{"STOPGATE_BROWSER_UPLOAD_DIR": "/nonexistent/uploads"}, "STOPGATE_BROWSER_UPLOAD_DIR: /nonexistent/uploads is not a directory"},
		{[]string{"--store", "postgres://db/x"}, nil, "--store: store URL \"postgres://db/x\": unknown scheme \"postgres\""},
		{nil, map[string]string{"STOPGATE_STORE": "localhost:6379"}, "STOPGATE_STORE: store URL \"localhost:6379\": no scheme"},
		{[]string{"--store", "redis://:hunter2@/0"}, nil, "no host: want redis://HOST:PORT/DB"},
		{[]string{"--log-level", "loud"}, nil, "-log-level: want debug, info, warn or error"},
		{[]string{"--run", "has space"}, nil, "--run: run id \"has space\""},
		{[]string{"--config", "/nonexistent/policy.yaml"}, nil, "--config"},
		{[]string{"--bogus"}, nil, "flag provided but not defined: -bogus"},
		{[]string{"extra"}, nil, "takes no arguments"},
		{[]string{"--lease-ttl", "0s"}, nil, "--lease-ttl: 0s: want a positive duration"},
		{[]string{"--lease-ttl", "3s"}, nil, "shorter than three store timeouts"},
		{nil, map[string]string{"STOPGATE_SWEEP_INTERVAL": "-1s"}, "STOPGATE_SWEEP_INTERVAL: -1s: want a positive duration"},
		{[]string{"--cancel-replicas", "1"}, nil, "--cancel-replicas: 1 needs a Redis --store"},
		{[]string{"--store", "redis://127.0.0.1:6379/0", "--cancel-replicas", "-1"}, nil, "--cancel-replicas: -1 is negative"},
		{nil, map[string]string{"STOPGATE_CANCEL_REPLICAS": "2"}, "STOPGATE_CANCEL_REPLICAS: 2 needs a Redis --store"},
		{[]string{"--max-body", "0"}, nil, "--max-body: 0: want a positive number of bytes"},
		{[]string{"--max-body", "lots"}, nil, "-max-body"},
		{[]string{"--spool-dir", "/nonexistent/spool"}, nil, "--spool-dir: /nonexistent/spool is not a directory"},
		{[]string{"--run-token-secret", "short"}, nil, "--run-token-secret: is 5 bytes; want at least 32"},
		{[]string{"--allow-dest", "http://10.0.0.1/"}, nil, "--allow-dest: allowed destinations: destination \"http://10.0.0.1/\": a URL"},
		{nil, map[string]string{"STOPGATE_ALLOW_DEST": "10.0.0.0/8,10.1.2.3/8"}, "STOPGATE_ALLOW_DEST: allowed destinations: destination \"10.1.2.3/8\": host bits are set (did you mean 10.0.0.0/8?)"},
		{[]string{"--allow-dest", "169.254.169.254"}, nil, "--allow-dest: allowed destinations: 169.254.169.254 is link-local or cloud metadata"},
		{[]string{"--max-conns", "0"}, nil, "--max-conns: 0: want a positive number"},
		{nil, map[string]string{"STOPGATE_MAX_CONNS_PER_RUN": "-1"}, "STOPGATE_MAX_CONNS_PER_RUN: -1: want a positive number"},
		{[]string{"--max-watches", "0"}, nil, "--max-watches: 0: want a positive number"},
		{nil, map[string]string{"STOPGATE_MAX_WATCHES_PER_RUN": "-1"}, "STOPGATE_MAX_WATCHES_PER_RUN: -1: want a positive number"},
		{[]string{"--client-idle-timeout", "0s"}, nil, "--client-idle-timeout: 0s: want a positive duration"},
		{[]string{"--tunnel-handshake-timeout", "soon"}, nil, "-tunnel-handshake-timeout: want a duration"},
		{[]string{"--control-auth", "maybe"}, nil, `--control-auth: "maybe": want token or none`},
		{[]string{"--control-token", "short"}, nil, "--control-token: is 5 bytes; want at least 16"},
		{nil, map[string]string{"STOPGATE_CONTROL_TOKEN": "has a space in it, long"}, "STOPGATE_CONTROL_TOKEN: has a space"},
		{[]string{"--control-token", "sg1.looks-like-a-run-token"}, nil, "looks like a run token"},
		{[]string{"--control-token", "0123456789abcdef0"}, map[string]string{"STOPGATE_CONTROL_TOKEN_FILE": tokenFile}, "--control-token: and STOPGATE_CONTROL_TOKEN_FILE are both set"},
		{[]string{"--control-auth", "none", "--control-token-file", tokenFile}, nil, "--control-token-file: is set, and --control-auth is none"},
		{[]string{"--control-token-file", "/nonexistent/token"}, nil, "--control-token-file: open /nonexistent/token"},
		{[]string{"--control-token-file", emptyFile}, nil, "--control-token-file: the secret in " + emptyFile + " is empty"},
		{[]string{"--read-token-file", emptyFile}, nil, "--read-token-file: the secret in"},
		{nil, map[string]string{"STOPGATE_RUN_TOKEN_SECRET_FILE": tokenFile}, "STOPGATE_RUN_TOKEN_SECRET_FILE: is 19 bytes; want at least 32"},
		{[]string{"--store", "redis://127.0.0.1:6379/0", "--store-password-file", "/nonexistent/pw"}, nil, "--store-password-file: open /nonexistent/pw"},
		{[]string{"--store", "redis://127.0.0.1:6379/0", "--store-password-file", emptyFile}, nil, "--store-password-file: the secret in"},
		{[]string{"--store-password-file", tokenFile}, map[string]string{"STOPGATE_STORE_PASSWORD": "hunter2"}, "--store-password-file and STOPGATE_STORE_PASSWORD are both set"},
		{[]string{"--store", "redis://:hunter2@127.0.0.1:6379/0"}, map[string]string{"STOPGATE_STORE_PASSWORD": "other-pw"}, "--store: store URL \"redis://:xxxxx@127.0.0.1:6379/0\" has a password"},
		{nil, map[string]string{"STOPGATE_STORE_PASSWORD": "hunter2"}, "STOPGATE_STORE_PASSWORD: a store password needs a Redis store URL"},
	}
	for _, tc := range bad {
		_, err := parseServeConfig(tc.args, env(tc.env))
		var ue *usageError
		if !errors.As(err, &ue) {
			t.Errorf("%q %v: got %v, want a usage error", tc.args, tc.env, err)
			continue
		}
		if !strings.Contains(err.Error(), tc.say) {
			t.Errorf("%q %v: message %q does not say %q", tc.args, tc.env, err, tc.say)
		}
		if strings.Contains(err.Error(), "hunter2") {
			t.Errorf("message leaks the password: %q", err)
		}
	}
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
	h.want(t, []string{"cancel", "ghost"}, exitTombstone, "ghost was never admitted: recorded CANCELLED at cancel_version 2",
		"ghost was never admitted: no run of that id was stopped")
	h.want(t, []string{"admit", "ghost"}, 1, "", "run_not_active: run ghost is CANCELLED")
	h.want(t, []string{"cancel", "ghost"}, 0, "ghost was already CANCELLED at cancel_version 2; nothing changed", "")
	// Each tombstone in a millisecond of its own, so that --sort updated
	// below has an order to show.
	time.Sleep(2 * time.Millisecond)
	h.want(t, []string{"cancel", "ghost2", "--tombstone"}, 0, "ghost2 was never admitted: recorded CANCELLED at cancel_version 2", "")
	time.Sleep(2 * time.Millisecond)
	out = h.want(t, []string{"cancel", "ghost3", "--json"}, exitTombstone, `"tombstone":true`, "never admitted")
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
	h.want(t, []string{"runs", "--since", "yesterday"}, exitUsage, "", "--since: \"yesterday\" is neither an RFC 3339 time")
	h.want(t, []string{"runs", "--sort", "name"}, exitUsage, "", "--sort \"name\": want id, updated or created")
	h.want(t, []string{"runs", "--limit", "-1"}, exitUsage, "", "--limit")
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
		if code != exitUsage || !strings.Contains(errOut, tc.say) {
			t.Errorf("stopgate %q: exit %d, stderr %q; want %d saying %q", tc.args, code, errOut, exitUsage, tc.say)
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
	if code != exitError || !strings.Contains(errOut, "unauthorized") || !strings.Contains(errOut, "No token was sent") || !strings.Contains(errOut, "STOPGATE_DATA_DIR") {
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
	if code != exitError || !strings.Contains(errOut, "cannot reach the control API at http://127.0.0.1:1") {
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
		h.want(t, []string{"cancel", "never-seen", "--wait", "--json"}, exitTombstone, `"status":"CANCELLED"`, "never admitted")
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
		if code != exitUnknown {
			t.Fatalf("exit %d, want %d\n%s\n%s", code, exitUnknown, out, errOut)
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
