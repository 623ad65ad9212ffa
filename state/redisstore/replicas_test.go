package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/faultnet"
	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
	"github.com/stopgate/stopgate/state/statetest"
)

// TestClusterOfThreeMasters runs the conformance suite on a Redis Cluster of
// three masters made by redis-cli --cluster create: each run's keys live on
// the master of its hash tag's slot, the cross-run index on another, and
// cancels published on one master reach subscribers connected to any.
func TestClusterOfThreeMasters(t *testing.T) {
	cluster := redisserver.StartCluster(t, redisserver.ClusterOptions{Masters: 3})
	t.Run("Conformance", func(t *testing.T) {
		statetest.Run(t, func(t *testing.T) state.Store {
			if err := cluster.FlushAll(context.Background()); err != nil {
				t.Fatal(err)
			}
			return open(t, cluster.URL(), redisstore.Options{})
		})
	})

	t.Run("RunsSpreadOverEveryMasterAndTheirCancelsReachEveryone", func(t *testing.T) {
		ctx := tctx(t)
		s := open(t, cluster.URL(), redisstore.Options{})
		// A second store stands for another stopgate instance.
		other := open(t, cluster.URL(), redisstore.Options{})
		sub, stop := context.WithCancel(ctx)
		defer stop()
		cancels, err := other.Cancels(sub)
		if err != nil {
			t.Fatal(err)
		}
		// One run per master, found by asking the cluster where its row lives.
		byNode := map[string]string{}
		for i := 0; len(byNode) < len(cluster.Nodes) && i < 200; i++ {
			run := fmt.Sprintf("spread-%d", i)
			n, err := cluster.NodeOf(ctx, redisstore.KeysOf(run)[0])
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := byNode[n.Addr()]; !ok {
				byNode[n.Addr()] = run
			}
		}
		if len(byNode) != len(cluster.Nodes) {
			t.Fatalf("found runs on %d masters, want %d", len(byNode), len(cluster.Nodes))
		}
		for node, run := range byNode {
			must(s.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "t"}))(t)
			if g := must(s.Guard(ctx, guardReq(run, "k1")))(t); !g.Admitted {
				t.Fatalf("guard of %s on %s: %+v", run, node, g)
			}
			must(s.Cancel(ctx, state.CancelRequest{RunID: run, Actor: "op", Reason: "spread"}))(t)
			select {
			case got := <-cancels:
				if got != run {
					t.Fatalf("cancel of %s (on %s) announced as %q", run, node, got)
				}
			case <-time.After(5 * time.Second):
				t.Fatalf("the cancel of %s, on master %s, did not reach the other store's subscription", run, node)
			}
			if g := must(other.Guard(ctx, guardReq(run, "k2")))(t); g.Admitted || g.Refusal != state.RefusalRunNotActive {
				t.Fatalf("guard of %s through the other store after the cancel: %+v", run, g)
			}
		}
	})

	t.Run("ExposureAsksEveryMaster", func(t *testing.T) {
		ctx := tctx(t)
		s := open(t, cluster.URL(), redisstore.Options{})
		if x := must(s.Exposure(ctx))(t); x.Auth != redisstore.AuthOpen || x.Eviction != "noeviction" {
			t.Fatalf("exposure of the cluster: %+v", x)
		}
		// One master of three evicts: the cluster does.
		last := raw(t, cluster.Nodes[2].Addr())
		if err := last.ConfigSet(ctx, "maxmemory-policy", "volatile-lru").Err(); err != nil {
			t.Fatal(err)
		}
		defer last.ConfigSet(ctx, "maxmemory-policy", "noeviction")
		if x := must(s.Exposure(ctx))(t); x.Eviction != "volatile-lru" {
			t.Fatalf("exposure of a cluster with one evicting master: %+v", x)
		}
	})
}

// replicated is a primary with one replica linked through a relay (so the
// test can cut replication), watched by a Sentinel.
type replicated struct {
	primary  *redisserver.Server
	replica  *redisserver.Server
	link     *faultnet.Relay
	sentinel *redisserver.Sentinel
}

