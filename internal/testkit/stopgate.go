package testkit

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stopgate/stopgate/proxy"
)

// BuildStopgate compiles the stopgate binary of the repository at root
// (its directory, relative or not) into dir and returns its path: the test
// runs what ships, built as `make build` builds it. Bounded by ctx.
func BuildStopgate(ctx context.Context, root, dir string) (string, error) {
	bin := filepath.Join(dir, "stopgate")
	gobin, err := exec.LookPath("go")
	if err != nil {
		return "", fmt.Errorf("go not on PATH: %w", err)
	}
	cmd := exec.CommandContext(ctx, gobin, "build", "-o", bin, "./cmd/proxy")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/proxy in %s: %w\n%s", root, err, out)
	}
	return bin, nil
}

// BinaryEnv hands the stopgate MainWithStopgate built to the re-runs of
// the test binary a test makes (in a network namespace, say), which
// inherit the environment, so that they do not build it again.
const BinaryEnv = "STOPGATE_TEST_BINARY"

// MainWithStopgate is the TestMain of tests that run the stopgate binary:
// it builds it from the repository at root into a temporary directory
// (bounded: 5 minutes), sets *binary, runs the tests, removes the build,
// and returns the exit code. A re-run of the test binary takes its
// parent's build from BinaryEnv.
func MainWithStopgate(m *testing.M, root string, binary *string) int {
	if *binary = os.Getenv(BinaryEnv); *binary != "" {
		return m.Run()
	}
	dir, err := os.MkdirTemp("", "stopgate-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "temp dir:", err)
		return 1
	}
	defer os.RemoveAll(dir)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if *binary, err = BuildStopgate(ctx, root, dir); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	os.Setenv(BinaryEnv, *binary)
	return m.Run()
}

// FleetCA makes the CA an operator hands a fleet: a certificate file and a
// key file (0600), outside any data directory.
func FleetCA(t testing.TB) (certFile, keyFile string) {
	t.Helper()
	dir := t.TempDir()
	if _, err := proxy.LoadOrCreateCA(dir); err != nil {
		t.Fatal(err)
	}
	return filepath.Join(dir, "ca.pem"), filepath.Join(dir, "ca-key.pem")
}
