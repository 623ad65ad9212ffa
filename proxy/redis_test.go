package proxy_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
)

// newRedisStore opens the Redis store on srv with each operation bounded
// by opTimeout.
func newRedisStore(t testing.TB, srv *redisserver.Server, opTimeout time.Duration) state.Store {
	t.Helper()
	s, err := redisstore.Open(context.Background(), srv.URL(), redisstore.Options{OpTimeout: opTimeout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func TestStoreDownOrPausedFailsClosed(t *testing.T) {
	for _, failure := range []string{"killed", "paused"} {
		t.Run(failure, func(t *testing.T) {
			srv := redisserver.Start(t, redisserver.Options{})
			e := newEnv(t, envOptions{store: newRedisStore(t, srv, 300*time.Millisecond), storeTimeout: time.Second})
			up := newUpstream(t, false, nil)
			e.admit("f1")
			c := e.client("f1", 1)
			if resp, _ := do(t, c, "POST", up.URL+"/x", strings.NewReader("a"), nil); resp.StatusCode != 200 {
				t.Fatalf("with the store up: %d", resp.StatusCode)
			}
			if failure == "killed" {
				srv.Kill()
			} else {
				srv.Pause()
				defer srv.Resume()
			}
			for i := range 3 {
				resp, body := do(t, c, "POST", up.URL+"/x", strings.NewReader(fmt.Sprint(i)), nil)
				r := decodeRefusal(t, body)
				if resp.StatusCode != 503 || r.Error != "store_unavailable" || resp.Header.Get("X-Stopgate-Refusal") != "store_unavailable" {
					t.Fatalf("store %s: %d %s", failure, resp.StatusCode, body)
				}
			}
			if got := up.Hits.Load(); got != 1 {
				t.Fatalf("upstream saw %d requests, want 1: nothing may pass unguarded", got)
			}
		})
	}
}

// TestCancelThroughOneInstanceReachesAnother: two sidecars share one Redis;
// a cancel committed anywhere stops the run's new requests at both and cuts
// a stream open on the other one.
func TestCancelThroughOneInstanceReachesAnother(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{AppendFsyncAlways: true})
	a := newEnv(t, envOptions{store: newRedisStore(t, srv, 2*time.Second)})
	b := newEnv(t, envOptions{store: newRedisStore(t, srv, 2*time.Second)})
	up := newUpstream(t, false, sse)
	a.admit("m1")
	_, lines := streamed(t, 1)(b.client("m1", 1).Get(up.URL + "/events"))
	d := endsWithin(t, lines, time.Second, func() { a.cancel("m1", time.Minute) })
	t.Logf("stream on the other instance cut %v after the cancel", d)
	before := up.Hits.Load()
	for _, e := range []*env{a, b} {
		resp, body := do(t, e.client("m1", 1), "POST", up.URL+"/x", strings.NewReader("late"), nil)
		if resp.StatusCode != 409 {
			t.Fatalf("after the cancel: %d %s", resp.StatusCode, body)
		}
	}
	if up.Hits.Load() != before {
		t.Fatal("a request reached the upstream after the cancel")
	}
}

func TestRaceAcrossTwoInstancesOnRedis(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	envs := []*env{newEnv(t, envOptions{store: newRedisStore(t, srv, 2*time.Second)}), newEnv(t, envOptions{store: newRedisStore(t, srv, 2*time.Second)})}
	up := newUpstream(t, false, nil)
	const workers, perWorker = 8, 8
	for round := range raceRounds(t) {
		run := fmt.Sprintf("rr-%d", round)
		envs[0].admit(run)
		before := up.Hits.Load()
		var wg sync.WaitGroup
		var mu sync.Mutex
		forwarded := 0
		for w := range workers {
			wg.Go(func() {
				c := envs[w%2].client(run, 1)
				for i := range perWorker {
					resp, _ := do(t, c, "POST", up.URL+"/effect", strings.NewReader(fmt.Sprintf("%d-%d", w, i)), nil)
					if resp.StatusCode == 200 {
						mu.Lock()
						forwarded++
						mu.Unlock()
					} else if resp.StatusCode != 409 {
						t.Errorf("unexpected %d", resp.StatusCode)
					}
				}
			})
		}
		wg.Go(func() {
			time.Sleep(time.Duration(round%10) * 3 * time.Millisecond)
			envs[1].cancel(run, time.Minute)
		})
		wg.Wait()
		counts := map[state.IntentState]int{}
		for _, in := range envs[0].intents(run) {
			counts[in.State]++
		}
		hits := int(up.Hits.Load() - before)
		if hits != forwarded || hits != counts[state.IntentResponded]+counts[state.IntentInFlight] || hits+counts[state.IntentCancelledBeforeDispatch] != workers*perWorker {
			t.Fatalf("%s: upstream %d, forwarded %d, ledger %v", run, hits, forwarded, counts)
		}
	}
}

// TestTheAnswerDoesNotWaitForItsRecord: the agent has the provider's answer
// before its RESPONDED is written. The record rides with the instance's
// next request, and the instance never reads its own outcome IN_FLIGHT.
// The store's OutcomeDelay is an hour, so nothing but those writes it.
func TestTheAnswerDoesNotWaitForItsRecord(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	ctx := context.Background()
	s, err := redisstore.Open(ctx, srv.URL(), redisstore.Options{OutcomeDelay: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	other := newRedisStore(t, srv, 2*time.Second)
	e := newEnv(t, envOptions{store: s})
	up := newUpstream(t, false, nil)
	e.admit("lazy")
	c := e.client("lazy", 1)
	post := func(path string) string {
		t.Helper()
		resp, body := do(t, c, "POST", up.URL+path, strings.NewReader(path), nil)
		if resp.StatusCode != 200 {
			t.Fatalf("POST %s: %d %s", path, resp.StatusCode, body)
		}
		return resp.Header.Get("X-Stopgate-Intent")
	}
	read := func(s state.Store, key string) state.Intent {
		t.Helper()
		in, err := s.Intent(ctx, "lazy", key)
		if err != nil {
			t.Fatal(err)
		}
		return in
	}

	first := post("/a")
	if in := read(other, first); in.State != state.IntentInFlight {
		t.Fatalf("another instance, right after the answer: %s, want IN_FLIGHT (the answer waited for its record)", in.State)
	}
	second := post("/b")
	if in := read(other, first); in.State != state.IntentResponded || in.StatusCode != 200 {
		t.Fatalf("another instance, after the next request: %s %d, want RESPONDED 200", in.State, in.StatusCode)
	}
	if in := read(s, second); in.State != state.IntentResponded || in.StatusCode != 200 {
		t.Fatalf("the instance that carried it, right after the answer: %s %d, want RESPONDED 200", in.State, in.StatusCode)
	}
}
