package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
)

func tctx(t testing.TB) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return c
}

func guardReq(run, key string) state.GuardRequest {
	return state.GuardRequest{
		RunID: run, Key: key, ExplicitKey: true, Boundary: state.BoundaryHTTP,
		Method: "POST", Target: "https://api.example/charge", BodyDigest: "d",
		LeaseOwner: "proxy:1", LeaseTTL: time.Minute, Actor: "proxy:1",
	}
}

// must(f())(t) is f's value, or the end of the test if f failed.
func must[T any](v T, err error) func(testing.TB) T {
	return func(t testing.TB) T {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
}

// An acknowledged cancel is on disk before the reply (appendfsync always):
// kill -9 of redis-server loses none of it, and the restarted server refuses
// the run's next effect.
func TestCancelSurvivesKill9OfRedis(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{AppendFsyncAlways: true})
	s := open(t, srv.URL(), redisstore.Options{})
	ctx := tctx(t)

	must(s.Admit(ctx, state.AdmitRequest{RunID: "run_42", Actor: "test"}))(t)
	g := must(s.Guard(ctx, guardReq("run_42", "charge-1")))(t)
	if !g.Admitted {
		t.Fatalf("guard before the cancel refused: %+v", g)
	}
	res := must(s.Cancel(ctx, state.CancelRequest{RunID: "run_42", Actor: "operator:alice", Reason: "stop pressed", DrainTimeout: time.Minute}))(t)
	if !res.Changed || res.Run.Status != state.StatusCancelling {
		t.Fatalf("cancel: %+v", res)
	}

	srv.Kill()
	srv.Restart()

	s2 := open(t, srv.URL(), redisstore.Options{})
	r := must(s2.Get(ctx, "run_42"))(t)
	if r.Status != state.StatusCancelling || r.CancelVersion != 2 || r.Reason != "stop pressed" {
		t.Fatalf("after kill -9 the run is %s/%d (%q), want CANCELLING/2", r.Status, r.CancelVersion, r.Reason)
	}
	evs := must(s2.Events(ctx, "run_42"))(t)
	var kinds []string
	for _, e := range evs {
		kinds = append(kinds, e.Kind)
	}
	if want := []string{state.EventRunAdmitted, state.EventIntentAdmitted, state.EventRunCancelled}; !slices.Equal(kinds, want) {
		t.Fatalf("events after kill -9: %v, want %v", kinds, want)
	}
	ins := must(s2.Intents(ctx, "run_42"))(t)
	if len(ins) != 1 || ins[0].Key != "charge-1" || ins[0].State != state.IntentInFlight {
		t.Fatalf("intents after kill -9: %+v", ins)
	}
	refused := must(s2.Guard(ctx, guardReq("run_42", "charge-2")))(t)
	if refused.Admitted || refused.Refusal != state.RefusalRunNotActive {
		t.Fatalf("guard after the restart: %+v", refused)
	}
	draining := must(s2.DrainingRuns(ctx))(t)
	if !slices.Contains(draining, "run_42") {
		t.Fatalf("the cancelling run fell out of the draining set: %v", draining)
	}
}

