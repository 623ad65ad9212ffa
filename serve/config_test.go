package serve

import (
	"bytes"
	"errors"
	"flag"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/proxy"
	"github.com/stopgate/stopgate/runwatch"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
	"github.com/stopgate/stopgate/state/stores"
)

func env(m map[string]string) func(string) string {
	return func(k string) string { return m[k] }
}

func TestServeConfig(t *testing.T) {
	cfg, err := ParseConfig(nil, env(nil))
	if err != nil {
		t.Fatalf("defaults: %v", err)
	}
	want := Config{ProxyAddr: "127.0.0.1:8080", ControlAddr: "127.0.0.1:8081", BrowserAddr: "127.0.0.1:8082",
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
	cfg, err = ParseConfig([]string{"--control-addr", "127.0.0.1:9002"}, e)
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
	cfg, err = ParseConfig(nil, env(map[string]string{"STOPGATE_ALLOW_DEST": "10.0.0.0/8, api.internal:8443"}))
	if err != nil || !reflect.DeepEqual(cfg.AllowDest, []string{"10.0.0.0/8", "api.internal:8443"}) {
		t.Errorf("STOPGATE_ALLOW_DEST: %q %v", cfg.AllowDest, err)
	}
	cfg, err = ParseConfig([]string{"--allow-dest", "127.0.0.1", "--allow-dest", "fd00::/8"}, env(map[string]string{"STOPGATE_ALLOW_DEST": "10.0.0.0/8"}))
	if err != nil || !reflect.DeepEqual(cfg.AllowDest, []string{"127.0.0.1", "fd00::/8"}) {
		t.Errorf("--allow-dest twice: %q %v", cfg.AllowDest, err)
	}
	cfg, err = ParseConfig([]string{"--auto-admit=true", "--drain-timeout", "0s"}, e)
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
	cfg, err = ParseConfig([]string{"--control-token-file", tokenFile, "--run-token-secret", strings.Repeat("s", 32)}, env(nil))
	if err != nil || cfg.ControlToken != "file-0123456789abcd" || cfg.SecretsOnCommandLine != "--run-token-secret" {
		t.Errorf("token from a file: %+v %v; want the file's token, and --run-token-secret named as on the command line", cfg, err)
	}
	cfg, err = ParseConfig([]string{"--control-token", "0123456789abcdef0"}, env(map[string]string{"STOPGATE_RUN_TOKEN_SECRET_FILE": tokenFile + "-absent"}))
	if err == nil || !strings.Contains(err.Error(), "STOPGATE_RUN_TOKEN_SECRET_FILE") {
		t.Errorf("a missing secret file named in the environment: %+v %v", cfg, err)
	}
	cfg, err = ParseConfig([]string{"--control-token", "0123456789abcdef0"}, env(nil))
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
		cfg, err = ParseConfig(tc.args, env(tc.env))
		if err != nil || cfg.storeConfig().Password != "file-0123456789abcd" || cfg.SecretsOnCommandLine != "" {
			t.Errorf("store password %q %v: %q (on the command line %q) %v", tc.args, tc.env, cfg.StorePassword, cfg.SecretsOnCommandLine, err)
		}
	}
	cfg, err = ParseConfig([]string{"--store", "redis://:hunter2@127.0.0.1:6379/0"}, env(nil))
	if err != nil || cfg.SecretsOnCommandLine != "--store" {
		t.Errorf("a password in --store on the command line: %q %v", cfg.SecretsOnCommandLine, err)
	}
	cfg, err = ParseConfig([]string{"--store", "redis-sentinel://s1:26379/0?master=m&sentinel_password=hunter2"}, env(nil))
	if err != nil || cfg.SecretsOnCommandLine != "--store" {
		t.Errorf("a sentinel password in --store on the command line: %q %v", cfg.SecretsOnCommandLine, err)
	}
	cfg, err = ParseConfig(nil, env(map[string]string{"STOPGATE_STORE": "redis://:hunter2@127.0.0.1:6379/0"}))
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
		_, err := ParseConfig(tc.args, env(tc.env))
		var ce *ConfigError
		if !errors.As(err, &ce) {
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

func TestServeConfigTakesTheCAFromFlagsOrEnvironment(t *testing.T) {
	cfg, err := ParseConfig([]string{"--ca-cert", "/etc/stopgate/ca/tls.crt", "--ca-key", "/etc/stopgate/ca/tls.key"}, env(nil))
	if err != nil || cfg.CACert != "/etc/stopgate/ca/tls.crt" || cfg.CAKey != "/etc/stopgate/ca/tls.key" {
		t.Fatalf("flags: %+v %v", cfg, err)
	}
	cfg, err = ParseConfig(nil, env(map[string]string{"STOPGATE_CA_CERT": "/c.pem", "STOPGATE_CA_KEY": "/k.pem"}))
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
		_, err := ParseConfig(tc.args, env(tc.env))
		var ce *ConfigError
		if !errors.As(err, &ce) || !strings.Contains(err.Error(), tc.say) {
			t.Errorf("%q %v: got %v, want a usage error saying %q", tc.args, tc.env, err, tc.say)
		}
	}
}

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
		cfg, err := ParseConfig([]string{"--store", raw}, env(map[string]string{"STOPGATE_STORE_PASSWORD": "pw-apart"}))
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
		cfg, err = ParseConfig([]string{"--store", withPassword}, env(nil))
		if err != nil || !strings.Contains(cfg.SecretsOnCommandLine, "--store") {
			t.Fatalf("%s on the command line: %v, secrets on the command line %q, want --store warned of", redisstore.Redact(withPassword), err, cfg.SecretsOnCommandLine)
		}
		if shown := redisstore.Redact(withPassword); strings.Contains(shown, "pw-") {
			t.Fatalf("shown as %s", shown)
		}
		_, err = ParseConfig(nil, env(map[string]string{"STOPGATE_STORE": withPassword, "STOPGATE_STORE_PASSWORD": "pw-apart"}))
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
		_, err := ParseConfig([]string{"--store", tc.url}, env(nil))
		if err == nil || !strings.Contains(err.Error(), tc.says) || strings.Contains(err.Error(), "pw-") || !strings.Contains(err.Error(), "--store") {
			t.Errorf("--store %s: %v, want a refusal of --store that says %q without the password", redisstore.Redact(tc.url), err, tc.says)
		}
	}
}

