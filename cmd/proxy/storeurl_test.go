package main

import (
	"strings"
	"testing"

	"github.com/stopgate/stopgate/state/redisstore"
	"github.com/stopgate/stopgate/state/stores"
)

// TestServeTakesTLSSentinelAndClusterURLs: serve's flags accept the TLS
// forms of a Sentinel and a cluster URL, with the password apart
// (STOPGATE_STORE_PASSWORD) or in STOPGATE_STORE; a password in --store is
// warned of; what is refused is refused naming the part that is wrong, and
// no message shows a password. The same URL type reads the URL here, in the
// store and for the proxy's protected addresses, so the three cannot drift.
func TestServeTakesTLSSentinelAndClusterURLs(t *testing.T) {
	for _, raw := range []string{
		"rediss-sentinel://a.example:26379,b.example:26380/0?master=mymaster&sentinel_password=sp-1",
		"rediss-cluster://n1.example:7000,n2.example:7001",
	} {
		cfg, err := parseServeConfig([]string{"--store", raw}, env(map[string]string{"STOPGATE_STORE_PASSWORD": "pw-apart"}))
		if err != nil {
			t.Fatalf("%s with the password apart: %v", raw, err)
		}
		u, err := redisstore.ParseURL(cfg.Store)
		if err != nil || !u.TLS() || cfg.StorePassword != "pw-apart" {
			t.Fatalf("%s: read as %+v tls=%v, password %q", raw, u, u.TLS(), cfg.StorePassword)
		}
		if err := stores.Check(cfg.storeConfig()); err != nil {
			t.Fatalf("%s: the store refuses what serve took: %v", raw, err)
		}
		withPassword := strings.Replace(raw, "://", "://app:pw-in-url@", 1)
		cfg, err = parseServeConfig([]string{"--store", withPassword}, env(nil))
		if err != nil || !strings.Contains(cfg.SecretsOnCommandLine, "--store") {
			t.Fatalf("%s on the command line: %v, secrets on the command line %q, want --store warned of", redisstore.Redact(withPassword), err, cfg.SecretsOnCommandLine)
		}
		if shown := redisstore.Redact(withPassword); strings.Contains(shown, "pw-") {
			t.Fatalf("shown as %s", shown)
		}
		_, err = parseServeConfig(nil, env(map[string]string{"STOPGATE_STORE": withPassword, "STOPGATE_STORE_PASSWORD": "pw-apart"}))
		if err == nil || !strings.Contains(err.Error(), "give one") || strings.Contains(err.Error(), "pw-") {
			t.Fatalf("two passwords: %v, want a refusal that says to give one and shows neither", err)
		}
	}
	for _, tc := range []struct{ url, says string }{
		{"rediss-cluster://:pw-1@n1:7000/3", "database"},
		{"rediss-sentinel://:pw-1@a:26379/0", "master"},
		{"rediss-sentinel://:pw-1@a/0?master=m", "host:port"},
		{"redis-sentinal://:pw-1@a:1/0?master=m", "scheme"},
	} {
		_, err := parseServeConfig([]string{"--store", tc.url}, env(nil))
		if err == nil || !strings.Contains(err.Error(), tc.says) || strings.Contains(err.Error(), "pw-") || !strings.Contains(err.Error(), "--store") {
			t.Errorf("--store %s: %v, want a refusal of --store that says %q without the password", redisstore.Redact(tc.url), err, tc.says)
		}
	}
}
