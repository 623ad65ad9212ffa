package redisstore_test

import (
	"testing"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/lincheck"
	"github.com/stopgate/stopgate/state/redisstore"
)

// TestLinearizable records histories of concurrent guards, cancels and
// reads through three stores on one Redis (three stopgate instances) and
// checks them against the model of a run (package lincheck). Operations
// given deadlines of a few milliseconds or less fail now and then after
// Redis ran them: the model takes those as ambiguous.
func TestLinearizable(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	lincheck.Run(t, "redisstore", lincheck.Seeds(t, 8), lincheck.Config{}, func(t *testing.T) []state.Store {
		var stores []state.Store
		for range 3 {
			stores = append(stores, open(t, srv.URL(), redisstore.Options{}))
		}
		return stores
	})
}
