package stores_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
	"github.com/stopgate/stopgate/state/stores"
)

// TestRedactHidesEverySecretOfEveryURLForm: no password of any store URL
// form survives redaction, and what names the servers stays readable.
func TestRedactHidesEverySecretOfEveryURLForm(t *testing.T) {
	for _, tc := range []struct {
		url    string
		secret string
		keep   []string
	}{
		{"redis://user:hunter2@h:6379/0", "hunter2", []string{"redis://user:", "@h:6379/0"}},
		{"redis://:hunter2@h:6379/0", "hunter2", []string{"@h:6379/0"}},
		{"rediss://default:s3cr%40t@cache.example:6380/2", "s3cr%40t", []string{"rediss://default:", "cache.example:6380/2"}},
		{"redis://u:p@ss:word@h:1/0", "p@ss:word", []string{"@h:1/0"}},
		{"redis-sentinel://:pw1@a:1,b:2/0?master=m", "pw1", []string{"a:1,b:2/0", "master=m"}},
		{"redis-sentinel://a:1,b:2/0?master=m&sentinel_password=pw2", "pw2", []string{"master=m", "sentinel_password="}},
		{"redis-sentinel://u:pw3@a:1/0?sentinel_password=pw4&master=m", "pw3", []string{"master=m"}},
		{"redis-sentinel://u:pw3@a:1/0?sentinel_password=pw4&master=m", "pw4", []string{"master=m"}},
		{"redis-sentinel://a:1/0?master=m&Sentinel_Password=pw5", "pw5", []string{"master=m"}},
		{"redis-sentinel://a:1/0?master=m&sentinel%5Fpassword=pw6", "pw6", []string{"master=m"}},
		{"redis-cluster://admin:pw7@n1:7000,n2:7001", "pw7", []string{"n1:7000,n2:7001"}},
		{"redis://h:6379/0?password=pw8&client_name=x", "pw8", []string{"client_name=x"}},
		{"redis://h:6379/0?auth_token=pw9", "pw9", nil},
		{"redis://h:6379/0#pw10", "pw10", []string{"h:6379/0"}},
		{"user:pw11@h:6379", "pw11", []string{"@h:6379"}},
		{"redis://user:pw12@h:6379/0?max_retries=3&tls_secret_key=pw13", "pw12", []string{"max_retries=3"}},
		{"redis://user:pw12@h:6379/0?max_retries=3&tls_secret_key=pw13", "pw13", []string{"max_retries=3"}},
	} {
		t.Run(tc.url, func(t *testing.T) {
			got := redisstore.Redact(tc.url)
			if strings.Contains(got, tc.secret) {
				t.Fatalf("Redact(%q) = %q: the secret %q is still there", tc.url, got, tc.secret)
			}
			for _, k := range tc.keep {
				if !strings.Contains(got, k) {
					t.Errorf("Redact(%q) = %q lost %q", tc.url, got, k)
				}
			}
		})
	}
}

// TestErrorsNeverShowAPassword: whatever is wrong with a store URL, the
// error says what, and shows no password.
func TestErrorsNeverShowAPassword(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct{ url, secret, says string }{
		{"redis-sentinel://:pw1@a:1,b:2/0", "pw1", "master"},
		{"redis-sentinel://a:1/0?master=m&sentinel_password=pw2&bogus=1", "pw2", "bogus"},
		{"redis-cluster://u:pw3@a:1/3", "pw3", "database"},
		{"redis-cluster://u:pw4@a:notaport", "pw4", "port"},
		{"memcached://u:pw5@h:1", "pw5", "scheme"},
		{"u:pw6@h:1", "pw6", "no scheme"},
		{"redis://u:pw7@h:1/notadb", "pw7", "db"},
		{"redis-sentinel://u:pw8@:1/0?master=m", "pw8", "no host"},
	} {
		t.Run(tc.url, func(t *testing.T) {
			err := stores.Check(stores.Config{URL: tc.url})
			if err == nil || !errors.Is(err, state.ErrInvalid) {
				t.Fatalf("Check(%q) = %v, want an ErrInvalid", tc.url, err)
			}
			if strings.Contains(err.Error(), tc.secret) {
				t.Fatalf("Check(%q) shows the password: %v", tc.url, err)
			}
			if !strings.Contains(strings.ToLower(err.Error()), tc.says) {
				t.Errorf("Check(%q) = %v, want it to say %q", tc.url, err, tc.says)
			}
			if _, err := stores.Open(ctx, stores.Config{URL: tc.url, Logger: slog.New(slog.DiscardHandler)}); err == nil || strings.Contains(err.Error(), tc.secret) {
				t.Fatalf("Open(%q) = %v", tc.url, err)
			}
		})
	}
}

// TestUnreachableRedisErrorHidesThePassword: a store that cannot be
// reached is named, redacted, in the error.
func TestUnreachableRedisErrorHidesThePassword(t *testing.T) {
	for _, url := range []string{
		"redis://u:pw9@127.0.0.1:1/0",
		"redis-sentinel://u:pw9@127.0.0.1:1/0?master=m&sentinel_password=pw9",
		"redis-cluster://u:pw9@127.0.0.1:1",
	} {
		_, err := stores.Open(context.Background(), stores.Config{URL: url, Logger: slog.New(slog.DiscardHandler)})
		if err == nil || strings.Contains(err.Error(), "pw9") || !errors.Is(err, state.ErrUnavailable) {
			t.Errorf("Open(%q) = %v, want an ErrUnavailable without the password", url, err)
		}
	}
}