// Redis forgets loaded scripts on SCRIPT FLUSH (and on restart), and
// functions on FUNCTION FLUSH (or a restart without persistence): every
// operation must load its program again by itself.
func TestScriptsReloadAfterScriptFlush(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	s := open(t, srv.URL(), redisstore.Options{})
	admin := raw(t, srv.Addr())
	ctx := tctx(t)

	must(s.Admit(ctx, state.AdmitRequest{RunID: "r", Actor: "test"}))(t)
	g := must(s.Guard(ctx, guardReq("r", "k1")))(t)
	for step, op := range []func() error{
		func() error { _, err := s.Admit(ctx, state.AdmitRequest{RunID: "r2", Actor: "test"}); return err },
		func() error { _, err := s.Guard(ctx, guardReq("r", "k2")); return err },
		func() error {
			_, err := s.Finish(ctx, state.FinishRequest{RunID: "r", Key: "k1", Attempt: g.Intent.Attempts, Outcome: state.IntentResponded, StatusCode: 200, Actor: "p"})
			return err
		},
		func() error {
			_, err := s.Renew(ctx, state.RenewRequest{Owner: "proxy:1", TTL: time.Minute, Refs: []state.IntentRef{{RunID: "r", Key: "k2"}}})
			return err
		},
		func() error { _, err := s.Cancel(ctx, state.CancelRequest{RunID: "r", Actor: "op"}); return err },
		func() error { _, err := s.Tick(ctx, state.TickRequest{RunID: "r", Actor: "sweeper:test"}); return err },
		func() error {
			_, err := s.Complete(ctx, state.CompleteRequest{RunID: "r2", Version: 1, Actor: "worker"})
			return err
		},
		func() error { _, err := s.List(ctx, ""); return err },
	} {
		if err := admin.ScriptFlush(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		if err := admin.FunctionFlush(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		if err := op(); err != nil {
			t.Fatalf("step %d after SCRIPT FLUSH and FUNCTION FLUSH: %v", step, err)
		}
	}
	r := must(s.Get(ctx, "r"))(t)
	if r.Status != state.StatusUnknown || r.StatusReason != state.ReasonDrainTimeout {
		// drain 0: the tick cut k2, still in flight, at once.
		t.Fatalf("run after the walk: %+v", r)
	}
}

// A store that cannot reach Redis answers ErrUnavailable, promptly, from
// every operation: callers fail closed on it.
func TestStoreDownIsUnavailable(t *testing.T) {
	const opTimeout = 300 * time.Millisecond
	srv := redisserver.Start(t, redisserver.Options{})
	s := open(t, srv.URL(), redisstore.Options{OpTimeout: opTimeout})
	ctx := tctx(t)
	must(s.Admit(ctx, state.AdmitRequest{RunID: "r", Actor: "test"}))(t)
	g := must(s.Guard(ctx, guardReq("r", "k")))(t)
	// A run no operation below touches: the guard that times out on it
	// may still run when Redis resumes, and nothing else may race it.
	must(s.Admit(ctx, state.AdmitRequest{RunID: "p", Actor: "test"}))(t)

	ops := []struct {
		name string
		fn   func() error
	}{
		{"ping", func() error { return s.Ping(ctx) }},
		{"admit", func() error { _, err := s.Admit(ctx, state.AdmitRequest{RunID: "r", Actor: "t"}); return err }},
		{"cancel", func() error { _, err := s.Cancel(ctx, state.CancelRequest{RunID: "r", Actor: "t"}); return err }},
		{"complete", func() error {
			_, err := s.Complete(ctx, state.CompleteRequest{RunID: "r", Version: 1, Actor: "t"})
			return err
		}},
		{"get", func() error { _, err := s.Get(ctx, "r"); return err }},
		{"list", func() error { _, err := s.List(ctx, ""); return err }},
		{"draining runs", func() error { _, err := s.DrainingRuns(ctx); return err }},
		{"active runs", func() error { _, err := s.ActiveRuns(ctx, "", 10); return err }},
		{"note", func() error {
			return s.Note(ctx, state.NoteRequest{RunID: "r", Key: "k", Kind: state.EventIntentCut, Actor: "p"})
		}},
		{"prune", func() error {
			_, err := s.Prune(ctx, state.PruneRequest{FinalBefore: time.Now(), Limit: 10})
			return err
		}},
		{"guard", func() error { _, err := s.Guard(ctx, guardReq("r", "k2")); return err }},
		{"guard auto-admit", func() error {
			req := guardReq("fresh", "k")
			req.AutoAdmit = true
			_, err := s.Guard(ctx, req)
			return err
		}},
		{"finish", func() error {
			_, err := s.Finish(ctx, state.FinishRequest{RunID: "r", Key: "k", Attempt: g.Intent.Attempts, Outcome: state.IntentResponded, Actor: "p"})
			return err
		}},
		{"resolve", func() error {
			_, err := s.Resolve(ctx, state.ResolveRequest{RunID: "r", Key: "k", Source: "operator", Actor: "op"})
			return err
		}},
		{"renew", func() error {
			_, err := s.Renew(ctx, state.RenewRequest{Owner: "proxy:1", TTL: time.Minute, Refs: []state.IntentRef{{RunID: "r", Key: "k"}}})
			return err
		}},
		{"tick", func() error { _, err := s.Tick(ctx, state.TickRequest{RunID: "r", Actor: "f"}); return err }},
		{"intent", func() error { _, err := s.Intent(ctx, "r", "k"); return err }},
		{"intents", func() error { _, err := s.Intents(ctx, "r"); return err }},
		{"events", func() error { _, err := s.Events(ctx, "r"); return err }},
		{"cancels", func() error { _, err := s.Cancels(ctx); return err }},
		{"durability", func() error { _, err := s.Durability(ctx); return err }},
	}
	// The operations run at once: each is bounded by its own op timeout,
	// and a paused server would otherwise cost one timeout per operation.
	check := func(t *testing.T, how string) {
		var wg sync.WaitGroup
		for _, op := range ops {
			wg.Go(func() {
				start := time.Now()
				err := op.fn()
				took := time.Since(start)
				if !errors.Is(err, state.ErrUnavailable) {
					t.Errorf("%s with redis %s: got %v, want ErrUnavailable", op.name, how, err)
					return
				}
				// Generous: the point is that it returns, not how fast.
				if took > opTimeout+3*time.Second {
					t.Errorf("%s with redis %s took %v", op.name, how, took)
				}
				if !strings.Contains(err.Error(), "redis") {
					t.Errorf("%s: error %q does not say what failed", op.name, err)
				}
			})
		}
		wg.Wait()
	}

	t.Run("paused", func(t *testing.T) {
		srv.Pause()
		start := time.Now()
		_, err := s.Guard(ctx, guardReq("p", "during-pause"))
		if !errors.Is(err, state.ErrUnavailable) {
			srv.Resume()
			t.Fatalf("guard with redis paused: got %v, want ErrUnavailable", err)
		}
		if took := time.Since(start); took < opTimeout/2 {
			t.Errorf("guard gave up after %v, before the %v op timeout", took, opTimeout)
		}
		check(t, "paused")
		srv.Resume()

		// The store recovers by itself once Redis answers again.
		deadline := time.Now().Add(5 * time.Second)
		for s.Ping(ctx) != nil {
			if time.Now().After(deadline) {
				t.Fatal("store did not recover after redis resumed")
			}
			time.Sleep(20 * time.Millisecond)
		}
		// The guard whose reply was lost may still have run once Redis read
		// it: then it is recorded IN_FLIGHT, and its lease expiry will make
		// it UNKNOWN. Never anything that claims an answer.
		in, err := s.Intent(ctx, "p", "during-pause")
		switch {
		case errors.Is(err, state.ErrNotFound):
		case err != nil:
			t.Fatal(err)
		case in.State != state.IntentInFlight || in.Attempts != 1:
			t.Fatalf("guard that timed out is recorded as %+v", in)
		}
	})

	t.Run("killed", func(t *testing.T) {
		srv.Kill()
		check(t, "killed")
	})
}

func TestDurabilityReport(t *testing.T) {
	ctx := tctx(t)
	t.Run("always", func(t *testing.T) {
		srv := redisserver.Start(t, redisserver.Options{AppendFsyncAlways: true})
		s := open(t, srv.URL(), redisstore.Options{})
		d := must(s.Durability(ctx))(t)
		if !d.Known || !d.AOF || d.Fsync != "always" || !d.Safe() {
			t.Fatalf("AOF always reported as %+v (safe %v)", d, d.Safe())
		}
		if !strings.Contains(d.Describe(), "power loss") {
			t.Fatalf("describe: %q", d.Describe())
		}

		if err := raw(t, srv.Addr()).ConfigSet(ctx, "appendfsync", "everysec").Err(); err != nil {
			t.Fatal(err)
		}
		d = must(s.Durability(ctx))(t)
		if d.Safe() || d.Fsync != "everysec" || !strings.Contains(d.Describe(), "1s") {
			t.Fatalf("everysec reported as %+v: %q", d, d.Describe())
		}
	})
	t.Run("off", func(t *testing.T) {
		srv := redisserver.Start(t, redisserver.Options{})
		s := open(t, srv.URL(), redisstore.Options{})
		d := must(s.Durability(ctx))(t)
		if d.Safe() || d.AOF || !d.Known {
			t.Fatalf("AOF off reported as %+v", d)
		}
		if !strings.Contains(d.Describe(), "NOT durable") || !strings.Contains(d.Describe(), "AOF off") {
			t.Fatalf("describe: %q", d.Describe())
		}
	})
	t.Run("config refused", func(t *testing.T) {
		// Managed services refuse CONFIG: the report says unknown, not an error.
		srv := redisserver.Start(t, redisserver.Options{AppendFsyncAlways: true})
		admin := raw(t, srv.Addr())
		if err := admin.Do(ctx, "ACL", "SETUSER", "app", "on", ">secret", "~*", "&*", "+@all", "-config").Err(); err != nil {
			t.Fatal(err)
		}
		s := open(t, "redis://app:secret@"+srv.Addr()+"/0", redisstore.Options{})
		d := must(s.Durability(ctx))(t)
		if d.Known || d.Safe() || !strings.Contains(d.Describe(), "unknown") {
			t.Fatalf("refused CONFIG reported as %+v: %q", d, d.Describe())
		}
	})
}

// Every key of a run carries {RUN}, so each script's keys hash to one slot
// and it runs on Redis Cluster.
func TestKeysShareHashTag(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	s := open(t, srv.URL(), redisstore.Options{})
	ctx := tctx(t)
	const run = "walk-1:a.b_c"

	must(s.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "test"}))(t)
	must(s.Guard(ctx, guardReq(run, "k1")))(t)
	derived := guardReq(run, "base")
	derived.ExplicitKey = false
	must(s.Guard(ctx, derived))(t)
	must(s.Guard(ctx, derived))(t) // a base used twice keeps a counter
	retry := guardReq(run, "retry:s1:2")
	retry.NotBefore = time.Now().Add(time.Hour)
	must(s.Guard(ctx, retry))(t)
	must(s.Cancel(ctx, state.CancelRequest{RunID: run, Actor: "op", DrainTimeout: time.Minute}))(t)
	must(s.Tick(ctx, state.TickRequest{RunID: run, Actor: "sweeper:test"}))(t)

	var keys []string
	it := raw(t, srv.Addr()).Scan(ctx, 0, "*", 100).Iterator()
	for it.Next(ctx) {
		keys = append(keys, it.Val())
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	var ofRun int
	for _, k := range keys {
		// The totals of a single Redis are one hash; a Cluster keeps one
		// in each slot, in the call's (TestCluster).
		if hashTag(k) == "index" || k == "sg:{marker}" || k == "sg:totals" {
			continue
		}
		if hashTag(k) != run {
			t.Errorf("key %q does not carry the hash tag {%s}", k, run)
		}
		ofRun++
	}
	if ofRun < 4 {
		t.Fatalf("only %d keys of the run after the walk: %v", ofRun, keys)
	}
	for _, k := range redisstore.KeysOf(run) {
		if got, want := slot(k), slot(redisstore.KeysOf(run)[0]); got != want {
			t.Errorf("script key %q is in slot %d, the run row in %d", k, got, want)
		}
	}
	for _, k := range redisstore.IndexKeys {
		if slot(k) != slot(redisstore.IndexKeys[0]) {
			t.Errorf("index keys %v are in different slots", redisstore.IndexKeys)
		}
	}
}

// hashTag is the part of a key Redis Cluster hashes: the text between the
// first { and the next }, when not empty.
func hashTag(key string) string {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			return key[i+1 : i+1+j]
		}
	}
	return key
}