// TestServeDefaultsAreTheirOwners: each default serve's flags show is the
// one the package that applies it exports (what it uses when given none),
// and docs/cli.md says the same: a copy in the flags or in the docs drifts
// and this fails.
func TestServeDefaultsAreTheirOwners(t *testing.T) {
	fs, _ := newFlags()
	docs, err := os.ReadFile("../docs/cli.md")
	if err != nil {
		t.Fatal(err)
	}
	for flag, owner := range map[string]string{
		"lease-ttl":        intents.DefaultLeaseTTL.String(),
		"sweep-interval":   intents.DefaultSweepInterval.String(),
		"recheck-interval": runwatch.DefaultInterval.String(),
		"store-timeout":    state.DefaultTimeout.String(),
		"max-body":         "268435456",
		"data-dir":         control.DefaultDataDir,
	} {
		f := fs.Lookup(flag)
		if f == nil {
			t.Fatalf("no --%s", flag)
		}
		if f.DefValue != owner {
			t.Errorf("--%s defaults to %s, its owner to %s", flag, f.DefValue, owner)
		}
		if !bytes.Contains(docs, []byte("| `--"+flag+"` | `"+envName(flag)+"` | `"+owner+"` |")) {
			t.Errorf("docs/cli.md does not give --%s the default %s", flag, owner)
		}
	}
	if proxy.DefaultMaxBody != 268435456 {
		t.Errorf("proxy.DefaultMaxBody is %d, the docs say 268435456", proxy.DefaultMaxBody)
	}
}

// TestEveryServeFlagIsDocumented: each flag serve takes has its row in
// docs/cli.md, under the name and variable it is read from.
func TestEveryServeFlagIsDocumented(t *testing.T) {
	b, err := os.ReadFile("../docs/cli.md")
	if err != nil {
		t.Fatal(err)
	}
	page := string(b)
	fs, _ := newFlags()
	fs.VisitAll(func(f *flag.Flag) {
		if !strings.Contains(page, "`--"+f.Name) {
			t.Errorf("docs/cli.md has no row for --%s", f.Name)
		}
		if !strings.Contains(page, envName(f.Name)) {
			t.Errorf("docs/cli.md does not name %s, the variable of --%s", envName(f.Name), f.Name)
		}
	})
}