func startReplicated(t *testing.T, withSentinel bool) *replicated {
	t.Helper()
	ctx := tctx(t)
	primary := redisserver.Start(t, redisserver.Options{AppendFsyncAlways: true})
	link, err := faultnet.Listen(primary.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = link.Close() })
	replica := redisserver.StartReplica(t, link.Addr(), redisserver.Options{AppendFsyncAlways: true})
	replica.WaitSynced(ctx)
	r := &replicated{primary: primary, replica: replica, link: link}
	if withSentinel {
		// Started after the replica is linked: its first look at the
		// primary finds the replica, rather than ten seconds later.
		r.sentinel = redisserver.StartSentinel(t, primary.Addr(), redisserver.SentinelOptions{DownAfter: time.Second})
		r.sentinel.WaitReplicas(ctx, 1)
	}
	return r
}

// failover kills the primary with -9 and waits until Sentinel has promoted
// the replica.
func (r *replicated) failover(t *testing.T) {
	t.Helper()
	r.primary.Kill()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if got := r.sentinel.WaitFailover(ctx, r.primary.Addr()); got != r.replica.Addr() {
		t.Fatalf("sentinel promoted %s, want the replica %s", got, r.replica.Addr())
	}
}

// TestCancelReplicasSurvivesFailover: with CancelReplicas 1 an acknowledged
// cancel is on the replica before the operator hears of it, so killing the
// primary and promoting the replica keeps it.
func TestCancelReplicasSurvivesFailover(t *testing.T) {
	r := startReplicated(t, true)
	ctx := tctx(t)
	s := open(t, r.sentinel.URL(), redisstore.Options{CancelReplicas: 1, OpTimeout: time.Second})
	must(s.Admit(ctx, state.AdmitRequest{RunID: "fo", Actor: "t"}))(t)
	must(s.Guard(ctx, guardReq("fo", "k1")))(t)
	res := must(s.Cancel(ctx, state.CancelRequest{RunID: "fo", Actor: "operator:alice", Reason: "stop before failover"}))(t)
	if !res.Changed || res.Run.CancelVersion != 2 {
		t.Fatalf("cancel: %+v", res)
	}
	r.failover(t)

	after := open(t, r.sentinel.URL(), redisstore.Options{})
	row := must(after.Get(ctx, "fo"))(t)
	if row.Status != state.StatusCancelling || row.CancelVersion != 2 || row.Reason != "stop before failover" {
		t.Fatalf("after the failover the run is %s/%d (%q), want CANCELLING/2", row.Status, row.CancelVersion, row.Reason)
	}
	if g := must(after.Guard(ctx, guardReq("fo", "k2")))(t); g.Admitted || g.Refusal != state.RefusalRunNotActive {
		t.Fatalf("guard on the promoted replica: %+v", g)
	}
}

