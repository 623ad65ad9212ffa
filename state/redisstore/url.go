package redisstore

import (
	"cmp"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/state"
)

// URL is a store URL, read: what it names (one node, the master a set of
// Sentinels names, a cluster), its servers, its credentials and whether it
// speaks TLS. It is the one reading of a store URL: the store opens what it
// says, the start-up checks ask it what is wrong, the egress proxy refuses
// its Addrs, and every message shows it Redacted.
//
// The forms, each also with TLS (rediss, rediss-sentinel, rediss-cluster):
//
//	redis://[[user]:pass@]host[:port][/DB][?go-redis options]
//	redis-sentinel://[[user]:pass@]host:port[,host:port…][/DB]?master=NAME[&sentinel_password=P][&go-redis options]
//	redis-cluster://[[user]:pass@]host:port[,host:port…][?go-redis options]
//
// They are read by go-redis's own parsers (ParseURL, ParseFailoverURL,
// ParseClusterURL), so each takes the query options go-redis documents for
// its client (client_name, pool_size, skip_verify, …). The user and
// password are the data nodes' (the master's, every cluster node's), as
// they are for one node; a Sentinel's own password is sentinel_password.
type URL struct {
	raw  string
	kind string // "node", "sentinel" or "cluster"
	tls  bool
	// One of these, as go-redis read it.
	node     *redis.Options
	failover *redis.FailoverOptions
	cluster  *redis.ClusterOptions
}

// Kinds of URL.
const (
	KindNode     = "node"
	KindSentinel = "sentinel"
	KindCluster  = "cluster"
)

// ParseURL reads a store URL. Its errors wrap state.ErrInvalid, name the
// part that is wrong and show the URL Redacted.
func ParseURL(raw string) (URL, error) {
	u, err := parseURL(raw)
	if err != nil {
		// net/url's errors quote the URL they were given, password and all.
		if ue, ok := errors.AsType[*url.Error](err); ok {
			err = ue.Err
		}
		return URL{}, fmt.Errorf("%w: store URL %q: %w", state.ErrInvalid, Redact(raw), err)
	}
	return u, nil
}

func parseURL(raw string) (URL, error) {
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok {
		return URL{}, fmt.Errorf("no scheme: want redis://HOST:PORT/DB (or rediss://, redis-sentinel://, redis-cluster://), or no store URL for the embedded store")
	}
	u := URL{raw: raw}
	base, kind, _ := strings.Cut(strings.ToLower(scheme), "-")
	switch base {
	case "redis":
	case "rediss":
		u.tls = true
	default:
		return URL{}, fmt.Errorf("unknown scheme %q: want redis, rediss, redis-sentinel, rediss-sentinel, redis-cluster or rediss-cluster", scheme)
	}
	switch u.kind = cmp.Or(kind, KindNode); u.kind {
	case KindNode:
		if kind != "" {
			return URL{}, fmt.Errorf("unknown scheme %q", scheme)
		}
		if host(rest) == "" {
			return URL{}, fmt.Errorf("no host: want %s://HOST:PORT/DB", base)
		}
		opt, err := redis.ParseURL(base + "://" + rest)
		if err != nil {
			return URL{}, err
		}
		u.node = opt
	case KindSentinel, KindCluster:
		if err := u.parseMultiHost(base, rest); err != nil {
			return URL{}, err
		}
	default:
		return URL{}, fmt.Errorf("unknown scheme %q: want redis, rediss, redis-sentinel, rediss-sentinel, redis-cluster or rediss-cluster", scheme)
	}
	return u, nil
}

