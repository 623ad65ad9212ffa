package redisstore_test

import (
	"context"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
	"github.com/stopgate/stopgate/state/statetest"
)

// TestCluster runs the store on a one-node Redis Cluster that owns every
// slot, behind a relay that can lose replies: the cluster client routes each
// script by its first key, retries differently from the plain client, and
// the server refuses a script whose KEYS span slots (CROSSSLOT) as a real
// cluster does. The conformance suite runs on three masters
// (TestClusterOfThreeMasters); failover is TestCancelReplicas*'s.
func TestCluster(t *testing.T) {
	// The node announces the cutter's port, so every connection the cluster
	// client makes goes through it.
	cut := newCutter(t)
	srv := redisserver.Start(t, redisserver.Options{Args: []string{"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
		"--cluster-announce-ip", "127.0.0.1", "--cluster-announce-port", strconv.Itoa(cut.port())}})
	cut.forwardTo(srv.Addr())
	admin := raw(t, srv.Addr())
	ctx := tctx(t)
	if err := admin.Do(ctx, "CLUSTER", "ADDSLOTSRANGE", "0", "16383").Err(); err != nil {
		t.Fatalf("cluster addslotsrange: %v", err)
	}
	// A new master waits about 2s before it calls the cluster ok.
	deadline := time.Now().Add(10 * time.Second)
	for {
		info, err := admin.ClusterInfo(ctx).Result()
		if err == nil && strings.Contains(info, "cluster_state:ok") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("one-node cluster not ok within 10s: %v %s", err, info)
		}
		time.Sleep(50 * time.Millisecond)
	}
	url := "redis-cluster://" + cut.addr()

	t.Run("ScriptsStayInOneSlot", func(t *testing.T) {
		// First, that this node does check: KEYS in two slots are refused.
		err := admin.Eval(ctx, "return 1", []string{"sg:{a}:run", "sg:{b}:run"}).Err()
		if err == nil || !strings.Contains(err.Error(), "CROSSSLOT") {
			t.Fatalf("a cross-slot script on the cluster node: %v, want CROSSSLOT", err)
		}
		if err := admin.FlushAll(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		s := open(t, url, redisstore.Options{})
		must(s.Admit(ctx, state.AdmitRequest{RunID: "c1", Actor: "t"}))(t)
		must(s.Guard(ctx, guardReq("c1", "k")))(t)
		must(s.Cancel(ctx, state.CancelRequest{RunID: "c1", Actor: "op"}))(t)
		if r := must(s.Tick(ctx, state.TickRequest{RunID: "c1", Actor: "f"}))(t); r.Status != state.StatusUnknown {
			t.Fatalf("run after the walk on a cluster: %+v", r)
		}
		if draining := must(s.DrainingRuns(ctx))(t); len(draining) != 1 || draining[0] != "c1" {
			t.Fatalf("draining runs on a cluster: %v", draining)
		}
		if d := must(s.Durability(ctx))(t); !d.Known || d.AOF {
			t.Fatalf("durability of the cluster: %+v", d)
		}
	})

	t.Run("GuardsOfManyRunsAtOnceStayInOneSlotEach", func(t *testing.T) {
		// On one Redis a call carries the steps of every run queued; on a
		// cluster it must carry one run's, or the node refuses it.
		s := open(t, url, redisstore.Options{})
		const runs = 16
		for i := range runs {
			must(s.Admit(ctx, state.AdmitRequest{RunID: "many-" + strconv.Itoa(i), Actor: "t"}))(t)
		}
		start := make(chan struct{})
		errs := make(chan error, runs)
		for i := range runs {
			go func() {
				<-start
				_, err := s.Guard(ctx, guardReq("many-"+strconv.Itoa(i), "k"))
				errs <- err
			}()
		}
		close(start)
		for range runs {
			if err := <-errs; err != nil {
				t.Fatalf("a guard of one of %d runs at once on a cluster: %v", runs, err)
			}
		}
	})

	t.Run("TotalsAreKeptInEachRunsSlot", func(t *testing.T) {
		// Each call keeps its totals in a hash of its run's slot (the
		// node refuses any other); reading them sums every slot's.
		if err := admin.FlushAll(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		s := open(t, url, redisstore.Options{})
		statetest.SomeRuns(t, s)
		got, err := s.Totals(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if want := statetest.TotalsOfRows(t, s, nil); !reflect.DeepEqual(got, want) || got.UnknownIntents != 2 {
			t.Fatalf("totals on a cluster %+v, want (from the rows) %+v", got, want)
		}
		hashes := must(admin.Keys(ctx, "sg:{~*}:totals").Result())(t)
		if len(hashes) < 2 {
			t.Fatalf("the totals of five runs are in %d slots' hashes (%v); want one in each run's slot", len(hashes), hashes)
		}
	})

	t.Run("LostReplyIsNotRetried", func(t *testing.T) {
		// The cluster client retries a command whose reply was lost unless
		// the command says NoRetry: this is the case that needs it.
		checkLostReply(t, open(t, url, redisstore.Options{}), cut)
	})
}

// TestSentinel runs the suite through a Sentinel that watches one master:
// the failover client asks the Sentinel for the master and talks to it.
// No failover is exercised.
func TestSentinel(t *testing.T) {
	master := redisserver.Start(t, redisserver.Options{})
	host, port, _ := strings.Cut(master.Addr(), ":")
	sentinel := redisserver.Start(t, redisserver.Options{Conf: "sentinel monitor stopgate " + host + " " + port + " 1\n", Sentinel: true})
	admin := raw(t, master.Addr())
	url := "redis-sentinel://" + sentinel.Addr() + "/0?master=stopgate"
	statetest.Run(t, func(t *testing.T) state.Store {
		if err := admin.FlushAll(context.Background()).Err(); err != nil {
			t.Fatalf("flushall: %v", err)
		}
		return open(t, url, redisstore.Options{})
	})
	// The probe of who may read the store asks the master the Sentinel names.
	x := must(open(t, url, redisstore.Options{}).Exposure(tctx(t)))(t)
	if x.Auth != redisstore.AuthOpen || !strings.Contains(x.AuthDetail, master.Addr()) {
		t.Fatalf("exposure through the Sentinel: %+v, want the master %s, open", x, master.Addr())
	}
}
