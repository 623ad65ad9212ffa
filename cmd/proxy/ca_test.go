package main

import (
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stopgate/stopgate/proxy"
)

// fleetCAFiles makes the CA an operator hands to a fleet: a certificate
// file and a key file (0600), outside any data directory.
func fleetCAFiles(t *testing.T) (certFile, keyFile string) {
	t.Helper()
	dir := t.TempDir()
	if _, err := proxy.LoadOrCreateCA(dir); err != nil {
		t.Fatal(err)
	}
	return filepath.Join(dir, "ca.pem"), filepath.Join(dir, "ca-key.pem")
}

func TestServeConfigTakesTheCAFromFlagsOrEnvironment(t *testing.T) {
	cfg, err := parseServeConfig([]string{"--ca-cert", "/etc/stopgate/ca/tls.crt", "--ca-key", "/etc/stopgate/ca/tls.key"}, env(nil))
	if err != nil || cfg.CACert != "/etc/stopgate/ca/tls.crt" || cfg.CAKey != "/etc/stopgate/ca/tls.key" {
		t.Fatalf("flags: %+v %v", cfg, err)
	}
	cfg, err = parseServeConfig(nil, env(map[string]string{"STOPGATE_CA_CERT": "/c.pem", "STOPGATE_CA_KEY": "/k.pem"}))
	if err != nil || cfg.CACert != "/c.pem" || cfg.CAKey != "/k.pem" {
		t.Fatalf("environment: %+v %v", cfg, err)
	}
	for _, tc := range []struct {
		args []string
		env  map[string]string
		say  string
	}{
		{[]string{"--ca-cert", "/c.pem"}, nil, "--ca-key: is empty"},
		{[]string{"--ca-key", "/k.pem"}, nil, "--ca-cert: is empty"},
		{nil, map[string]string{"STOPGATE_CA_CERT": "/c.pem"}, "--ca-key: is empty: an operator-provided CA needs both"},
	} {
		_, err := parseServeConfig(tc.args, env(tc.env))
		var ue *usageError
		if !errors.As(err, &ue) || !strings.Contains(err.Error(), tc.say) {
			t.Errorf("%q %v: got %v, want a usage error saying %q", tc.args, tc.env, err, tc.say)
		}
	}
}

// TestTwoInstancesServeTheFleetCA: two instances given one CA serve that
// certificate to workers, and neither makes a CA of its own.
func TestTwoInstancesServeTheFleetCA(t *testing.T) {
	certFile, keyFile := fleetCAFiles(t)
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
	certFile, keyFile := fleetCAFiles(t)
	if err := os.Chmod(keyFile, 0o644); err != nil {
		t.Fatal(err)
	}
	code, _, errOut := runBinary(t, nil, "serve", "--data-dir", t.TempDir(), "--proxy-addr", anyPort, "--control-addr", anyPort,
		"--browser-addr", anyPort, "--ca-cert", certFile, "--ca-key", keyFile)
	if code != 1 || !strings.Contains(errOut, "--ca-cert, --ca-key: CA key "+keyFile+": has mode 0644") || !strings.Contains(errOut, "chmod 600") {
		t.Fatalf("serve with a world-readable CA key: exit %d, stderr:\n%s", code, errOut)
	}
}