// parseMultiHost reads a Sentinel or cluster URL: its comma-separated
// servers (which net/url reads as one malformed host) become the first
// host and go-redis's addr options, its own options go-redis's names, and
// go-redis's parser reads the rest.
func (u *URL) parseMultiHost(base, rest string) error {
	what := map[string]string{KindSentinel: "sentinel", KindCluster: "cluster node"}[u.kind]
	rest, rawQuery, _ := strings.Cut(rest, "?")
	authority, path, _ := strings.Cut(rest, "/")
	userinfo, hosts := "", authority
	if i := strings.LastIndex(authority, "@"); i >= 0 {
		userinfo, hosts = authority[:i+1], authority[i+1:]
	}
	if hosts == "" {
		return fmt.Errorf("no %s address: want host:port[,host:port...]", what)
	}
	var addrs []string
	for addr := range strings.SplitSeq(hosts, ",") {
		h, port, err := net.SplitHostPort(addr)
		if err != nil {
			return fmt.Errorf("%s address %q: want host:port", what, addr)
		}
		if h == "" {
			return fmt.Errorf("%s address %q has no host", what, addr)
		}
		if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
			return fmt.Errorf("%s address %q: port %q is not a number from 1 to 65535", what, addr, port)
		}
		addrs = append(addrs, addr)
	}
	q, err := url.ParseQuery(rawQuery)
	if err != nil {
		return fmt.Errorf("bad query: %w", err)
	}
	// One way to say each thing: the servers in the authority, the data
	// nodes' credentials in the user information, the master by master=.
	for _, name := range []string{"addr", "master_name", "username", "password", "sentinel_username"} {
		if q.Has(name) {
			return fmt.Errorf("unknown parameter %q: the servers go in the host list, the data nodes' user and password before the @, a Sentinel's password in sentinel_password, the master in master", name)
		}
	}
	for _, a := range addrs[1:] {
		q.Add("addr", a)
	}
	switch u.kind {
	case KindSentinel:
		master, sentinelPassword := q.Get("master"), q.Get("sentinel_password")
		q.Del("master")
		q.Del("sentinel_password")
		if master == "" {
			return fmt.Errorf("a sentinel URL needs the master's name: add ?master=NAME")
		}
		q.Set("master_name", master)
		if path != "" {
			// A database path go-redis would take as a number or refuse:
			// say which part it is.
			if _, err := strconv.Atoi(path); err != nil {
				return fmt.Errorf("database %q: want a number, as in /0", path)
			}
		}
		// The user information is read apart: go-redis gives it to the
		// Sentinels, stopgate's URLs to the data nodes.
		opt, err := redis.ParseFailoverURL(base + "://" + addrs[0] + "/" + path + "?" + q.Encode())
		if err != nil {
			return err
		}
		if opt.RouteByLatency || opt.RouteRandomly || opt.ReplicaOnly || opt.UseDisconnectedReplicas {
			return fmt.Errorf("route_by_latency, route_randomly, replica_only and use_disconnected_replicas read from replicas: stopgate reads and writes its rows on the master")
		}
		if opt.Username, opt.Password, err = credentials(userinfo); err != nil {
			return err
		}
		opt.SentinelUsername, opt.SentinelPassword = "", sentinelPassword
		u.failover = opt
	case KindCluster:
		if path != "" {
			if db, err := strconv.Atoi(path); err != nil || db != 0 {
				return fmt.Errorf("database %q: Redis Cluster has only database 0", path)
			}
		}
		// go-redis's cluster parser has no skip_verify, which its other
		// two parsers take: read here, so that every form takes it alike.
		skipVerify := false
		if u.tls && q.Has("skip_verify") {
			switch v := q.Get("skip_verify"); v {
			case "true", "1":
				skipVerify = true
			case "false", "0", "":
			default:
				return fmt.Errorf("skip_verify %q: want true or false", v)
			}
			q.Del("skip_verify")
		}
		opt, err := redis.ParseClusterURL(base + "://" + userinfo + addrs[0] + "?" + q.Encode())
		if err != nil {
			return err
		}
		if opt.TLSConfig != nil {
			opt.TLSConfig.MinVersion = tls.VersionTLS12
			opt.TLSConfig.InsecureSkipVerify = skipVerify
		}
		if opt.ReadOnly || opt.RouteByLatency || opt.RouteRandomly {
			return fmt.Errorf("read_only, route_by_latency and route_randomly read from replicas: stopgate reads and writes its rows on the masters")
		}
		u.cluster = opt
	}
	return nil
}

// credentials reads "user:pass@" as net/url does.
func credentials(userinfo string) (user, pass string, err error) {
	if userinfo == "" {
		return "", "", nil
	}
	parsed, err := url.Parse("redis://" + userinfo + "h")
	if err != nil || parsed.User == nil {
		return "", "", fmt.Errorf("bad escape in the user information")
	}
	pass, _ = parsed.User.Password()
	return parsed.User.Username(), pass, nil
}

// host is the servers part of a URL after its scheme: the authority
// without its user information.
func host(rest string) string {
	authority, _, _ := strings.Cut(rest, "/")
	authority, _, _ = strings.Cut(authority, "?")
	if at := strings.LastIndex(authority, "@"); at >= 0 {
		authority = authority[at+1:]
	}
	return authority
}

// Kind is KindNode, KindSentinel or KindCluster.
func (u URL) Kind() string { return u.kind }

