// Package testkit holds what the tests of several packages share: real
// stores opened for a test (the embedded store in a temporary directory,
// Redis on a real redis-server), a bounded poll, the path of the real
// Chromium the browser tests drive, a program run as a real process until
// it answers, the stopgate binary built from the tree, a fleet's CA, the
// tools a test needs, a directory other uids can read, and a test logger.
//
// It never mocks a store or a browser: a missing redis-server or Chromium
// fails the test with how to install it. It is imported by tests only.
package testkit

import (
	"context"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/chromedp/chromedp/remote"
	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
	"github.com/stopgate/stopgate/state/redisstore"
)

// Logger discards, unless STOPGATE_TEST_LOG is set: then it writes
// everything, debug included, to stderr.
func Logger() *slog.Logger {
	if os.Getenv("STOPGATE_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// FileStore opens the embedded store in a temporary directory, closed when
// the test ends.
func FileStore(t testing.TB) *filestore.Store {
	t.Helper()
	s, err := filestore.Open(filepath.Join(t.TempDir(), "stopgate.db"), filestore.Options{Logger: Logger()})
	if err != nil {
		t.Fatalf("open the embedded store: %v", err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// RedisStore starts a real redis-server and opens the Redis store on it,
// both stopped when the test ends.
func RedisStore(t testing.TB) *redisstore.Store {
	t.Helper()
	return RedisStoreAt(t, redisserver.Start(t, redisserver.Options{}).URL())
}

// RedisStoreAt opens the Redis store on the server at url.
func RedisStoreAt(t testing.TB, url string) *redisstore.Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := redisstore.Open(ctx, url, redisstore.Options{Logger: Logger()})
	if err != nil {
		t.Fatalf("open the Redis store: %v", err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// OnBothStores runs fn once on the embedded store and once on a real
// redis-server: the edges must answer the same whichever store is behind.
func OnBothStores(t *testing.T, fn func(t *testing.T, store state.Store)) {
	t.Run("FileStore", func(t *testing.T) { fn(t, FileStore(t)) })
	t.Run("RedisStore", func(t *testing.T) { fn(t, RedisStore(t)) })
}

// Eventually polls cond every 20ms for at most d, and fails the test with
// what was awaited when it does not hold by then.
func Eventually(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %s: %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// DefaultChromium is where Debian's chromium package puts the browser.
const DefaultChromium = "/usr/bin/chromium"

// Chromium finds the browser the tests drive for real: $STOPGATE_CHROMIUM,
// Debian's, or chromium on PATH. Its absence fails the test: a browser
// guard tested without a browser proves nothing.
func Chromium(t testing.TB) string {
	t.Helper()
	if p := os.Getenv("STOPGATE_CHROMIUM"); p != "" {
		return p
	}
	if _, err := os.Stat(DefaultChromium); err == nil {
		return DefaultChromium
	}
	if p, err := exec.LookPath("chromium"); err == nil {
		return p
	}
	t.Fatalf("chromium is not installed (looked for $STOPGATE_CHROMIUM, %s, chromium on PATH): "+
		"run scripts/test-deps, or apt-get install chromium, or set STOPGATE_CHROMIUM", DefaultChromium)
	return ""
}

// Attach is a chromedp context on the browser behind ws, a DevTools
// WebSocket URL (a guarded one, as the browser guard hands out), with its
// first tab; cancel ends the context and its connection, while the
// browser itself keeps running.
func Attach(ctx context.Context, ws string) (context.Context, context.CancelFunc) {
	actx, cancelAlloc := remote.NewAllocator(ctx, ws, remote.NoModifyURL)
	tab, cancelTab := chromedp.NewContext(actx)
	return tab, func() { cancelTab(); cancelAlloc() }
}
