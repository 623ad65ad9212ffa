package redisstore

import (
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/stopgate/stopgate/internal/redisserver"
)

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// testStore opens a store on a redis-server of its own, and says where
// that server listens.
func testStore(t *testing.T) (*Store, string) {
	t.Helper()
	srv := redisserver.Start(t, redisserver.Options{})
	s, err := Open(context.Background(), srv.URL(), Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s, srv.Addr()
}