// TLS says whether the store is reached over TLS: every server of the URL,
// Sentinels and data nodes alike.
func (u URL) TLS() bool { return u.tls }

// Addrs are the servers the URL names, host:port (go-redis's default port
// filled in where one node is named without one): the node, the Sentinels,
// or the cluster's seed nodes. A master a Sentinel names, and the nodes a
// cluster announces, are not among them: they are known only once asked.
func (u URL) Addrs() []string {
	switch u.kind {
	case KindSentinel:
		return append([]string(nil), u.failover.SentinelAddrs...)
	case KindCluster:
		return append([]string(nil), u.cluster.Addrs...)
	case KindNode:
		return []string{u.node.Addr}
	}
	return nil
}

// Redacted is the URL as every message shows it: see Redact.
func (u URL) Redacted() string { return Redact(u.raw) }

// String is Redacted, so that a URL printed by mistake shows no secret.
func (u URL) String() string { return u.Redacted() }

// HasPassword says whether the URL names the data nodes' password.
func (u URL) HasPassword() bool { return u.password() != "" }

func (u URL) password() string {
	switch u.kind {
	case KindSentinel:
		return u.failover.Password
	case KindCluster:
		return u.cluster.Password
	case KindNode:
		return u.node.Password
	}
	return ""
}

// WithPassword is u with p the password of the data nodes (the node, the
// Sentinels' master, every cluster node), for a password kept out of the
// URL; "" is u as it is. A URL that has one too is an error (ErrInvalid):
// two passwords, one of them wrong, is a mistake to say, not to settle.
func (u URL) WithPassword(p string) (URL, error) {
	if p == "" {
		return u, nil
	}
	if u.HasPassword() {
		return URL{}, fmt.Errorf("%w: store URL %q has a password, and a store password is given besides (a file or the environment): give one", state.ErrInvalid, u.Redacted())
	}
	switch u.kind {
	case KindSentinel:
		o := *u.failover
		o.Password, u.failover = p, &o
	case KindCluster:
		o := *u.cluster
		o.Password, u.cluster = p, &o
	case KindNode:
		o := *u.node
		o.Password, u.node = p, &o
	}
	return u, nil
}

// HasSecret reports whether a store URL holds a secret (a password, or a
// query parameter Redact hides): a URL on a command line shows it to
// every user of the machine.
func HasSecret(raw string) bool { return Redact(raw) != raw }

// Redact hides every secret a store URL may hold — the password of its user
// information (whatever the scheme, and in a string with no scheme at all)
// and the value of every query parameter that names a secret
// (sentinel_password, and any other *pass*, *secret*, *token*, *auth* or
// *key* parameter) — and keeps what names the servers and the database.
// Every log line and error that shows a store URL shows it through Redact.
// It reads any string, a URL ParseURL refuses included.
func Redact(raw string) string {
	scheme, rest, hasScheme := strings.Cut(raw, "://")
	if !hasScheme {
		scheme, rest = "", raw
	}
	rest, fragment, hasFragment := strings.Cut(rest, "#")
	rest, query, hasQuery := strings.Cut(rest, "?")
	authority, path, hasPath := strings.Cut(rest, "/")
	if i := strings.LastIndex(authority, "@"); i >= 0 {
		if user, _, hasPass := strings.Cut(authority[:i], ":"); hasPass {
			authority = user + ":" + masked + authority[i:]
		}
	}
	var b strings.Builder
	if hasScheme {
		b.WriteString(scheme + "://")
	}
	b.WriteString(authority)
	if hasPath {
		b.WriteString("/" + path)
	}
	if hasQuery {
		b.WriteByte('?')
		for i, part := range strings.Split(query, "&") {
			if i > 0 {
				b.WriteByte('&')
			}
			name, _, hasValue := strings.Cut(part, "=")
			if hasValue && secretParam(name) {
				part = name + "=" + masked
			}
			b.WriteString(part)
		}
	}
	if hasFragment && fragment != "" {
		// A fragment means nothing to a store; it is never shown.
		b.WriteString("#" + masked)
	}
	return b.String()
}

// masked stands where a secret was.
const masked = "xxxxx"

func secretParam(name string) bool {
	name = strings.ToLower(name)
	if unescaped, err := url.QueryUnescape(name); err == nil {
		name = unescaped
	}
	for _, word := range []string{"pass", "secret", "token", "auth", "key", "cred"} {
		if strings.Contains(name, word) {
			return true
		}
	}
	return false
}
