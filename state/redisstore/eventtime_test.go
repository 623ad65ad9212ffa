package redisstore

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/state"
)

// A step's audit events are dated at the step's time (its one clock read,
// never earlier than the run's last step), not at the moment XADD runs:
// a Redis stopped halfway through a guard (SIGSTOP after the fence was
// checked) must not date its admission at the resume, after the caller
// was told nothing was sent. Here the run's last step is set in the
// future, so that the step's time and the server's clock differ by far.
func TestEventsCarryTheirStepsTime(t *testing.T) {
	s, addr := testStore(t)
	admin := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { _ = admin.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	for _, tc := range []struct {
		name string
		// stream, if set, is the id of an entry already in the audit
		// stream, later than the step: its events then take the
		// server's next id, and the step still succeeds.
		stream func(future time.Time) string
	}{
		{name: "a stream of this layout"},
		{name: "a stream whose last entry is later", stream: func(future time.Time) string {
			return strconv.FormatInt(future.Add(time.Minute).UnixMilli(), 10) + "-0"
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			run := "evtime-" + strconv.Itoa(len(tc.name))
			if _, err := s.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "t"}); err != nil {
				t.Fatal(err)
			}
			future := time.Now().Add(time.Hour).Truncate(time.Millisecond)
			k := keysOf(run)
			if err := admin.HSet(ctx, k.row, "t", future.UnixMilli()).Err(); err != nil {
				t.Fatal(err)
			}
			if tc.stream != nil {
				if err := admin.XAdd(ctx, &redis.XAddArgs{Stream: k.events, ID: tc.stream(future), Values: []string{"e", "test.later x"}}).Err(); err != nil {
					t.Fatal(err)
				}
			}
			g, err := s.Guard(ctx, state.GuardRequest{RunID: run, Key: "k", ExplicitKey: true, Boundary: state.BoundaryHTTP,
				LeaseOwner: "t", LeaseTTL: time.Minute, Actor: "t"})
			if err != nil || !g.Admitted {
				t.Fatalf("guard: %+v %v", g, err)
			}
			if !g.Intent.CreatedAt.Equal(future) {
				t.Fatalf("the intent was created at %s, want the run's last step %s", g.Intent.CreatedAt, future)
			}
			evs, err := s.Events(ctx, run)
			if err != nil {
				t.Fatal(err)
			}
			last := evs[len(evs)-1]
			if last.Kind != state.EventIntentAdmitted {
				t.Fatalf("last event %+v, want the admission", last)
			}
			if tc.stream == nil && !last.At.Equal(future) {
				t.Errorf("the admission is dated %s, want its step's time %s", last.At, future)
			}
			if tc.stream != nil && last.At.Before(future) {
				t.Errorf("the admission is dated %s, before the stream's last entry", last.At)
			}
		})
	}
}
