package testkit

import (
	"os"
	"os/exec"
	"testing"
)

// NeedTools fails the test unless every tool is on PATH: make test-deps
// installs them, so a missing one is a broken machine, not a skip.
func NeedTools(t testing.TB, tools ...string) {
	t.Helper()
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is needed (make test-deps installs it): %v", tool, err)
		}
	}
}

// SharedDir is a fresh directory every uid can read, for processes a test
// runs as other users (t.TempDir's parents are private to the test's uid).
func SharedDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "stopgate-shared-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
