package redisstore_test

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
	"github.com/stopgate/stopgate/state/statetest"
)

// quiet keeps the store's notes out of the test output unless -v.
func quiet(t testing.TB) *slog.Logger {
	if testing.Verbose() {
		return slog.Default()
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

func open(t testing.TB, url string, opts redisstore.Options) *redisstore.Store {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = quiet(t)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := redisstore.Open(ctx, url, opts)
	if err != nil {
		t.Fatalf("open %s: %v", url, err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// raw is a plain client for inspecting and disturbing the server.
func raw(t testing.TB, addr string) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func TestConformance(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	admin := raw(t, srv.Addr())
	statetest.Run(t, func(t *testing.T) state.Store {
		// One server for the suite, emptied before each test: starting a
		// server per test would cost more than the tests.
		if err := admin.FlushAll(context.Background()).Err(); err != nil {
			t.Fatalf("flushall: %v", err)
		}
		s := open(t, srv.URL(), redisstore.Options{})
		if !s.Functions() {
			t.Fatal("the store runs scripts on a Redis that takes functions")
		}
		return s
	})
}

// Where Redis refuses stopgate's function library (before 7.0, or an ACL
// without FUNCTION), the same programs run as scripts: the whole suite
// again on that path.
func TestConformanceOnScripts(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	admin := raw(t, srv.Addr())
	if err := admin.Do(context.Background(), "ACL", "SETUSER", "app", "on", ">secret", "~*", "&*", "+@all", "-function").Err(); err != nil {
		t.Fatal(err)
	}
	url := "redis://app:secret@" + srv.Addr() + "/0"
	statetest.Run(t, func(t *testing.T) state.Store {
		if err := admin.FlushAll(context.Background()).Err(); err != nil {
			t.Fatalf("flushall: %v", err)
		}
		s := open(t, url, redisstore.Options{})
		if s.Functions() {
			t.Fatal("the store loaded its functions though FUNCTION is denied to its user")
		}
		return s
	})
}
