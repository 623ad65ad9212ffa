package redisserver

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// StartReplica starts a server that replicates from master (host:port,
// which may be a faultnet relay in front of the real master). opts.Args
// are kept; --replicaof is added.
func StartReplica(t testing.TB, master string, opts Options) *Server {
	t.Helper()
	host, port, err := net.SplitHostPort(master)
	if err != nil {
		t.Fatalf("redisserver: replica of %q: %v", master, err)
	}
	opts.Args = append(append([]string{}, opts.Args...), "--replicaof", host, port)
	return Start(t, opts)
}

// WaitSynced waits until the replica's link to its master is up and the
// first full sync is done.
func (s *Server) WaitSynced(ctx context.Context) {
	s.t.Helper()
	c := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1})
	defer c.Close()
	var last string
	for {
		info, err := c.Info(ctx, "replication").Result()
		if err == nil && strings.Contains(info, "master_link_status:up") && strings.Contains(info, "master_sync_in_progress:0") {
			return
		}
		last = fmt.Sprint(err, info)
		select {
		case <-ctx.Done():
			s.t.Fatalf("redisserver: replica %s not in sync in time: %s", s.Addr(), last)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Role is what INFO replication says the server is: "master" or "slave".
func (s *Server) Role(ctx context.Context) (string, error) {
	c := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1})
	defer c.Close()
	info, err := c.Info(ctx, "replication").Result()
	if err != nil {
		return "", err
	}
	for line := range strings.SplitSeq(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "role:"); ok {
			return v, nil
		}
	}
	return "", fmt.Errorf("INFO replication of %s names no role", s.Addr())
}

// SentinelOptions shape a Sentinel's watch over one master.
type SentinelOptions struct {
	// Name is the master's name in Sentinel; "stopgate" when empty.
	Name string
	// DownAfter is how long the master must not answer before it is
	// failed over; 1s when zero.
	DownAfter time.Duration
	// FailoverTimeout bounds one failover attempt; 5s when zero.
	FailoverTimeout time.Duration
}

// Sentinel is one redis-server --sentinel watching one master with a
// quorum of one: alone, it may fail the master over.
type Sentinel struct {
	*Server
	Name string
}

// StartSentinel starts a Sentinel that watches master (host:port).
func StartSentinel(t testing.TB, master string, opts SentinelOptions) *Sentinel {
	t.Helper()
	if opts.Name == "" {
		opts.Name = "stopgate"
	}
	if opts.DownAfter == 0 {
		opts.DownAfter = time.Second
	}
	if opts.FailoverTimeout == 0 {
		opts.FailoverTimeout = 5 * time.Second
	}
	host, port, err := net.SplitHostPort(master)
	if err != nil {
		t.Fatalf("redisserver: sentinel of %q: %v", master, err)
	}
	conf := fmt.Sprintf("sentinel monitor %[1]s %[2]s %[3]s 1\n"+
		"sentinel down-after-milliseconds %[1]s %[4]d\n"+
		"sentinel failover-timeout %[1]s %[5]d\n"+
		"sentinel parallel-syncs %[1]s 1\n",
		opts.Name, host, port, opts.DownAfter.Milliseconds(), opts.FailoverTimeout.Milliseconds())
	return &Sentinel{Server: Start(t, Options{Sentinel: true, Conf: conf}), Name: opts.Name}
}

// URL is the redis-sentinel:// URL of this Sentinel's master, database 0.
func (s *Sentinel) URL() string {
	return "redis-sentinel://" + s.Addr() + "/0?master=" + s.Name
}

// Master is the address Sentinel gives for the master now.
func (s *Sentinel) Master(ctx context.Context) (string, error) {
	c := redis.NewSentinelClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1})
	defer c.Close()
	hp, err := c.GetMasterAddrByName(ctx, s.Name).Result()
	if err != nil {
		return "", fmt.Errorf("sentinel get-master-addr-by-name %s: %w", s.Name, err)
	}
	if len(hp) != 2 {
		return "", fmt.Errorf("sentinel get-master-addr-by-name %s: %q", s.Name, hp)
	}
	return net.JoinHostPort(hp[0], hp[1]), nil
}

// WaitReplicas waits until Sentinel knows n replicas of the master that it
// could promote (linked to the master, not down).
func (s *Sentinel) WaitReplicas(ctx context.Context, n int) {
	s.t.Helper()
	c := redis.NewSentinelClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1})
	defer c.Close()
	var last string
	for {
		reps, err := c.Replicas(ctx, s.Name).Result()
		good := 0
		for _, r := range reps {
			if r["master-link-status"] == "ok" && !strings.Contains(r["flags"], "down") && !strings.Contains(r["flags"], "disconnected") {
				good++
			}
		}
		if err == nil && good >= n {
			return
		}
		last = fmt.Sprint(err, reps)
		select {
		case <-ctx.Done():
			s.t.Fatalf("redisserver: sentinel does not know %d good replicas in time: %s", n, last)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// WaitFailover waits until Sentinel names a master other than old and that
// server says it is a master.
func (s *Sentinel) WaitFailover(ctx context.Context, old string) string {
	s.t.Helper()
	var last string
	for {
		addr, err := s.Master(ctx)
		if err == nil && addr != old {
			c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
			info, ierr := c.Info(ctx, "replication").Result()
			_ = c.Close()
			if ierr == nil && strings.Contains(info, "role:master") {
				return addr
			}
			last = fmt.Sprint(addr, ierr, info)
		} else {
			last = fmt.Sprint(addr, err)
		}
		select {
		case <-ctx.Done():
			s.t.Fatalf("redisserver: no failover away from %s in time: %s", old, last)
		case <-time.After(50 * time.Millisecond):
		}
	}
}