// TestCancelReplicasRefusesToAcknowledgeUnreplicatedCancel: when no replica
// confirms the cancel in time, the caller gets ErrUnavailable and not an
// acknowledgement, although the cancel is committed on the primary (and
// refuses effects there). Once the replica is back, cancelling again
// changes nothing and is acknowledged.
func TestCancelReplicasRefusesToAcknowledgeUnreplicatedCancel(t *testing.T) {
	r := startReplicated(t, false)
	ctx := tctx(t)
	s := open(t, r.primary.URL(), redisstore.Options{CancelReplicas: 1, OpTimeout: 500 * time.Millisecond})
	must(s.Admit(ctx, state.AdmitRequest{RunID: "nr", Actor: "t"}))(t)

	r.link.Partition()
	_, err := s.Cancel(ctx, state.CancelRequest{RunID: "nr", Actor: "op", Reason: "no replica"})
	if !errors.Is(err, state.ErrUnavailable) {
		t.Fatalf("cancel that no replica confirmed: %v, want ErrUnavailable", err)
	}
	t.Logf("what the caller is told: %v", err)
	if row := must(s.Get(ctx, "nr"))(t); row.Status != state.StatusCancelling || row.CancelVersion != 2 {
		t.Fatalf("on the primary the unconfirmed cancel left %s/%d, want CANCELLING/2", row.Status, row.CancelVersion)
	}
	if g := must(s.Guard(ctx, guardReq("nr", "k")))(t); g.Admitted {
		t.Fatalf("the primary admitted an effect after the unconfirmed cancel: %+v", g)
	}
	// Cancelling again, here through another instance, changes nothing on
	// the primary and is still not acknowledged while the replica lacks the
	// cancel: the retry must wait for the cancel it repeats, not for the
	// nothing its own connection wrote.
	other := open(t, r.primary.URL(), redisstore.Options{CancelReplicas: 1, OpTimeout: 500 * time.Millisecond})
	for i := range 3 {
		if _, err := other.Cancel(ctx, state.CancelRequest{RunID: "nr", Actor: "op", Reason: "no replica"}); !errors.Is(err, state.ErrUnavailable) {
			t.Fatalf("repeated cancel %d with the replica still cut off: %v, want ErrUnavailable", i, err)
		}
	}

	// The replica comes back: it reconnects and catches up.
	r.link.Heal()
	r.link.CutAll()
	r.replica.WaitSynced(ctx)
	again := must(s.Cancel(ctx, state.CancelRequest{RunID: "nr", Actor: "op", Reason: "no replica"}))(t)
	if again.Changed || again.Run.CancelVersion != 2 {
		t.Fatalf("the confirming cancel: %+v, want unchanged at version 2", again)
	}
	evs := must(s.Events(ctx, "nr"))(t)
	cancels := 0
	for _, e := range evs {
		if e.Kind == state.EventRunCancelled {
			cancels++
		}
	}
	if cancels != 1 {
		t.Fatalf("%d cancel events, want 1: a confirming cancel must not cancel twice", cancels)
	}
}

// TestFailoverWithoutCancelReplicasCanLoseAcknowledgedCancel is what the
// option is for. Replication is asynchronous: with the replica's link cut,
// the primary acknowledges the cancel alone; killed, it takes the cancel
// with it, and the promoted replica has the run ACTIVE again.
func TestFailoverWithoutCancelReplicasCanLoseAcknowledgedCancel(t *testing.T) {
	r := startReplicated(t, true)
	ctx := tctx(t)
	s := open(t, r.sentinel.URL(), redisstore.Options{OpTimeout: time.Second})
	must(s.Admit(ctx, state.AdmitRequest{RunID: "lost", Actor: "t"}))(t)
	// The admission reaches the replica before replication is cut.
	rep := raw(t, r.replica.Addr())
	deadline := time.Now().Add(10 * time.Second)
	for rep.Exists(ctx, redisstore.KeysOf("lost")[0]).Val() != 1 {
		if time.Now().After(deadline) {
			t.Fatal("the admission did not reach the replica within 10s")
		}
		time.Sleep(10 * time.Millisecond)
	}

	r.link.Partition()
	res := must(s.Cancel(ctx, state.CancelRequest{RunID: "lost", Actor: "op", Reason: "acknowledged, not replicated"}))(t)
	if !res.Changed {
		t.Fatalf("cancel: %+v", res)
	}
	r.failover(t)

	after := open(t, r.sentinel.URL(), redisstore.Options{})
	row := must(after.Get(ctx, "lost"))(t)
	if row.Status != state.StatusActive || row.CancelVersion != 1 {
		t.Fatalf("the promoted replica has %s/%d: the cancel reached it after all, and this test no longer shows the loss", row.Status, row.CancelVersion)
	}
	g := must(after.Guard(ctx, guardReq("lost", "k")))(t)
	t.Logf("without CancelReplicas: the acknowledged cancel is gone after the failover: run %s/%d, guard admitted=%v", row.Status, row.CancelVersion, g.Admitted)
}
