package clients_test

import (
	"bytes"
	"context"
	"encoding/pem"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/internal/testkit"
)

// binary is the stopgate TestMain builds.
var binary string

func TestMain(m *testing.M) {
	os.Exit(testkit.MainWithStopgate(m, "..", &binary))
}

// instance is one `stopgate serve`.
type instance struct {
	*testkit.Process
	control string // http://host:port
	proxy   string // host:port
}

// fleet is two stopgate instances sharing one Redis store and one data
// directory (one operator token, one CA, one run-token secret), as a fleet
// shares them, with an HTTP and an HTTPS upstream on loopback that the
// proxy may reach and trusts.
type fleet struct {
	redis      *redisserver.Server
	a, b       *instance
	token      string
	httpUp     *testkit.Upstream
	httpsUp    *testkit.Upstream
	upstreamCA string
}

func startFleet(t *testing.T) *fleet {
	t.Helper()
	f := &fleet{redis: redisserver.Start(t, redisserver.Options{})}
	f.httpUp = testkit.NewUpstream(t, false, nil)
	f.httpsUp = testkit.NewUpstream(t, true, nil)
	f.upstreamCA = filepath.Join(t.TempDir(), "upstream-ca.pem")
	cert := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: f.httpsUp.Certificate().Raw})
	if err := os.WriteFile(f.upstreamCA, cert, 0o600); err != nil {
		t.Fatal(err)
	}
	dataDir := t.TempDir()
	trust := []string{"SSL_CERT_FILE=" + f.upstreamCA}
	f.a = startServe(t, dataDir, trust, "--store", f.redis.URL(), "--allow-dest", "127.0.0.1")
	f.b = startServe(t, dataDir, trust, "--store", f.redis.URL(), "--allow-dest", "127.0.0.1")
	tok, err := os.ReadFile(filepath.Join(dataDir, "operator.token"))
	if err != nil {
		t.Fatal(err)
	}
	f.token = strings.TrimSpace(string(tok))
	return f
}

// startServe serves on fresh loopback ports with short sweeps and
// re-reads, so the tests see a run drain in a fraction of a second; env is
// added to its clean environment.
func startServe(t *testing.T, dataDir string, env []string, args ...string) *instance {
	t.Helper()
	argv := append([]string{
		"--data-dir", dataDir, "--sweep-interval", "200ms", "--recheck-interval", "200ms", "--drain-timeout", "30s",
	}, args...)
	inst := &instance{Process: testkit.StartServe(t, binary, argv, append(cleanEnv(), env...), "")}
	inst.control, inst.proxy = "http://"+inst.Bound.Control, inst.Bound.Proxy
	return inst
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// cleanEnv is the test's environment without stopgate's variables and
// without proxy variables: the clients and the instances see only what a
// test gives them.
func cleanEnv() []string {
	var env []string
	for _, kv := range testkit.CleanEnv() {
		k, _, _ := strings.Cut(kv, "=")
		switch strings.ToUpper(k) {
		case "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS":
			continue
		}
		env = append(env, kv)
	}
	return env
}

// clientEnv tells a client's tests where everything is.
func (f *fleet) clientEnv() []string {
	return append(cleanEnv(),
		"STOPGATE_TEST_CONTROL="+f.a.control,
		"STOPGATE_TEST_CONTROL_B="+f.b.control,
		"STOPGATE_TEST_TOKEN="+f.token,
		"STOPGATE_TEST_PROXY="+f.a.proxy,
		"STOPGATE_TEST_REDIS=redis://"+f.redis.Addr(),
		"STOPGATE_TEST_HTTP_UPSTREAM="+f.httpUp.URL,
		"STOPGATE_TEST_HTTPS_UPSTREAM="+f.httpsUp.URL,
		"PYTHONDONTWRITEBYTECODE=1",
		"PYTHONUNBUFFERED=1",
	)
}

// runTool runs a client's test command in dir with env, within limit, and
// fails the test with its output unless it exits 0. The output is logged
// either way (go test -v shows the clients' own test runs and tables).
func runTool(t *testing.T, limit time.Duration, dir string, env []string, name string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir, cmd.Env = dir, env
	cmd.WaitDelay = 5 * time.Second
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	t.Logf("%s %s:\n%s", name, strings.Join(args, " "), out.String())
	if ctx.Err() != nil {
		t.Fatalf("%s %s did not finish within %s", name, strings.Join(args, " "), limit)
	}
	if err != nil {
		t.Fatalf("%s %s: %v", name, strings.Join(args, " "), err)
	}
	return out.String()
}

// debianPython is Debian's interpreter, the one python3-celery and
// python3-redis install for (a python3 earlier on PATH, pyenv's say, may
// lack them).
const debianPython = "/usr/bin/python3"

func needDebianPython(t *testing.T, modules ...string) {
	t.Helper()
	if !fileExists(debianPython) {
		t.Fatalf("%s is needed (make test-deps installs python3)", debianPython)
	}
	for _, m := range modules {
		if out, err := exec.Command(debianPython, "-c", "import "+m).CombinedOutput(); err != nil {
			t.Fatalf("%s cannot import %s (make test-deps installs python3-%s): %v\n%s", debianPython, m, m, err, out)
		}
	}
}

func needNodeModules(t *testing.T) {
	t.Helper()
	testkit.NeedTools(t, "node")
	if !fileExists("node/node_modules/bullmq/package.json") {
		t.Fatal("clients/node/node_modules has no bullmq: make test-deps runs npm ci there")
	}
}

func TestPythonClient(t *testing.T) {
	needDebianPython(t, "mypy")
	f := startFleet(t)
	runTool(t, 3*time.Minute, "python", f.clientEnv(), debianPython, "-m", "unittest", "-v", "tests.test_client", "tests.test_types")
}

func TestCelery(t *testing.T) {
	needDebianPython(t, "celery", "redis")
	f := startFleet(t)
	runTool(t, 4*time.Minute, "python", f.clientEnv(), debianPython, "-m", "unittest", "-v", "tests.test_celery")
}

func TestNodeClient(t *testing.T) {
	needNodeModules(t)
	f := startFleet(t)
	runTool(t, 3*time.Minute, "node", f.clientEnv(), "node", "--test", "--test-reporter=spec", "test/client.test.js", "test/types.test.js")
}

func TestBullMQ(t *testing.T) {
	needNodeModules(t)
	f := startFleet(t)
	runTool(t, 4*time.Minute, "node", f.clientEnv(), "node", "--test", "--test-reporter=spec", "test/bullmq.test.js")
}
