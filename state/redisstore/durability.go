package redisstore

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// Durability is what Redis says about persisting acknowledged writes: the
// operator's answer to "does an acknowledged cancel survive a crash?".
type Durability struct {
	// AOF is appendonly yes.
	AOF bool
	// Fsync is appendfsync: always, everysec or no.
	Fsync string
	// Known is false when the server would not say (CONFIG disabled or
	// renamed, as on most managed services).
	Known bool
}

// Safe reports whether every acknowledged write survives a crash of
// redis-server and a power loss: appendonly yes with appendfsync always.
func (d Durability) Safe() bool {
	return d.Known && d.AOF && d.Fsync == "always"
}

// Describe says in one line what an acknowledged cancel survives.
func (d Durability) Describe() string {
	switch {
	case !d.Known:
		return "durability unknown: Redis does not allow CONFIG GET (managed service?); acknowledged cancels survive a restart only if AOF is on (appendonly yes) and power loss only with appendfsync always: check with your provider"
	case !d.AOF:
		return "NOT durable: AOF off (appendonly no): acknowledged cancels can be lost when redis-server restarts or crashes; at best an RDB snapshot brings back an older state"
	case d.Fsync == "always":
		return "acknowledged cancels survive a redis-server crash and power loss (appendonly yes, appendfsync always)"
	case d.Fsync == "everysec":
		return "acknowledged cancels survive a redis-server crash; up to 1s of them may be lost on power loss (appendonly yes, appendfsync everysec)"
	default:
		return fmt.Sprintf("acknowledged cancels survive a redis-server crash; on power loss the OS decides how many are lost (appendonly yes, appendfsync %s)", d.Fsync)
	}
}

// weaker reports whether d promises less than o.
func (d Durability) weaker(o Durability) bool {
	rank := func(d Durability) int {
		switch {
		case !d.Known:
			return 1
		case !d.AOF:
			return 0
		case d.Fsync == "always":
			return 4
		case d.Fsync == "everysec":
			return 3
		default:
			return 2
		}
	}
	return rank(d) < rank(o)
}

// Durability asks Redis how it persists writes. On a cluster every master is
// asked and the weakest answer is reported: a run's keys live on one of
// them, and the operator cannot know which. A server that refuses CONFIG GET
// gives Known false, not an error; an unreachable one gives ErrUnavailable.
func (s *Store) Durability(ctx context.Context) (Durability, error) {
	ctx, cancel := s.op(ctx)
	defer cancel()
	if cc, ok := s.rdb.(*redis.ClusterClient); ok {
		var mu sync.Mutex
		var weakest *Durability
		err := cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
			d, err := s.durabilityOf(ctx, c)
			if err != nil {
				return err
			}
			mu.Lock()
			defer mu.Unlock()
			if weakest == nil || d.weaker(*weakest) {
				weakest = &d
			}
			return nil
		})
		if err != nil {
			return Durability{}, err
		}
		if weakest == nil {
			return Durability{}, nil
		}
		return *weakest, nil
	}
	return s.durabilityOf(ctx, s.rdb)
}

func (s *Store) durabilityOf(ctx context.Context, c redis.Cmdable) (Durability, error) {
	cfg, err := c.ConfigGet(ctx, "append*").Result()
	if err != nil {
		if unavailable(err) {
			return Durability{}, s.fail("config get", "", err)
		}
		// A reply refusing the command: CONFIG renamed away, disabled or
		// not permitted to this user.
		s.log.Info("redis will not tell its persistence settings", "err", err)
		return Durability{}, nil
	}
	aof, okA := cfg["appendonly"]
	fsync, okF := cfg["appendfsync"]
	if !okA || !okF {
		return Durability{}, nil
	}
	return Durability{AOF: strings.EqualFold(aof, "yes"), Fsync: strings.ToLower(fsync), Known: true}, nil
}

// AuthState is whether Redis asks a client for credentials.
type AuthState string