// TestEmbeddedIsTheDefault: no URL opens the embedded store in the data
// directory, durable by construction.
func TestEmbeddedIsTheDefault(t *testing.T) {
	dir := t.TempDir()
	o, err := stores.Open(context.Background(), stores.Config{DataDir: dir, RequireDurable: true})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Store.Close()
	if o.Kind != "file" || !o.Durable || !strings.HasPrefix(o.Where, dir) {
		t.Fatalf("opened %+v", o)
	}
}

// TestCancelReplicasNeedsReplicas: waiting for replicas is a Redis
// setting; a negative count, or any with the embedded store, is refused
// before anything is opened.
func TestCancelReplicasNeedsReplicas(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  stores.Config
		says string
	}{
		{"negative", stores.Config{URL: "redis://127.0.0.1:6379/0", CancelReplicas: -1}, "negative"},
		{"embedded", stores.Config{DataDir: t.TempDir(), CancelReplicas: 1}, "no replicas"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := stores.Check(tc.cfg)
			if !errors.Is(err, state.ErrInvalid) || !strings.Contains(err.Error(), tc.says) {
				t.Fatalf("Check = %v, want an ErrInvalid saying %q", err, tc.says)
			}
		})
	}
	if err := stores.Check(stores.Config{URL: "redis://127.0.0.1:6379/0", CancelReplicas: 1}); err != nil {
		t.Fatalf("Check of a Redis store waiting for 1 replica = %v", err)
	}
}

// TestOpenSaysWhatElseCouldLoseACancel: a Redis that asks no password, or
// that evicts keys, is named in the warnings serve logs at start, and
// --require-durable refuses it, as it refuses a Redis without fsync.
func TestOpenSaysWhatElseCouldLoseACancel(t *testing.T) {
	const password = "pw-0123456789abcdef"
	for _, tc := range []struct {
		name string
		opts redisserver.Options
		says []string
	}{
		{"no password", redisserver.Options{AppendFsyncAlways: true}, []string{"asks no password"}},
		{"allkeys-lru", redisserver.Options{AppendFsyncAlways: true, Password: password, Args: []string{"--maxmemory-policy", "allkeys-lru"}},
			[]string{"evicts keys", "allkeys-lru"}},
		{"both", redisserver.Options{AppendFsyncAlways: true, Args: []string{"--maxmemory-policy", "volatile-ttl"}},
			[]string{"asks no password", "volatile-ttl"}},
		{"neither", redisserver.Options{AppendFsyncAlways: true, Password: password}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := redisserver.Start(t, tc.opts)
			ctx := context.Background()
			quiet := slog.New(slog.DiscardHandler)
			o, err := stores.Open(ctx, stores.Config{URL: srv.URL(), DataDir: t.TempDir(), Logger: quiet})
			if err != nil {
				t.Fatal(err)
			}
			warnings := strings.Join(o.Warnings, "\n")
			_ = o.Store.Close()
			if (warnings == "") != (tc.says == nil) {
				t.Fatalf("warnings %q, want them to say %q", warnings, tc.says)
			}
			for _, say := range tc.says {
				if !strings.Contains(warnings, say) {
					t.Errorf("warnings %q do not say %q", warnings, say)
				}
			}
			o, err = stores.Open(ctx, stores.Config{URL: srv.URL(), DataDir: t.TempDir(), RequireDurable: true, Logger: quiet})
			if tc.says == nil {
				if err != nil {
					t.Fatalf("require durable on a Redis with a password, noeviction and fsync always: %v", err)
				}
				_ = o.Store.Close()
				return
			}
			if !errors.Is(err, stores.ErrNotDurable) || !strings.Contains(err.Error(), tc.says[0]) || strings.Contains(err.Error(), password) {
				t.Fatalf("require durable: %v; want ErrNotDurable saying %q, without the password", err, tc.says[0])
			}
		})
	}
}

// TestAStorePasswordReachesRedis: the password given apart (a file or the
// environment, for serve) authenticates to a Redis that requires one; it
// is refused with the embedded store, and beside a URL that has one.
func TestAStorePasswordReachesRedis(t *testing.T) {
	const password = "pw-0123456789abcdef"
	srv := redisserver.Start(t, redisserver.Options{Password: password})
	bare := "redis://" + srv.Addr() + "/0"
	o, err := stores.Open(context.Background(), stores.Config{URL: bare, Password: password, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatalf("open with the password given apart: %v", err)
	}
	_ = o.Store.Close()
	for name, cfg := range map[string]stores.Config{
		"embedded":      {DataDir: t.TempDir(), Password: password},
		"two passwords": {URL: srv.URL(), Password: "another-one-0123"},
	} {
		if err := stores.Check(cfg); !errors.Is(err, state.ErrInvalid) || strings.Contains(err.Error(), password) {
			t.Errorf("%s: Check = %v, want ErrInvalid without the password", name, err)
		}
	}
	if !redisstore.HasSecret(srv.URL()) || redisstore.HasSecret(bare) || !redisstore.HasSecret("redis-sentinel://a:1/0?master=m&sentinel_password=x") {
		t.Errorf("HasSecret does not tell a URL with a secret from one without")
	}
}
