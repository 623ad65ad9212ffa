package bench

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestPeerBinarySaysWhyAPeerCannotBeMeasured(t *testing.T) {
	dir := t.TempDir()
	exe := filepath.Join(dir, "smokescreen")
	if err := os.WriteFile(exe, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	notExe := filepath.Join(dir, "plain-file")
	if err := os.WriteFile(notExe, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	offline := filepath.Join(dir, "squid")
	if err := os.WriteFile(offline+".why", []byte("apt-get install squid failed: no network\nmore\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, path, wantAbs, wantWhy string
	}{
		{"not given", "", "", "no binary given (-peer)"},
		{"built", exe, exe, ""},
		{"missing, the deps step said why", offline, "", "apt-get install squid failed: no network"},
		{"missing, nothing said why", filepath.Join(dir, "gone"), "", "no binary at " + filepath.Join(dir, "gone") + " (scripts/bench-deps makes it)"},
		{"not executable", notExe, "", "no binary at " + notExe + " (scripts/bench-deps makes it)"},
		{"a directory", dir, "", "no binary at " + dir + " (scripts/bench-deps makes it)"},
	} {
		abs, why := peerBinary("peer", tc.path)
		if abs != tc.wantAbs || why != tc.wantWhy {
			t.Errorf("%s: (%q, %q), want (%q, %q)", tc.name, abs, why, tc.wantAbs, tc.wantWhy)
		}
	}
}

func TestSquidConfigForwardsForLoopbackOnlyAndKeepsNothing(t *testing.T) {
	dir := t.TempDir()
	lines := strings.Split(strings.TrimSpace(squidConfig(31280, dir, "")), "\n")
	for _, want := range []string{
		"http_port 127.0.0.1:31280",
		"acl bench src 127.0.0.1/32",
		"http_access allow bench",
		"cache deny all",
		"cache_mem 0 MB",
		"access_log none",
		"pid_filename " + filepath.Join(dir, "squid.pid"),
		"pinger_enable off",
	} {
		if !slices.Contains(lines, want) {
			t.Errorf("config lacks %q:\n%s", want, strings.Join(lines, "\n"))
		}
	}
	allow := slices.Index(lines, "http_access allow bench")
	if deny := slices.Index(lines, "http_access deny all"); deny < allow {
		t.Errorf("http_access deny all at line %d, want it after the allow (line %d): Squid takes the first rule that matches", deny, allow)
	}
	for _, l := range lines {
		for _, banned := range []string{"cache_dir", "cache_effective_user"} {
			if strings.HasPrefix(l, banned) {
				t.Errorf("config has %q: want no disk cache, and no user switch when not root", l)
			}
		}
	}
	if !strings.Contains(squidConfig(31280, dir, "proxy"), "\ncache_effective_user proxy\n") {
		t.Error("as root the config does not name the user Squid switches to")
	}
}

func TestPeersAreMeasuredInThePlainHTTPRowsOnly(t *testing.T) {
	e := &env{cfg: &Config{Conns: []int{1, 64}, RunPerConn: true, Post: true}}
	peer := target{key: "smokescreen", httpOnly: true}
	missing := target{key: "squid", httpOnly: true, missing: "offline"}
	sg := target{key: "everysec"}
	for _, sc := range e.scenarios() {
		if got := peer.measured(sc); got == sc.tls {
			t.Errorf("%s ×%d: peer measured %v, want %v", sc.label, sc.conns, got, !sc.tls)
		}
		if missing.measured(sc) {
			t.Errorf("%s ×%d: a peer the machine lacks is measured", sc.label, sc.conns)
		}
		if !sg.measured(sc) {
			t.Errorf("%s ×%d: stopgate not measured", sc.label, sc.conns)
		}
	}
}
