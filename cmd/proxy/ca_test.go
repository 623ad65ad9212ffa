package main

import (
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stopgate/stopgate/internal/testkit"
)

// TestTwoInstancesServeTheFleetCA: two instances given one CA serve that
// certificate to workers, and neither makes a CA of its own.
func TestTwoInstancesServeTheFleetCA(t *testing.T) {
	certFile, keyFile := testkit.FleetCA(t)
	want, err := os.ReadFile(certFile)
	if err != nil {
		t.Fatal(err)
	}
	dirs := []string{t.TempDir(), t.TempDir()}
	for i, s := range []*server{
		startServe(t, "--data-dir", dirs[0], "--ca-cert", certFile, "--ca-key", keyFile),
		startServeEnv(t, []string{"STOPGATE_CA_CERT=" + certFile, "STOPGATE_CA_KEY=" + keyFile}, "--data-dir", dirs[1]),
	} {
		resp, err := http.Get(s.control + "/v1/ca")
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(got) != string(want) {
			t.Errorf("instance %d serves another CA:\n%s", i, got)
		}
		for _, name := range []string{"ca.pem", "ca-key.pem"} {
			if _, err := os.Stat(filepath.Join(dirs[i], name)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("instance %d made %s in its data directory (%v)", i, name, err)
			}
		}
	}
}

func TestServeRefusesAnUnsafeFleetCA(t *testing.T) {
	certFile, keyFile := testkit.FleetCA(t)
	if err := os.Chmod(keyFile, 0o644); err != nil {
		t.Fatal(err)
	}
	code, _, errOut := runBinary(t, nil, "serve", "--data-dir", t.TempDir(), "--proxy-addr", anyPort, "--control-addr", anyPort,
		"--browser-addr", anyPort, "--ca-cert", certFile, "--ca-key", keyFile)
	if code != 1 || !strings.Contains(errOut, "--ca-cert, --ca-key: CA key "+keyFile+": has mode 0644") || !strings.Contains(errOut, "chmod 600") {
		t.Fatalf("serve with a world-readable CA key: exit %d, stderr:\n%s", code, errOut)
	}
}
