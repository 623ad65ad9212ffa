package redisstore_test

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
)

// TestAResetStoreAdmitsNothingUntilAcknowledged: FLUSHDB empties the
// store of every cancel it held. The instances that were working on it
// notice at their next marker check and mark the store reset in Redis, so
// that they, and an instance started since, refuse every admission
// (ErrInconsistent, which wraps ErrUnavailable) and fail their readiness
// ping — until an operator acknowledges the reset. Cancels and reads go
// on meanwhile.
func TestAResetStoreAdmitsNothingUntilAcknowledged(t *testing.T) {
	for _, tc := range []struct {
		name string
		// freshFirst starts a new instance on the emptied store before
		// the old one checks: it makes a new marker, which the old one
		// must not take for its own.
		freshFirst bool
	}{
		{name: "the old instance notices first"},
		{name: "a new instance starts on the emptied store first", freshFirst: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := redisserver.Start(t, redisserver.Options{})
			ctx := tctx(t)
			admin := raw(t, srv.Addr())
			// An hour: the test checks when it means to.
			slow := redisstore.Options{CheckInterval: time.Hour}
			old := open(t, srv.URL(), slow)
			auto := func(run, key string) state.GuardRequest {
				r := guardReq(run, key)
				r.AutoAdmit = true
				return r
			}
			if g := must(old.Guard(ctx, auto("r7", "k1")))(t); !g.Admitted {
				t.Fatalf("before the reset: %+v", g)
			}
			must(old.Cancel(ctx, state.CancelRequest{RunID: "r7", Actor: "operator:alice", Reason: "stop"}))(t)

			if err := admin.FlushDB(ctx).Err(); err != nil {
				t.Fatal(err)
			}
			var fresh *redisstore.Store
			if tc.freshFirst {
				fresh = open(t, srv.URL(), slow)
			}
			must(0, old.CheckMarker(ctx))(t)
			if fresh == nil {
				fresh = open(t, srv.URL(), slow)
			}
			must(0, fresh.CheckMarker(ctx))(t)

			for name, s := range map[string]*redisstore.Store{"old": old, "fresh": fresh} {
				_, err := s.Guard(ctx, auto("r7", "k2"))
				if !errors.Is(err, state.ErrInconsistent) || !errors.Is(err, state.ErrUnavailable) {
					t.Errorf("%s instance: the cancelled run's guard after FLUSHDB: %v; want ErrInconsistent", name, err)
				}
				if _, err := s.Guard(ctx, auto("new-run", "k1")); !errors.Is(err, state.ErrInconsistent) {
					t.Errorf("%s instance: a new run's guard after FLUSHDB: %v; want ErrInconsistent", name, err)
				}
				if _, err := s.Admit(ctx, state.AdmitRequest{RunID: "r8", Actor: "operator:bob"}); !errors.Is(err, state.ErrInconsistent) {
					t.Errorf("%s instance: admit after FLUSHDB: %v; want ErrInconsistent", name, err)
				}
				if err := s.Ping(ctx); !errors.Is(err, state.ErrInconsistent) {
					t.Errorf("%s instance: ping (readiness) after FLUSHDB: %v; want ErrInconsistent", name, err)
				}
			}
			if n := admin.Exists(ctx, redisstore.KeysOf("r7")[0], redisstore.KeysOf("new-run")[0]).Val(); n != 0 {
				t.Fatalf("a refused guard wrote %d rows", n)
			}
			// A cancel is never refused: it only stops things.
			if _, err := old.Cancel(ctx, state.CancelRequest{RunID: "r7", Actor: "operator:alice", Reason: "again"}); err != nil {
				t.Fatalf("cancel in a reset store: %v", err)
			}
			m := must(old.Marker(ctx))(t)
			if m.State != redisstore.MarkerReset || m.Reason == "" || m.By == "" {
				t.Fatalf("marker after the reset: %+v", m)
			}

			acked := must(fresh.Acknowledge(ctx, "operator:carol", "restored nothing: the runs of the last hour are re-cancelled by hand"))(t)
			if acked.State != redisstore.MarkerOK || !acked.Acked || acked.By != "operator:carol" || acked.Epoch <= m.Epoch {
				t.Fatalf("acknowledged marker: %+v (was %+v)", acked, m)
			}
			if _, err := fresh.Acknowledge(ctx, "operator:carol", "twice"); !errors.Is(err, redisstore.ErrNotReset) {
				t.Fatalf("a second acknowledgement: %v; want ErrNotReset", err)
			}
			for name, s := range map[string]*redisstore.Store{"old": old, "fresh": fresh} {
				must(0, s.CheckMarker(ctx))(t)
				if err := s.Ping(ctx); err != nil {
					t.Errorf("%s instance: ping after the acknowledgement: %v", name, err)
				}
				if g, err := s.Guard(ctx, auto("after-"+name, "k1")); err != nil || !g.Admitted {
					t.Errorf("%s instance: a new run after the acknowledgement: %+v %v", name, g, err)
				}
				// The tombstone the cancel wrote during the reset holds.
				if g, err := s.Guard(ctx, auto("r7", "k3-"+name)); err != nil || g.Admitted {
					t.Errorf("%s instance: the run cancelled again during the reset: %+v %v; want refused", name, g, err)
				}
			}
			// A marker seen once is not taken for a reset again.
			must(0, old.CheckMarker(ctx))(t)
			if err := old.Ping(ctx); err != nil {
				t.Fatalf("ping on a second check: %v", err)
			}
		})
	}
}

