package redisserver

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// ClusterOptions shape a Cluster.
type ClusterOptions struct {
	// Masters is how many masters share the 16384 slots; 3 when zero, the
	// fewest redis-cli --cluster create accepts.
	Masters int
	// AppendFsyncAlways turns the AOF on with fsync on every write on
	// every node.
	AppendFsyncAlways bool
}

// Cluster is a Redis Cluster of masters on loopback, made the way an
// operator makes one: nodes started with --cluster-enabled, then joined and
// given slots by redis-cli --cluster create.
type Cluster struct {
	t testing.TB
	// Nodes are the masters, in the order redis-cli was given them.
	Nodes []*Server
}

// StartCluster starts the nodes, creates the cluster and waits until every
// node says cluster_state:ok and sees every slot served. The nodes are
// killed when the test ends.
func StartCluster(t testing.TB, opts ClusterOptions) *Cluster {
	t.Helper()
	if opts.Masters == 0 {
		opts.Masters = 3
	}
	if opts.Masters < 3 {
		t.Fatalf("redisserver: a cluster needs at least 3 masters, got %d", opts.Masters)
	}
	if _, err := exec.LookPath("redis-cli"); err != nil {
		t.Fatalf("redis-cli not found on PATH: install it with `apt-get install -y redis-tools` (redis-server depends on it)")
	}
	c := &Cluster{t: t}
	var addrs []string
	for range opts.Masters {
		// The cluster bus port is given explicitly: the default (port +
		// 10000) may be taken or past 65535 for a random free port.
		bus, err := FreePort()
		if err != nil {
			t.Fatal(err)
		}
		s := Start(t, Options{AppendFsyncAlways: opts.AppendFsyncAlways, Args: []string{
			"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			"--cluster-port", fmt.Sprint(bus), "--cluster-node-timeout", "2000",
		}})
		c.Nodes = append(c.Nodes, s)
		addrs = append(addrs, s.Addr())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	args := append(append([]string{"--cluster", "create"}, addrs...), "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.CommandContext(ctx, "redis-cli", args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	c.waitOK(ctx)
	return c
}

// waitOK waits until every node reports the cluster ok with all slots
// assigned and every node known.
func (c *Cluster) waitOK(ctx context.Context) {
	c.t.Helper()
	var last string
	for {
		ok := true
		for _, n := range c.Nodes {
			info, err := c.client(n).ClusterInfo(ctx).Result()
			if err != nil || !strings.Contains(info, "cluster_state:ok") ||
				!strings.Contains(info, "cluster_slots_ok:16384") ||
				!strings.Contains(info, fmt.Sprintf("cluster_known_nodes:%d", len(c.Nodes))) {
				ok = false
				last = fmt.Sprintf("%s: %v %s", n.Addr(), err, info)
				break
			}
		}
		if ok {
			return
		}
		select {
		case <-ctx.Done():
			c.t.Fatalf("redisserver: cluster not ok in time; last answer: %s", last)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (c *Cluster) client(n *Server) *redis.Client {
	cl := redis.NewClient(&redis.Options{Addr: n.Addr(), MaxRetries: -1})
	c.t.Cleanup(func() { _ = cl.Close() })
	return cl
}

// URL is the redis-cluster:// URL naming every node.
func (c *Cluster) URL() string {
	var addrs []string
	for _, n := range c.Nodes {
		addrs = append(addrs, n.Addr())
	}
	return "redis-cluster://" + strings.Join(addrs, ",")
}

// FlushAll empties every master.
func (c *Cluster) FlushAll(ctx context.Context) error {
	for _, n := range c.Nodes {
		cl := redis.NewClient(&redis.Options{Addr: n.Addr(), MaxRetries: -1})
		err := cl.FlushAll(ctx).Err()
		_ = cl.Close()
		if err != nil {
			return fmt.Errorf("flushall on %s: %w", n.Addr(), err)
		}
	}
	return nil
}

// NodeOf is the master that serves key's slot now.
func (c *Cluster) NodeOf(ctx context.Context, key string) (*Server, error) {
	slot, err := c.client(c.Nodes[0]).ClusterKeySlot(ctx, key).Result()
	if err != nil {
		return nil, fmt.Errorf("cluster keyslot %q: %w", key, err)
	}
	slots, err := c.client(c.Nodes[0]).ClusterSlots(ctx).Result()
	if err != nil {
		return nil, fmt.Errorf("cluster slots: %w", err)
	}
	for _, r := range slots {
		if int64(r.Start) <= slot && slot <= int64(r.End) && len(r.Nodes) > 0 {
			for _, n := range c.Nodes {
				if n.Addr() == r.Nodes[0].Addr {
					return n, nil
				}
			}
		}
	}
	return nil, fmt.Errorf("no node serves slot %d of %q", slot, key)
}