// slot is the Redis Cluster slot of a key: CRC16 (XMODEM) of its hash tag.
func slot(key string) int {
	var crc uint16
	for _, b := range []byte(hashTag(key)) {
		crc ^= uint16(b) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return int(crc) % 16384
}

func TestSlotMatchesRedis(t *testing.T) {
	// Known values from the Redis Cluster specification.
	for key, want := range map[string]int{"123456789": 12739, "{user1000}.following": slot("user1000"), "foo": 12182} {
		if got := slot(key); got != want {
			t.Errorf("slot(%q) = %d, want %d", key, got, want)
		}
	}
}

// Index entries are written before rows: an entry whose row never came (the
// process died in between) is skipped by readers, kept while young (its row
// may be on the way) and dropped once old.
func TestIndexSkipsAndDropsRowlessEntries(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	s := open(t, srv.URL(), redisstore.Options{})
	admin := raw(t, srv.Addr())
	ctx := tctx(t)

	must(s.Admit(ctx, state.AdmitRequest{RunID: "real", Actor: "test"}))(t)
	now := time.Now().UnixMilli()
	old := float64(now - redisstore.PruneGrace.Milliseconds() - 60_000)
	for _, k := range redisstore.IndexKeys {
		must(admin.ZAdd(ctx, k, redis.Z{Score: float64(now), Member: "young"}, redis.Z{Score: old, Member: "orphan"}).Result())(t)
	}
	// The active set reads in id order: its scores are all zero.
	must(admin.ZAdd(ctx, redisstore.IndexKeys[1], redis.Z{Score: 0, Member: "young"}, redis.Z{Score: 0, Member: "orphan"}).Result())(t)
	rs := must(s.List(ctx, ""))(t)
	if len(rs) != 1 || rs[0].ID != "real" {
		t.Fatalf("list with rowless index entries: %+v", rs)
	}
	if active := must(s.ActiveRuns(ctx, "", 10))(t); !slices.Equal(active, []string{"real"}) {
		t.Fatalf("active runs with rowless index entries: %v", active)
	}
	if draining := must(s.DrainingRuns(ctx))(t); len(draining) != 0 {
		t.Fatalf("draining runs with rowless index entries: %v", draining)
	}
	for _, k := range redisstore.IndexKeys {
		members := must(admin.ZRange(ctx, k, 0, -1).Result())(t)
		slices.Sort(members)
		want := []string{"young"}
		if k == redisstore.IndexKeys[0] || k == redisstore.IndexKeys[1] {
			want = []string{"real", "young"}
		}
		if !slices.Equal(members, want) {
			t.Fatalf("%s after dropping: %v, want %v (the old orphan gone, the young entry kept)", k, members, want)
		}
	}

	// A run that leaves ACTIVE leaves the active set as it is read; a
	// final one leaves the draining set; the all-runs index keeps both.
	must(s.Admit(ctx, state.AdmitRequest{RunID: "stopped", Actor: "test"}))(t)
	must(s.Cancel(ctx, state.CancelRequest{RunID: "stopped", Actor: "op"}))(t)
	must(s.Complete(ctx, state.CompleteRequest{RunID: "real", Version: 1, Actor: "w"}))(t)
	if active := must(s.ActiveRuns(ctx, "", 10))(t); len(active) != 0 {
		t.Fatalf("active runs after completion and cancel: %v", active)
	}
	must(s.Tick(ctx, state.TickRequest{RunID: "stopped", Actor: "sweeper"}))(t)
	if draining := must(s.DrainingRuns(ctx))(t); len(draining) != 0 {
		t.Fatalf("draining runs after the drain: %v", draining)
	}
	for _, id := range []string{"real", "stopped"} {
		for i, k := range redisstore.IndexKeys[1:3] {
			if err := admin.ZScore(ctx, k, id).Err(); !errors.Is(err, redis.Nil) {
				t.Fatalf("final run %s still in index %d (%v)", id, i+1, err)
			}
		}
		if err := admin.ZScore(ctx, redisstore.IndexKeys[0], id).Err(); err != nil {
			t.Fatalf("final run %s left the all-runs index: %v", id, err)
		}
	}
}

// A store written by the layout before this one kept one live set. Open
// folds it in: its runs are found again as active or draining, and every
// run ever indexed is a candidate for retention.
func TestOpenFoldsTheOldLiveSetIn(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	admin := raw(t, srv.Addr())
	ctx := tctx(t)
	s := open(t, srv.URL(), redisstore.Options{})
	must(s.Admit(ctx, state.AdmitRequest{RunID: "a", Actor: "t"}))(t)
	must(s.Admit(ctx, state.AdmitRequest{RunID: "c", Actor: "t"}))(t)
	must(s.Cancel(ctx, state.CancelRequest{RunID: "c", Actor: "op", DrainTimeout: time.Minute}))(t)
	must(s.Admit(ctx, state.AdmitRequest{RunID: "f", Actor: "t"}))(t)
	must(s.Complete(ctx, state.CompleteRequest{RunID: "f", Version: 1, Actor: "w"}))(t)
	// Back to the old layout: only the all-runs index and the live set.
	now := float64(time.Now().UnixMilli())
	must(admin.Del(ctx, append(redisstore.IndexKeys[1:], "sg:{index}:layout")...).Result())(t)
	must(admin.ZAdd(ctx, redisstore.LegacyLiveKey, redis.Z{Score: now, Member: "a"}, redis.Z{Score: now, Member: "c"}).Result())(t)

	s2 := open(t, srv.URL(), redisstore.Options{})
	if active := must(s2.ActiveRuns(ctx, "", 10))(t); !slices.Equal(active, []string{"a"}) {
		t.Fatalf("active runs after the fold: %v", active)
	}
	if draining := must(s2.DrainingRuns(ctx))(t); !slices.Equal(draining, []string{"c"}) {
		t.Fatalf("draining runs after the fold: %v", draining)
	}
	if n := must(admin.Exists(ctx, redisstore.LegacyLiveKey).Result())(t); n != 0 {
		t.Fatal("the old live set is still there after the fold")
	}
	if n := must(s2.Prune(ctx, state.PruneRequest{FinalBefore: time.Now().Add(time.Second), Limit: 10}))(t); n != 1 {
		t.Fatalf("prune after the fold pruned %d runs, want the completed one", n)
	}
}

func TestOpenRejectsBadURLs(t *testing.T) {
	for _, tc := range []struct{ url, want string }{
		{"localhost:6379", "no scheme"},
		{"http://localhost:6379", "unknown scheme"},
		{"redis-sentinel://h1:26379,h2:26379/0", "master"},
		{"redis-sentinel://h1:26379/0?master=m&foo=1", "unexpected option: foo"},
		{"redis-sentinel://h1:26379/0?master=m&addr=h2:26379", `unknown parameter "addr"`},
		{"redis-sentinel://h1:26379/0?master=m&replica_only=true", "replicas"},
		{"redis-cluster://h1:7000?read_only=true", "replicas"},
		{"redis-cluster://:hunter2@h1:7000?password=x", `unknown parameter "password"`},
		{"unix:///tmp/redis.sock", "unknown scheme"},
		{"redis-sentinel://:hunter2@h1/0?master=m", "want host:port"},
		{"redis-cluster://h1:7000,h2:notaport", "port"},
		{"redis-cluster://h1:7000/3", "only database 0"},
		{"redis-cluster://", "no cluster node address"},
		{"redis-sentinel://h1:26379/x?master=m", "database"},
		{"redis://localhost:6379/notadb", "database"},
	} {
		_, err := redisstore.Open(tctx(t), tc.url, redisstore.Options{})
		if !errors.Is(err, state.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("open %q: got %v, want ErrInvalid mentioning %q", tc.url, err, tc.want)
		}
		if err != nil && strings.Contains(err.Error(), "hunter2") {
			t.Errorf("open %q: the error shows the password: %v", tc.url, err)
		}
	}
}

// BenchmarkGuard measures the hot path: an admitted guard on an ACTIVE run,
// each with a new explicit key (one script, one round trip).
func BenchmarkGuard(b *testing.B) {
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"aof=off", []string{"--appendonly", "no"}},
		{"aof=always", []string{"--appendonly", "yes", "--appendfsync", "always"}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			srv := redisserver.Start(b, redisserver.Options{Args: tc.args})
			s := open(b, srv.URL(), redisstore.Options{})
			ctx := context.Background()
			must(s.Admit(ctx, state.AdmitRequest{RunID: "bench", Actor: "bench"}))(b)
			b.ResetTimer()
			for i := range b.N {
				res, err := s.Guard(ctx, guardReq("bench", fmt.Sprintf("k%d", i)))
				if err != nil || !res.Admitted {
					b.Fatalf("guard %d: %+v %v", i, res, err)
				}
			}
		})
	}
}

