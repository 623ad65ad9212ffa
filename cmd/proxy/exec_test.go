package main

import (
	"context"
	"encoding/pem"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/control/client"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/redirect"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
)

// startServeEnv is startServe with extra environment for the serve process.
func startServeEnv(t *testing.T, env []string, args ...string) *server {
	t.Helper()
	return startServeWith(t, "", env, append(slices.Clone(allowTestUpstreams), args...)...)
}

func TestExecWithoutIsolateSetsTheEnvironmentOfEveryRuntime(t *testing.T) {
	s := startServe(t, "--data-dir", t.TempDir())
	up, hits := upstreamCounter(t)
	s.must(t, 0, "admit", "env-run")

	// curl reads lower-case http_proxy for plain HTTP: it goes through the guard.
	code, out, errOut := s.stopgate(t, "exec", "--run", "env-run", "--no-isolate", "--", "curl", "-sS", "-X", "POST", up.URL+"/exec-env")
	if code != 0 || strings.TrimSpace(out) != "done" || hits.Load() != 1 {
		t.Fatalf("exec curl: exit %d, %q %q, upstream %d", code, out, errOut, hits.Load())
	}
	for _, say := range []string{"go around the guard", "Node.js", "Go programs, for loopback", "--no-isolate"} {
		if !strings.Contains(errOut, say) {
			t.Errorf("stderr does not say %q:\n%s", say, errOut)
		}
	}
	doc := s.audit(t, "env-run")
	var sent []state.Intent
	for _, in := range doc.Intents {
		if in.Method != "EXEC" {
			sent = append(sent, in)
		}
	}
	if len(sent) != 1 || sent[0].Target != up.URL+"/exec-env" || sent[0].State != state.IntentResponded {
		t.Fatalf("audit: %+v", doc.Intents)
	}
	// The unisolated start is in the record, with the clients that may bypass.
	unisolated := false
	for _, e := range doc.Events {
		unisolated = unisolated || (e.Kind == "exec.unisolated" && strings.Contains(e.Reason, "Node.js"))
	}
	if !unisolated {
		t.Errorf("no exec.unisolated event naming the clients that bypass: %+v", doc.Events)
	}

	// The variables every common runtime reads, in both cases; no exception list.
	// The operator's own token, in the variable the CLI reads it from: it
	// must never reach the command.
	token, err := os.ReadFile(filepath.Join(s.dataDir, control.OperatorTokenFile))
	if err != nil {
		t.Fatal(err)
	}
	_, env, _ := runBinary(t, []string{"STOPGATE_CONTROL=" + s.control, "STOPGATE_CONTROL_TOKEN=" + strings.TrimSpace(string(token)), "NO_PROXY=*", "no_proxy=*", "HTTPS_PROXY=http://elsewhere:1"},
		"exec", "--run", "env-run", "--no-isolate", "--", "env")
	vars := map[string]string{}
	for _, line := range strings.Split(env, "\n") {
		if k, v, ok := strings.Cut(line, "="); ok {
			vars[k] = v
		}
	}
	proxyURL := "http://env-run:1@" + s.proxyAddr()
	for _, k := range []string{"HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"} {
		if vars[k] != proxyURL {
			t.Errorf("%s=%q, want %q", k, vars[k], proxyURL)
		}
	}
	for _, k := range []string{"SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "GIT_SSL_CAINFO", "WGETRC", "STOPGATE_CANCEL_FILE"} {
		if vars[k] == "" {
			t.Errorf("%s is not set", k)
		}
	}
	if vars["NODE_USE_ENV_PROXY"] != "1" {
		t.Errorf("NODE_USE_ENV_PROXY=%q", vars["NODE_USE_ENV_PROXY"])
	}
	for _, k := range []string{"NO_PROXY", "no_proxy", "STOPGATE_CONTROL_TOKEN", "STOPGATE_CONTROL"} {
		if v, ok := vars[k]; ok {
			t.Errorf("%s=%q reaches the command", k, v)
		}
	}

	// The exit status is the command's; a run that admits nothing starts nothing.
	if code, _, _ := s.stopgate(t, "exec", "--run", "env-run", "--no-isolate", "--", "sh", "-c", "exit 7"); code != 7 {
		t.Errorf("exit status %d, want 7", code)
	}
	s.must(t, 0, "cancel", "env-run")
	if msg := s.must(t, 1, "exec", "--run", "env-run", "--", "true"); !strings.Contains(msg, "CMD was not started") {
		t.Errorf("exec for a cancelled run: %q", msg)
	}
	if msg := s.must(t, 2, "exec", "--", "true"); !strings.Contains(msg, "--run is required") {
		t.Errorf("exec without --run: %q", msg)
	}
	s.must(t, 0, "admit", "other")
	if msg := s.must(t, 1, "exec", "--run", "other", "--isolate", "--uid", "61050", "--", "true"); !strings.Contains(msg, "needs root") && !strings.Contains(msg, "--transparent-addr") {
		t.Errorf("exec --isolate without transparent mode: %q", msg)
	}
}