const (
	// AuthRequired: a client without credentials may not read stopgate's
	// keys (NOAUTH, or an ACL that denies the default user them).
	AuthRequired AuthState = "required"
	// AuthOpen: a client without credentials reads stopgate's keys, and so,
	// most likely, writes them.
	AuthOpen AuthState = "open"
	// AuthUnknown: the probe could not tell.
	AuthUnknown AuthState = "unknown"
)

// Exposure is what Redis says about the two ways its rows change with no
// crash and no call of stopgate's: another client that writes them (a
// Redis that asks no password: an agent that reaches it can set a
// cancelled run's status back to ACTIVE) and eviction (a full Redis
// dropping keys, a cancelled run's row among them).
type Exposure struct {
	Auth AuthState
	// AuthDetail names the server probed and what it answered.
	AuthDetail string
	// Eviction is maxmemory-policy; "" when Redis would not say (CONFIG
	// disabled, renamed or denied, as on most managed services).
	Eviction string
}

// Safe reports whether Redis asks for credentials and evicts nothing.
func (x Exposure) Safe() bool { return x.Auth == AuthRequired && x.Eviction == "noeviction" }

// Problems says in a sentence each what is not safe, for the start-up log
// and the refusal of --require-durable.
func (x Exposure) Problems() []string {
	var out []string
	switch x.Auth {
	case AuthOpen:
		out = append(out, "Redis asks no password ("+x.AuthDetail+"): anyone who reaches it, an agent included, can rewrite the store, "+
			"e.g. set a cancelled run's status back to ACTIVE and have its requests forwarded; set requirepass (or an ACL user "+
			"and disable the default one) and give stopgate the password (--store-password-file or STOPGATE_STORE_PASSWORD)")
	case AuthUnknown:
		out = append(out, "could not tell whether Redis asks for a password ("+x.AuthDetail+"): if it does not, anyone who reaches it "+
			"can rewrite the store; make sure it does")
	}
	switch x.Eviction {
	case "noeviction":
	case "":
		out = append(out, "Redis will not say its maxmemory-policy (CONFIG refused): if it evicts keys when full, a cancelled run's "+
			"row may be evicted, and the run comes back ACTIVE at version 1 on an instance that never saw it; make sure it is noeviction")
	default:
		out = append(out, "Redis evicts keys when full (maxmemory-policy "+x.Eviction+"): a cancelled run's row evicted is a cancel lost, "+
			"and the run comes back ACTIVE at version 1 on the next request of an instance that never saw it (one that saw it refuses, "+
			"and marks the store reset); set maxmemory-policy noeviction: a full Redis then refuses writes and stopgate fails closed")
	}
	return out
}

// Exposure asks Redis whether it needs credentials — a connection that
// presents none asks for a stopgate key — and how it evicts. On a cluster
// every master is asked and the worst answer reported, as Durability
// does. A server that refuses CONFIG leaves Eviction empty, not an error;
// one that cannot be reached gives ErrUnavailable.
func (s *Store) Exposure(ctx context.Context) (Exposure, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	type node struct {
		addr string
		tls  *tls.Config
		cfg  redis.Cmdable
	}
	var nodes []node
	switch c := s.rdb.(type) {
	case *redis.ClusterClient:
		var mu sync.Mutex
		err := c.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
			mu.Lock()
			defer mu.Unlock()
			nodes = append(nodes, node{addr: m.Options().Addr, tls: m.Options().TLSConfig, cfg: m})
			return nil
		})
		if err != nil {
			return Exposure{}, s.fail("exposure", "", err)
		}
	default:
		addr, tlsConf, err := s.dataAddr(ctx)
		if err != nil {
			return Exposure{}, err
		}
		nodes = append(nodes, node{addr: addr, tls: tlsConf, cfg: s.rdb})
	}
	x := Exposure{Auth: AuthRequired, Eviction: "noeviction"}
	rank := map[AuthState]int{AuthRequired: 0, AuthUnknown: 1, AuthOpen: 2}
	for _, n := range nodes {
		auth, detail := probeAnonymous(ctx, n.addr, n.tls)
		if rank[auth] > rank[x.Auth] || x.AuthDetail == "" {
			x.Auth, x.AuthDetail = auth, detail
		}
		policy, err := s.evictionOf(ctx, n.cfg)
		if err != nil {
			return Exposure{}, err
		}
		// An evicting master is the worst answer, then one that would not say.
		switch evicting := x.Eviction != "" && x.Eviction != "noeviction"; {
		case evicting:
		case policy != "noeviction":
			x.Eviction = policy
		}
	}
	return x, nil
}

