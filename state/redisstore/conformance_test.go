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

func TestOutcomeRidesWithTheNextCall(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	s := open(t, srv.URL(), redisstore.Options{OutcomeDelay: time.Hour})
	statetest.LaterRidesAlong(t, s, func() state.Store { return open(t, srv.URL(), redisstore.Options{}) })
}

// A read waits for an outcome queued by FinishLater even once that outcome
// has left the queue for a call still on its way: the read goes on another
// connection, and Redis could answer it first. Writes are paused on the
// server (CLIENT PAUSE WRITE) to hold the call.
func TestReadWaitsForAnOutcomeInTheCallUnderWay(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	admin := raw(t, srv.Addr())
	s := open(t, srv.URL(), redisstore.Options{OutcomeDelay: time.Hour})
	ctx := context.Background()
	statetest.ReadWaitsForAQueuedOutcome(t, s, func() func() {
		if err := admin.Do(ctx, "CLIENT", "PAUSE", "1500", "WRITE").Err(); err != nil {
			t.Fatal(err)
		}
		// The next guard carries the outcome into a call the pause holds.
		guarded := make(chan error, 1)
		go func() {
			_, err := s.Guard(ctx, state.GuardRequest{RunID: "r", Key: "k2", ExplicitKey: true, Boundary: state.BoundaryHTTP,
				LeaseOwner: "p", LeaseTTL: time.Minute, Actor: "p"})
			guarded <- err
		}()
		time.Sleep(100 * time.Millisecond)
		return func() {
			if err := admin.Do(ctx, "CLIENT", "UNPAUSE").Err(); err != nil {
				t.Error(err)
			}
			if err := <-guarded; err != nil {
				t.Error(err)
			}
		}
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
