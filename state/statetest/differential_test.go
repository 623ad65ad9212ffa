package statetest_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
	"github.com/stopgate/stopgate/state/redisstore"
	"github.com/stopgate/stopgate/state/statetest"
)

// TestStoresAnswerAsTheModel: generated histories of every operation give
// the same answers, rows, intents and events on the embedded store, on
// Redis running stopgate's functions, and on Redis running them as scripts,
// as on the model.
func TestStoresAnswerAsTheModel(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	admin := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	t.Cleanup(func() { _ = admin.Close() })
	ctx := context.Background()
	if err := admin.Do(ctx, "ACL", "SETUSER", "app", "on", ">secret", "~*", "&*", "+@all", "-function").Err(); err != nil {
		t.Fatal(err)
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	files := 0
	redisOn := func(url string, db int, functions bool) statetest.OpenClocked {
		return func(t *testing.T, clock func() time.Time) state.Store {
			c := redis.NewClient(&redis.Options{Addr: srv.Addr(), DB: db})
			defer c.Close()
			if err := c.FlushDB(ctx).Err(); err != nil {
				t.Fatal(err)
			}
			s, err := redisstore.Open(ctx, fmt.Sprintf(url, srv.Addr(), db), redisstore.Options{Logger: quiet, Clock: clock})
			if err != nil {
				t.Fatal(err)
			}
			if s.Functions() != functions {
				t.Fatalf("the store runs functions %v, want %v", s.Functions(), functions)
			}
			return s
		}
	}
	statetest.Differential(t, map[string]statetest.OpenClocked{
		"the embedded store": func(t *testing.T, clock func() time.Time) state.Store {
			files++
			s, err := filestore.Open(filepath.Join(t.TempDir(), fmt.Sprintf("s%d.db", files)), filestore.Options{Logger: quiet, Now: clock})
			if err != nil {
				t.Fatal(err)
			}
			return s
		},
		"redis (functions)": redisOn("redis://%s/%d", 0, true),
		"redis (scripts)":   redisOn("redis://app:secret@%s/%d", 1, false),
	})
}