func TestTransparentBindingsThroughTheControlAPI(t *testing.T) {
	s := startServe(t, "--data-dir", t.TempDir(), "--transparent-addr", anyPort)
	transparent := s.Bound.Transparent[0]
	cl, err := client.New(s.control, client.Options{Token: s.operatorToken(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ep, err := cl.Endpoints(ctx)
	if err != nil || ep.Value.Transparent != transparent || ep.Value.Proxy != s.proxyAddr() || ep.Value.RunTokens != control.RunTokensAccepted {
		t.Fatalf("endpoints: %+v %v", ep.Value, err)
	}
	uid := int64(61040)
	b, err := cl.Bind(ctx, control.BindingRequest{UID: &uid, RunID: "bind-1"})
	if err != nil || b.StatusCode != http.StatusCreated || b.Value.Port == 0 || b.Value.RunID != "bind-1" ||
		b.Value.LeaseTTL != control.DefaultBindingTTL || b.Value.ExpiresAt.IsZero() {
		t.Fatalf("bind: %+v %v", b, err)
	}
	// The proxy's binding and its error are the API's: the same type and
	// the same words, with no copy between them to drift.
	var ae *client.APIError
	if _, err := cl.Bind(ctx, control.BindingRequest{UID: &uid, RunID: "bind-2"}); !errors.As(err, &ae) || ae.Code != refusal.UIDBound ||
		!strings.Contains(ae.Message, "uid 61040 is bound to run bind-1") {
		t.Fatalf("a second binding of the uid: %v", err)
	}
	if _, err := cl.RenewBinding(ctx, b.Value.ID); err != nil {
		t.Fatalf("renew: %v", err)
	}
	if err := cl.Unbind(ctx, b.Value.ID); err != nil {
		t.Fatalf("unbind: %v", err)
	}
	if err := cl.Unbind(ctx, b.Value.ID); !errors.As(err, &ae) || ae.StatusCode != http.StatusNotFound || !strings.Contains(ae.Message, redirect.ErrNoBinding.Error()) {
		t.Fatalf("unbind twice: %v", err)
	}
	for _, bad := range []control.BindingRequest{{RunID: "no-uid"}, {UID: &uid}, {UID: &uid, RunID: "r", CancelVersion: -1}} {
		if _, err := cl.Bind(ctx, bad); !errors.As(err, &ae) || ae.StatusCode != http.StatusBadRequest {
			t.Errorf("bind %+v: %v", bad, err)
		}
	}
}

// TestNoIsolateGitAndProxyAnyauth: with the proxy environment alone, git
// over HTTPS and curl --proxy-anyauth go through the guard. Both send their
// CONNECT without credentials first (libcurl's anyauth) and answer the 407
// they get at the CONNECT with the run's credentials.
func TestNoIsolateGitAndProxyAnyauth(t *testing.T) {
	for _, tool := range []string{"git", "curl"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is needed: %v", tool, err)
		}
	}
	work := t.TempDir()
	gitIn := func(dir string, args ...string) {
		t.Helper()
		cmd := exec.Command("git", args...)
		cmd.Dir = dir
		cmd.Env = append(testkit.CleanEnv(), "GIT_AUTHOR_NAME=t", "GIT_AUTHOR_EMAIL=t@example.com", "GIT_COMMITTER_NAME=t", "GIT_COMMITTER_EMAIL=t@example.com", "HOME="+work)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("git %v: %v %s", args, err, out)
		}
	}
	src, bare := filepath.Join(work, "src"), filepath.Join(work, "served", "repo.git")
	gitIn(work, "init", "-q", "-b", "main", src)
	if err := os.WriteFile(filepath.Join(src, "README"), []byte("guarded\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	gitIn(src, "add", "README")
	gitIn(src, "commit", "-q", "-m", "first")
	gitIn(work, "clone", "-q", "--bare", src, bare)
	gitIn(bare, "update-server-info") // the dumb HTTP protocol: plain files
	up := httptest.NewTLSServer(http.FileServer(http.Dir(filepath.Join(work, "served"))))
	defer up.Close()
	roots := filepath.Join(work, "upstream-ca.pem")
	if err := os.WriteFile(roots, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: up.Certificate().Raw}), 0o644); err != nil {
		t.Fatal(err)
	}
	s := startServeEnv(t, []string{"SSL_CERT_FILE=" + roots}, "--data-dir", t.TempDir())
	s.must(t, 0, "admit", "git-run")
	env := []string{"STOPGATE_CONTROL=" + s.control, "STOPGATE_DATA_DIR=" + s.dataDir, "HOME=" + work}

	clone := filepath.Join(work, "clone")
	code, out, errOut := runBinary(t, env, "exec", "--run", "git-run", "--no-isolate", "--", "git", "clone", "-q", up.URL+"/repo.git", clone)
	if code != 0 {
		t.Fatalf("git clone over HTTPS through --no-isolate: exit %d\n%s%s", code, out, errOut)
	}
	if b, err := os.ReadFile(filepath.Join(clone, "README")); err != nil || string(b) != "guarded\n" {
		t.Fatalf("the clone: %q %v", b, err)
	}
	code, out, errOut = runBinary(t, env, "exec", "--run", "git-run", "--no-isolate", "--", "curl", "-sS", "--proxy-anyauth", "-o", "/dev/null", "-w", "%{http_code}", up.URL+"/repo.git/HEAD")
	if code != 0 || out != "200" {
		t.Fatalf("curl --proxy-anyauth: exit %d %q %s", code, out, errOut)
	}
	recorded := map[string]bool{}
	for _, in := range s.audit(t, "git-run").Intents {
		recorded[strings.TrimPrefix(in.Target, up.URL)] = in.State == state.IntentResponded
	}
	for _, path := range []string{"/repo.git/info/refs", "/repo.git/HEAD"} {
		if !recorded[path] {
			t.Errorf("%s is not recorded RESPONDED under git-run: %v", path, recorded)
		}
	}
}