// TestTheMarkerIsCheckedInTheBackground: nobody has to call CheckMarker:
// an open store reads its marker every CheckInterval, and fails closed
// within about one interval of a FLUSHALL.
func TestTheMarkerIsCheckedInTheBackground(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	ctx := tctx(t)
	s := open(t, srv.URL(), redisstore.Options{CheckInterval: 50 * time.Millisecond})
	must(0, s.Ping(ctx))(t)
	if err := raw(t, srv.Addr()).FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for s.Ping(ctx) == nil {
		if time.Now().After(deadline) {
			t.Fatal("5s after FLUSHALL the store still answers ready")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := s.Ping(ctx); !errors.Is(err, state.ErrInconsistent) {
		t.Fatalf("ping after FLUSHALL: %v; want ErrInconsistent", err)
	}
}

// TestARowGoneIsNotCreatedAgain: a run row evicted or deleted (its other
// keys too) is, to a guard or an admission, a run never seen. An instance
// that saw the row does not create it again: it marks the store reset
// and refuses (ErrInconsistent), and so does every instance from its next
// check, one that never saw the run included.
func TestARowGoneIsNotCreatedAgain(t *testing.T) {
	for _, tc := range []struct {
		name string
		// again is the step of the lost run after the loss.
		again runStep
	}{
		{"an auto-admitting guard", guardStep("k2", true)},
		{"a guard that admits nothing", guardStep("k2", false)},
		{"an admission", admitStep},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := redisserver.Start(t, redisserver.Options{})
			ctx := tctx(t)
			admin := raw(t, srv.Addr())
			slow := redisstore.Options{CheckInterval: time.Hour}
			s := open(t, srv.URL(), slow)
			other := open(t, srv.URL(), slow)
			must(s.Admit(ctx, state.AdmitRequest{RunID: "lost", Actor: "operator:alice"}))(t)
			must(s.Guard(ctx, guardReq("lost", "k1")))(t)
			must(s.Cancel(ctx, state.CancelRequest{RunID: "lost", Actor: "operator:alice", Reason: "stop"}))(t)
			if err := admin.Del(ctx, redisstore.KeysOf("lost")...).Err(); err != nil {
				t.Fatal(err)
			}

			err := tc.again(ctx, s, "lost")
			if !errors.Is(err, state.ErrInconsistent) || !strings.Contains(err.Error(), "run lost") {
				t.Fatalf("the lost run's step: %v; want ErrInconsistent naming the run", err)
			}
			if n := admin.Exists(ctx, redisstore.KeysOf("lost")[0]).Val(); n != 0 {
				t.Fatal("the lost row was created again")
			}
			m := must(s.Marker(ctx))(t)
			if m.State != redisstore.MarkerReset || !strings.Contains(m.ResetReason, "lost") {
				t.Fatalf("the marker after the loss: %+v", m)
			}
			must(0, other.CheckMarker(ctx))(t)
			r := guardReq("never-seen", "k1")
			r.AutoAdmit = true
			if _, err := other.Guard(ctx, r); !errors.Is(err, state.ErrInconsistent) {
				t.Fatalf("another instance, after its check: %v; want ErrInconsistent", err)
			}
		})
	}
}

