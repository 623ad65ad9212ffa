package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/cli"
	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
)

const testRedisPassword = "redis-pw-0123456789abcdef"

// passwordFile writes the Redis password into a 0600 file of its own.
func passwordFile(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "redis-password")
	if err := os.WriteFile(path, []byte(testRedisPassword+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestAFlushedStoreDoesNotBringACancelledRunBack (issue 23, finding 7): a
// run cancelled, then Redis emptied under stopgate (FLUSHDB, as an agent
// that reached it could; a restart without persistence does the same). The
// run's next request through the proxy used to be admitted: its row was
// gone, auto-admit created it ACTIVE at version 1, and the POST reached
// the provider. Now it is a 503 naming the reset and the way out — on the
// instance that had the run, on one that never saw it, both before their
// next marker check, and on one started since — until an operator
// re-cancels the run and acknowledges the reset; then the run is refused
// (its tombstone) and new runs go through.
func TestAFlushedStoreDoesNotBringACancelledRunBack(t *testing.T) {
	srvRedis := redisserver.Start(t, redisserver.Options{Password: testRedisPassword})
	store := []string{"STOPGATE_STORE=" + srvRedis.URL()}
	a := startServeEnv(t, store, "--data-dir", t.TempDir())
	// c shares the store and never carries r7.
	c := startServeEnv(t, store, "--data-dir", t.TempDir())
	up, hits := upstreamCounter(t)

	if code, body := agentCurl(t, a, "r7", "POST", up.URL+"/charge"); code != "200" {
		t.Fatalf("the run's first request: %s %s", code, body)
	}
	a.must(t, 0, "cancel", "r7", "--reason", "operator stop")
	if code, _ := agentCurl(t, a, "r7", "POST", up.URL+"/charge"); code != "409" {
		t.Fatalf("the cancelled run's request: %s, want 409", code)
	}

	admin := redis.NewClient(&redis.Options{Addr: srvRedis.Addr(), Password: testRedisPassword})
	t.Cleanup(func() { _ = admin.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := admin.FlushDB(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	before := hits.Load()
	for _, via := range []struct {
		name string
		s    *server
	}{{"c, which never saw it", c}, {"a, which had it", a}} {
		code, body := agentCurl(t, via.s, "r7", "POST", up.URL+"/charge")
		if code != "503" || !strings.Contains(body, "marked reset") || !strings.Contains(body, "acknowledge-reset") {
			_, row, _ := via.s.stopgate(t, "status", "r7", "--json")
			t.Fatalf("after FLUSHDB the cancelled run's request through %s: %s %s (row now: %s); want 503 naming the reset and the way out",
				via.name, code, body, row)
		}
		t.Logf("after FLUSHDB, the cancelled run's request through %s: %s %s", via.name, code, body)
	}
	if hits.Load() != before {
		t.Fatal("the cancelled run's request reached the provider after the flush")
	}
	if n := admin.Exists(ctx, "sg:{r7}:run").Val(); n != 0 {
		t.Fatal("the cancelled run's row was created again")
	}
	// Every admission is refused, on this instance and on one started since.
	b := startServeEnv(t, store, "--data-dir", t.TempDir())
	for name, s := range map[string]*server{"a": a, "b (started since)": b} {
		if code, body := agentCurl(t, s, "fresh-"+name[:1], "POST", up.URL+"/charge"); code != "503" || !strings.Contains(body, "marked reset") {
			t.Errorf("%s: a new run's request during the reset: %s %s", name, code, body)
		}
		if msg := s.must(t, 1, "admit", "r8"); !strings.Contains(msg, "marked reset") {
			t.Errorf("%s: admit during the reset: %s", name, msg)
		}
	}
	if !strings.Contains(b.Log(), "lost writes it had acknowledged") {
		t.Errorf("the instance started on a reset store does not say so at start:\n%s", b.Log())
	}
	if hits.Load() != before {
		t.Fatal("a request reached the provider during the reset")
	}

	// The way out: cancel what was lost (its row is gone: the tombstone is
	// meant), then acknowledge.
	a.must(t, 0, "cancel", "r7", "--tombstone", "--reason", "lost in the flush: cancelled again")
	out := b.must(t, 0, "store", "acknowledge-reset", "--reason", "r7 cancelled again")
	if !strings.Contains(out, "acknowledged") {
		t.Fatalf("store acknowledge-reset said %q", out)
	}
	b.must(t, 1, "store", "acknowledge-reset", "--reason", "twice")
	if !strings.Contains(b.Log(), "reset is acknowledged") || !strings.Contains(b.Log(), "r7 cancelled again") {
		t.Errorf("the acknowledgement is not in the log with its reason:\n%s", b.Log())
	}
	// a admits again from its next marker check (every 2s).
	deadline := time.Now().Add(10 * time.Second)
	for {
		code, body := agentCurl(t, a, "after", "POST", up.URL+"/charge")
		if code == "200" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("10s after the acknowledgement a new run is still refused: %s %s", code, body)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if code, _ := agentCurl(t, a, "r7", "POST", up.URL+"/charge"); code != "409" {
		t.Fatalf("the run cancelled again, after the acknowledgement: %s, want 409", code)
	}
	var row state.Run
	if err := json.Unmarshal([]byte(a.must(t, 0, "status", "r7", "--json")), &row); err != nil || row.Status == state.StatusActive {
		t.Fatalf("r7 after the acknowledgement: %+v %v", row, err)
	}
}

// TestServeSaysWhatElseCouldLoseACancel: serve warns at start of a Redis
// that asks no password and of one that evicts keys, and --require-durable
// refuses both (exit 1); a Redis with a password (from a file, or from
// STOPGATE_STORE_PASSWORD), noeviction and fsync always starts clean.
func TestServeSaysWhatElseCouldLoseACancel(t *testing.T) {
	open := redisserver.Start(t, redisserver.Options{AppendFsyncAlways: true})
	lru := redisserver.Start(t, redisserver.Options{AppendFsyncAlways: true, Password: testRedisPassword,
		Args: []string{"--maxmemory-policy", "allkeys-lru"}})
	safe := redisserver.Start(t, redisserver.Options{AppendFsyncAlways: true, Password: testRedisPassword})
	pw := passwordFile(t)
	for _, tc := range []struct {
		name  string
		redis *redisserver.Server
		env   []string
		args  []string
		warn  string // "" for none
	}{
		{"no password", open, nil, nil, "Redis asks no password"},
		{"allkeys-lru", lru, nil, []string{"--store-password-file", pw}, "Redis evicts keys when full (maxmemory-policy allkeys-lru)"},
		{"password from a file", safe, nil, []string{"--store-password-file", pw}, ""},
		{"password from the environment", safe, []string{"STOPGATE_STORE_PASSWORD=" + testRedisPassword}, nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bare := "redis://" + tc.redis.Addr() + "/0"
			s := startServeWith(t, "", tc.env, append([]string{"--store", bare, "--data-dir", t.TempDir()}, tc.args...)...)
			s.must(t, 0, "admit", "w1")
			var warned []string
			for _, line := range strings.Split(s.Log(), "\n") {
				if strings.Contains(line, "level=WARN") && strings.Contains(line, "store: ") {
					warned = append(warned, line)
					t.Logf("serve: %s", line)
				}
			}
			if tc.warn == "" && len(warned) != 0 {
				t.Fatalf("serve on a Redis with a password and noeviction warned:\n%s", strings.Join(warned, "\n"))
			}
			if tc.warn != "" && !strings.Contains(strings.Join(warned, "\n"), tc.warn) {
				t.Fatalf("serve did not warn %q:\n%s", tc.warn, s.Log())
			}

			if tc.warn == "" {
				durable := startServeWith(t, "", tc.env, append([]string{"--store", bare, "--require-durable", "--data-dir", t.TempDir()}, tc.args...)...)
				durable.must(t, 0, "admit", "w2")
				return
			}
			code, _, errOut := runBinary(t, tc.env, append([]string{"serve", "--proxy-addr", anyPort, "--control-addr", anyPort,
				"--browser-addr", anyPort, "--store", bare, "--require-durable", "--data-dir", t.TempDir()}, tc.args...)...)
			if code != cli.ExitError || !strings.Contains(errOut, "--require-durable") || !strings.Contains(errOut, tc.warn) || strings.Contains(errOut, testRedisPassword) {
				t.Fatalf("--require-durable: exit %d, want %d naming the flag and %q, without the password; stderr:\n%s", code, cli.ExitError, tc.warn, errOut)
			}
		})
	}
}

// TestAPasswordInStoreOnTheCommandLineIsWarnedOf (issue 23, finding 8):
// a Redis password in --store is in every user's ps; serve says so, as it
// does for --control-token. The same URL in STOPGATE_STORE is not.
func TestAPasswordInStoreOnTheCommandLineIsWarnedOf(t *testing.T) {
	srvRedis := redisserver.Start(t, redisserver.Options{Password: testRedisPassword})
	const warning = "a secret is on the command line"
	s := startServe(t, "--store", srvRedis.URL(), "--data-dir", t.TempDir())
	log := s.Log()
	if !strings.Contains(log, warning) || !strings.Contains(log, "flag=--store") || !strings.Contains(log, "--store-password-file") {
		t.Fatalf("no warning of the password in --store:\n%s", log)
	}
	if strings.Contains(log, testRedisPassword) {
		t.Fatalf("the log shows the password:\n%s", log)
	}
	env := startServeWith(t, "", []string{"STOPGATE_STORE=" + srvRedis.URL()}, "--data-dir", t.TempDir())
	if strings.Contains(env.Log(), warning) {
		t.Fatalf("a password in STOPGATE_STORE is warned of as if on the command line:\n%s", env.Log())
	}
}