// dataAddr is the address of the one server the store talks to: the URL's,
// or the master the Sentinels name now.
func (s *Store) dataAddr(ctx context.Context) (string, *tls.Config, error) {
	if s.tgt.kind != KindSentinel {
		return s.tgt.node.Addr, s.tgt.node.TLSConfig, nil
	}
	f := s.tgt.failover
	var lastErr error
	for _, a := range f.SentinelAddrs {
		sc := redis.NewSentinelClient(&redis.Options{Addr: a, Password: f.SentinelPassword, MaxRetries: -1, TLSConfig: f.TLSConfig,
			DialTimeout: s.opTimeout, ReadTimeout: s.opTimeout, WriteTimeout: s.opTimeout})
		hp, err := sc.GetMasterAddrByName(ctx, f.MasterName).Result()
		_ = sc.Close()
		if err == nil && len(hp) == 2 {
			return net.JoinHostPort(hp[0], hp[1]), f.TLSConfig, nil
		}
		lastErr = err
	}
	return "", nil, s.fail("exposure (sentinel master)", "", lastErr)
}

func (s *Store) evictionOf(ctx context.Context, c redis.Cmdable) (string, error) {
	cfg, err := c.ConfigGet(ctx, "maxmemory-policy").Result()
	if err != nil {
		if unavailable(err) {
			return "", s.fail("config get", "", err)
		}
		return "", nil
	}
	return strings.ToLower(cfg["maxmemory-policy"]), nil
}

// probeAnonymous asks addr, on a connection that presents no credentials,
// whether stopgate's marker exists: an answer means anyone may read the
// store. It speaks RESP itself, so that nothing (no client library's
// HELLO or AUTH) comes before the question.
func probeAnonymous(ctx context.Context, addr string, tlsConf *tls.Config) (AuthState, string) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return AuthUnknown, fmt.Sprintf("%s: %v", addr, err)
	}
	defer conn.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	if tlsConf != nil {
		tc := tls.Client(conn, tlsConf.Clone())
		if err := tc.HandshakeContext(ctx); err != nil {
			return AuthUnknown, fmt.Sprintf("%s: TLS: %v", addr, err)
		}
		conn = tc
	}
	if _, err := fmt.Fprintf(conn, "*2\r\n$6\r\nEXISTS\r\n$%d\r\n%s\r\n", len(markerKey), markerKey); err != nil {
		return AuthUnknown, fmt.Sprintf("%s: %v", addr, err)
	}
	line, err := bufio.NewReader(io.LimitReader(conn, 512)).ReadString('\n')
	if err != nil {
		return AuthUnknown, fmt.Sprintf("%s: %v", addr, err)
	}
	line = strings.TrimSpace(line)
	switch {
	case strings.HasPrefix(line, ":"):
		return AuthOpen, addr + " answered a client that gave no credentials"
	case strings.HasPrefix(line, "-NOAUTH"):
		return AuthRequired, addr + " asks for a password"
	case strings.HasPrefix(line, "-NOPERM"):
		return AuthRequired, addr + " lets a client without credentials read none of stopgate's keys"
	}
	return AuthUnknown, fmt.Sprintf("%s answered %.80q", addr, line)
}