// TestAnOlderCopyRestoredIsAReset: the marker counts the checks made of
// it; Redis restarted from a snapshot older than the last check an
// instance made (and so without the cancel made since) shows a count that
// went back, and the store is marked reset. The epoch alone is the same.
func TestAnOlderCopyRestoredIsAReset(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	ctx := tctx(t)
	admin := raw(t, srv.Addr())
	s := open(t, srv.URL(), redisstore.Options{CheckInterval: time.Hour})
	must(s.Admit(ctx, state.AdmitRequest{RunID: "r", Actor: "operator:alice"}))(t)
	if err := admin.Save(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	must(0, s.CheckMarker(ctx))(t)
	must(s.Cancel(ctx, state.CancelRequest{RunID: "r", Actor: "operator:alice", Reason: "after the snapshot"}))(t)
	srv.Kill()
	srv.Restart() // AOF off: Redis loads the snapshot, the run ACTIVE again
	if r := must(s.Get(ctx, "r"))(t); r.Status != state.StatusActive {
		t.Fatalf("the restored copy has the run %s; the test needs it ACTIVE", r.Status)
	}
	must(0, s.CheckMarker(ctx))(t)
	m := must(s.Marker(ctx))(t)
	if m.State != redisstore.MarkerReset || !strings.Contains(m.ResetReason, "went back") {
		t.Fatalf("the marker of a restored older copy: %+v", m)
	}
	r := guardReq("r", "k1")
	if _, err := s.Guard(ctx, r); !errors.Is(err, state.ErrInconsistent) {
		t.Fatalf("the guard of the run whose cancel was lost: %v; want ErrInconsistent", err)
	}
}

// TestTheMarkerFileOutlivesTheProcess: an instance restarted after Redis
// was emptied knows, from its marker file, that it saw a marker: the
// store is reset. Without the file, a restarted instance cannot tell an
// emptied store from a new one: the limit the file is for.
func TestTheMarkerFileOutlivesTheProcess(t *testing.T) {
	for _, tc := range []struct {
		name      string
		file      bool
		wantReset bool
	}{
		{"with the file", true, true},
		{"without the file", false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := redisserver.Start(t, redisserver.Options{})
			ctx := tctx(t)
			opts := redisstore.Options{CheckInterval: time.Hour}
			if tc.file {
				opts.MarkerFile = filepath.Join(t.TempDir(), "redis-marker.json")
			}
			s := open(t, srv.URL(), opts)
			must(s.Admit(ctx, state.AdmitRequest{RunID: "r", Actor: "operator:alice"}))(t)
			must(0, s.Close())(t)
			if err := raw(t, srv.Addr()).FlushAll(ctx).Err(); err != nil {
				t.Fatal(err)
			}
			again := open(t, srv.URL(), opts)
			m := must(again.Marker(ctx))(t)
			if got := m.State == redisstore.MarkerReset; got != tc.wantReset {
				t.Fatalf("the marker after a restart on an emptied store: %+v; want reset %v", m, tc.wantReset)
			}
			if tc.file {
				// The file names its store: another store's marker is new.
				srv2 := redisserver.Start(t, redisserver.Options{})
				if m := must(open(t, srv2.URL(), opts).Marker(ctx))(t); m.State != redisstore.MarkerOK {
					t.Fatalf("another store with this file: %+v", m)
				}
			}
		})
	}
}

// TestAMarkerNotStopgatesIsAReset: a marker written by hand (or half of
// one) is not guessed at.
func TestAMarkerNotStopgatesIsAReset(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	ctx := tctx(t)
	s := open(t, srv.URL(), redisstore.Options{CheckInterval: time.Hour})
	if err := raw(t, srv.Addr()).HSet(ctx, "sg:{marker}", "state", "fine").Err(); err != nil {
		t.Fatal(err)
	}
	must(0, s.CheckMarker(ctx))(t)
	if err := s.Ping(ctx); !errors.Is(err, state.ErrInconsistent) {
		t.Fatalf("ping with a marker stopgate did not write: %v", err)
	}
}

// TestNoRowIsCreatedInAStoreEmptiedSinceTheLastCheck: a step that may
// create a row (an admission, an auto-admitting guard of a run this
// instance has not seen) reads the marker first, so that an instance does
// not wait for its next check to notice a flush before it creates a row.
func TestNoRowIsCreatedInAStoreEmptiedSinceTheLastCheck(t *testing.T) {
	for _, tc := range []struct {
		name   string
		create runStep
	}{
		{"an auto-admitting guard", guardStep("k1", true)},
		{"an admission", admitStep},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := redisserver.Start(t, redisserver.Options{})
			ctx := tctx(t)
			admin := raw(t, srv.Addr())
			s := open(t, srv.URL(), redisstore.Options{CheckInterval: time.Hour})
			if err := tc.create(ctx, s, "before"); err != nil {
				t.Fatalf("before the flush: %v", err)
			}
			if err := admin.FlushAll(ctx).Err(); err != nil {
				t.Fatal(err)
			}
			if err := tc.create(ctx, s, "unseen"); !errors.Is(err, state.ErrInconsistent) || !strings.Contains(err.Error(), "is gone") {
				t.Fatalf("a new run right after the flush: %v; want ErrInconsistent saying the marker is gone", err)
			}
			if n := admin.Exists(ctx, redisstore.KeysOf("unseen")[0]).Val(); n != 0 {
				t.Fatal("a row was created in the emptied store")
			}
		})
	}
}

// runStep is a step of a run that may create the run's row.
type runStep func(ctx context.Context, s *redisstore.Store, run string) error

// guardStep guards key of the run, admitting the run first when autoAdmit.
func guardStep(key string, autoAdmit bool) runStep {
	return func(ctx context.Context, s *redisstore.Store, run string) error {
		r := guardReq(run, key)
		r.AutoAdmit = autoAdmit
		_, err := s.Guard(ctx, r)
		return err
	}
}

// admitStep admits the run as an operator.
func admitStep(ctx context.Context, s *redisstore.Store, run string) error {
	_, err := s.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "operator:bob"})
	return err
}
