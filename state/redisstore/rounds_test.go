package redisstore_test

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
)

// TestRepeatedRequestsOfARunAtOnceAreAllAnswered: 64 requests of one run at
// once, each a repeat of an earlier one (a derived key taken, so each must
// read its next name), share calls; one read takes what all of them ask,
// so none is turned away for too many rounds.
func TestRepeatedRequestsOfARunAtOnceAreAllAnswered(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	s := open(t, srv.URL(), redisstore.Options{})
	must(s.Admit(tctx(t), state.AdmitRequest{RunID: "again", Actor: "t"}))(t)
	var failed atomic.Int64
	for round := range 2 {
		var wg sync.WaitGroup
		for c := range 64 {
			wg.Go(func() {
				for i := range 20 {
					req := guardReq("again", fmt.Sprintf("d-%04d-%04d", c, i))
					req.ExplicitKey = false
					res, err := s.Guard(tctx(t), req)
					if err == nil {
						_, err = s.Finish(tctx(t), state.FinishRequest{RunID: "again", Key: res.Intent.Key, Attempt: res.Intent.Attempts,
							Outcome: state.IntentResponded, StatusCode: 200, Actor: "p"})
					}
					if err != nil && failed.Add(1) == 1 {
						t.Errorf("round %d: %v", round, err)
					}
				}
			})
		}
		wg.Wait()
	}
	if n := failed.Load(); n > 0 {
		t.Fatalf("%d of %d requests were not answered", n, 2*64*20)
	}
}