// A run written by the layout before this one (row without an ordinal
// counter, intents as JSON in a hash of their own, events with a field
// 'at') reads as it did, and the first step on it moves its intents into
// the run's hash: an IN_FLIGHT intent of it can still be finished.
func TestRunOfTheOldLayoutReadsAndMovesOn(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	s := open(t, srv.URL(), redisstore.Options{})
	admin := raw(t, srv.Addr())
	ctx := tctx(t)
	k := redisstore.KeysOf("old")
	now := time.Now().UnixMilli()
	ts := strconv.FormatInt(now, 10)
	must(admin.HSet(ctx, k[0], "status", "ACTIVE", "v", "1", "created", ts, "updated", ts, "t", ts,
		"n:IN_FLIGHT", "1", "n:RESPONDED", "1").Result())(t)
	must(admin.HSet(ctx, k[1],
		"done", `{"key":"done","boundary":"http","state":"RESPONDED","method":"GET","target":"https://a/x","status_code":200,"attempts":1,"refusals":0,"observed_version":"1","created_at":`+ts+`,"updated_at":`+ts+`,"ord":1}`,
		"open", `{"key":"open","boundary":"http","state":"IN_FLIGHT","method":"POST","target":"https://a/y","body_digest":"d","attempts":1,"refusals":0,"observed_version":"1","lease_owner":"p","lease_expires":`+strconv.FormatInt(now+60_000, 10)+`,"created_at":`+ts+`,"updated_at":`+ts+`,"ord":2}`,
	).Result())(t)
	must(admin.RPush(ctx, k[2], "done", "open").Result())(t)
	must(admin.ZAdd(ctx, k[4], redis.Z{Score: float64(now + 60_000), Member: "open"}).Result())(t)
	must(admin.XAdd(ctx, &redis.XAddArgs{Stream: k[6], Values: []any{"at", ts, "actor", "p", "kind", state.EventRunAdmitted, "v", "1"}}).Result())(t)

	check := func(when string) {
		t.Helper()
		ins := must(s.Intents(ctx, "old"))(t)
		if len(ins) != 2 || ins[0].Key != "done" || ins[0].StatusCode != 200 || ins[1].Key != "open" || ins[1].BodyDigest != "d" {
			t.Fatalf("intents of the old run %s: %+v", when, ins)
		}
		if in := must(s.Intent(ctx, "old", "done"))(t); in.State != state.IntentResponded || in.Target != "https://a/x" {
			t.Fatalf("intent done of the old run %s: %+v", when, in)
		}
	}
	check("before any step")
	evs := must(s.Events(ctx, "old"))(t)
	if len(evs) != 1 || evs[0].At.UnixMilli() != now {
		t.Fatalf("events of the old run: %+v", evs)
	}
	out, err := s.Finish(ctx, state.FinishRequest{RunID: "old", Key: "open", Attempt: 1, Outcome: state.IntentResponded, StatusCode: 201, Actor: "p"})
	if err != nil || out.State != state.IntentResponded || out.Target != "https://a/y" {
		t.Fatalf("finish of the old run's open intent: %+v %v", out, err)
	}
	if n := must(admin.Exists(ctx, k[1], k[2]).Result())(t); n != 0 {
		t.Fatalf("the old intents hash and order list are still there after a step")
	}
	check("after its first step")
	g := must(s.Guard(ctx, guardReq("old", "third")))(t)
	ins := must(s.Intents(ctx, "old"))(t)
	if !g.Admitted || len(ins) != 3 || ins[2].Key != "third" {
		t.Fatalf("a new intent of the moved run comes after the old ones: %+v", ins)
	}
	wantRow := must(s.Get(ctx, "old"))(t)
	if wantRow.Intents[state.IntentResponded] != 2 || wantRow.Intents[state.IntentInFlight] != 1 {
		t.Fatalf("counts of the moved run: %+v", wantRow.Intents)
	}
}

