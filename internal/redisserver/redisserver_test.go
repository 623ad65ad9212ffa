package redisserver

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Each persistence option starts a server whose configuration says so, as
// the benchmark and the durability tests rely on.
func TestLaunchPersistsAsAsked(t *testing.T) {
	cases := []struct {
		name       string
		opts       Options
		appendonly string
		fsync      string
	}{
		{"aof off", Options{}, "no", ""},
		{"aof everysec", Options{AppendFsyncEverySec: true}, "yes", "everysec"},
		{"aof always", Options{AppendFsyncAlways: true}, "yes", "always"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			port, err := FreePort()
			if err != nil {
				t.Fatal(err)
			}
			p, err := Launch(t.TempDir(), port, tc.opts)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Kill()
			if p.PID() <= 0 {
				t.Fatalf("pid %d", p.PID())
			}
			rdb := redis.NewClient(&redis.Options{Addr: p.Addr()})
			defer rdb.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			got, err := rdb.ConfigGet(ctx, "append*").Result()
			if err != nil {
				t.Fatal(err)
			}
			if got["appendonly"] != tc.appendonly {
				t.Errorf("appendonly = %q, want %q", got["appendonly"], tc.appendonly)
			}
			if tc.fsync != "" && got["appendfsync"] != tc.fsync {
				t.Errorf("appendfsync = %q, want %q", got["appendfsync"], tc.fsync)
			}
		})
	}
}

func TestLaunchRefusesTwoFsyncPolicies(t *testing.T) {
	if _, err := Launch(t.TempDir(), 1, Options{AppendFsyncAlways: true, AppendFsyncEverySec: true}); err == nil {
		t.Fatal("Launch accepted both fsync policies")
	}
}

// A test's server is gone after Kill, and Restart brings it back on the
// same address with the same data.
func TestServerRestartKeepsData(t *testing.T) {
	s := Start(t, Options{AppendFsyncAlways: true})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rdb := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1})
	defer rdb.Close()
	if err := rdb.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	s.Restart()
	if got, err := rdb.Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Fatalf("after restart: %q, %v", got, err)
	}
}