// A cancel that ends a run at once (nothing to drain) takes the run out of
// the draining set itself; a set that holds many final runs anyway (left
// by cancels that ran before this rule) is walked a page at a time and
// emptied of them, while the runs still draining among them are listed.
func TestDrainingSetKeepsOnlyDrainingRuns(t *testing.T) {
	srv := redisserver.Start(t, redisserver.Options{})
	s := open(t, srv.URL(), redisstore.Options{})
	admin := raw(t, srv.Addr())
	ctx := tctx(t)
	draining := redisstore.IndexKeys[2]

	must(s.Cancel(ctx, state.CancelRequest{RunID: "ghost", Actor: "op"}))(t)
	if err := admin.ZScore(ctx, draining, "ghost").Err(); !errors.Is(err, redis.Nil) {
		t.Fatalf("a run cancelled straight to CANCELLED stayed in the draining set (%v)", err)
	}

	// Two runs drain: each holds an effect in flight.
	for _, id := range []string{"busy-a", "busy-b"} {
		must(s.Admit(ctx, state.AdmitRequest{RunID: id, Actor: "test"}))(t)
		must(s.Guard(ctx, state.GuardRequest{RunID: id, Key: "k", Boundary: state.BoundaryHTTP, Method: "POST",
			Target: "https://x/", LeaseOwner: "w", LeaseTTL: time.Minute, Actor: "w"}))(t)
		must(s.Cancel(ctx, state.CancelRequest{RunID: id, Actor: "op", DrainTimeout: time.Hour}))(t)
	}
	// A backlog of final runs, several pages of it, as older cancels left it.
	const backlog = 2500
	pipe := admin.Pipeline()
	for i := range backlog {
		id := fmt.Sprintf("old-%05d", i)
		pipe.HSet(ctx, redisstore.KeysOf(id)[0], "status", string(state.StatusCancelled), "v", "2", "o", "0")
		pipe.ZAdd(ctx, draining, redis.Z{Score: float64(time.Now().UnixMilli()), Member: id})
	}
	must(pipe.Exec(ctx))(t)

	got := must(s.DrainingRuns(ctx))(t)
	if !slices.Equal(got, []string{"busy-a", "busy-b"}) {
		t.Fatalf("draining runs among a backlog of final ones: %v", got)
	}
	if n := must(admin.ZCard(ctx, draining).Result())(t); n != 2 {
		t.Fatalf("the draining set holds %d entries after one walk, want the 2 runs still draining", n)
	}
}
