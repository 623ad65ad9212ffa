package redisstore

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"
)

// target is what a store URL names: one node, a Sentinel-watched master, or
// a cluster.
type target struct {
	kind     string // "node", "sentinel" or "cluster"
	node     *redis.Options
	addrs    []string // sentinel or cluster seeds
	master   string
	db       int
	username string
	password string
	// sentinelPassword authenticates to the Sentinels themselves.
	sentinelPassword string
}

// parseURL reads the store URL forms:
//
//	redis://[[user]:pass@]host:port/DB, rediss://... (TLS)
//	redis-sentinel://[[user]:pass@]host:port[,host:port...]/DB?master=NAME[&sentinel_password=P]
//	redis-cluster://[[user]:pass@]host:port[,host:port...]
//
// Errors name the part that is wrong and never echo a password.
func parseURL(raw string) (target, error) {
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok {
		return target{}, fmt.Errorf("store URL %q has no scheme: want redis://, rediss://, redis-sentinel:// or redis-cluster://", redact(raw))
	}
	switch strings.ToLower(scheme) {
	case "redis", "rediss":
		opt, err := redis.ParseURL(raw)
		if err != nil {
			return target{}, fmt.Errorf("store URL %q: %w", redact(raw), err)
		}
		return target{kind: "node", node: opt}, nil
	case "redis-sentinel":
		t, q, err := parseMultiHost(rest, "sentinel")
		if err != nil {
			return target{}, fmt.Errorf("store URL %q: %w", redact(raw), err)
		}
		t.kind = "sentinel"
		t.master = q.Get("master")
		t.sentinelPassword = q.Get("sentinel_password")
		q.Del("master")
		q.Del("sentinel_password")
		if t.master == "" {
			return target{}, fmt.Errorf("store URL %q: a sentinel URL needs the master's name: add ?master=NAME", redact(raw))
		}
		if err := noOtherParams(q, "master, sentinel_password"); err != nil {
			return target{}, fmt.Errorf("store URL %q: %w", redact(raw), err)
		}
		return t, nil
	case "redis-cluster":
		t, q, err := parseMultiHost(rest, "cluster node")
		if err != nil {
			return target{}, fmt.Errorf("store URL %q: %w", redact(raw), err)
		}
		t.kind = "cluster"
		if t.db != 0 {
			return target{}, fmt.Errorf("store URL %q: Redis Cluster has only database 0, not %d", redact(raw), t.db)
		}
		if err := noOtherParams(q, "none"); err != nil {
			return target{}, fmt.Errorf("store URL %q: %w", redact(raw), err)
		}
		return t, nil
	default:
		return target{}, fmt.Errorf("store URL %q: unknown scheme %q: want redis, rediss, redis-sentinel or redis-cluster", redact(raw), scheme)
	}
}

// parseMultiHost reads "[[user]:pass@]host:port[,host:port...][/DB][?query]".
// net/url cannot: it takes a comma-separated host list for one malformed host.
func parseMultiHost(rest, what string) (target, url.Values, error) {
	var t target
	rest, rawQuery, _ := strings.Cut(rest, "?")
	q, err := url.ParseQuery(rawQuery)
	if err != nil {
		return t, nil, fmt.Errorf("bad query: %w", err)
	}
	authority, path, _ := strings.Cut(rest, "/")
	if i := strings.LastIndex(authority, "@"); i >= 0 {
		userinfo := authority[:i]
		authority = authority[i+1:]
		user, pass, _ := strings.Cut(userinfo, ":")
		if t.username, err = url.PathUnescape(user); err != nil {
			return t, nil, errors.New("bad escape in the user name")
		}
		if t.password, err = url.PathUnescape(pass); err != nil {
			return t, nil, errors.New("bad escape in the password")
		}
	}
	if authority == "" {
		return t, nil, fmt.Errorf("no %s address: want host:port[,host:port...]", what)
	}
	for addr := range strings.SplitSeq(authority, ",") {
		host, port, err := net.SplitHostPort(addr)
		if err != nil {
			return t, nil, fmt.Errorf("%s address %q: want host:port", what, addr)
		}
		if host == "" {
			return t, nil, fmt.Errorf("%s address %q has no host", what, addr)
		}
		if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
			return t, nil, fmt.Errorf("%s address %q: port %q is not a number from 1 to 65535", what, addr, port)
		}
		t.addrs = append(t.addrs, addr)
	}
	if path != "" {
		db, err := strconv.Atoi(path)
		if err != nil || db < 0 {
			return t, nil, fmt.Errorf("database %q: want a number, as in /0", path)
		}
		t.db = db
	}
	return t, q, nil
}

func noOtherParams(q url.Values, allowed string) error {
	for name := range q {
		return fmt.Errorf("unknown parameter %q (allowed: %s)", name, allowed)
	}
	return nil
}

// redact hides the passwords of a URL (user info and sentinel_password) in
// error messages.
func redact(raw string) string {
	out := raw
	if scheme, rest, ok := strings.Cut(raw, "://"); ok {
		authority, tail, hasTail := strings.Cut(rest, "/")
		if i := strings.LastIndex(authority, "@"); i >= 0 {
			if user, _, hasPass := strings.Cut(authority[:i], ":"); hasPass {
				out = scheme + "://" + user + ":xxxxx@" + authority[i+1:]
				if hasTail {
					out += "/" + tail
				}
			}
		}
	}
	const param = "sentinel_password="
	if i := strings.Index(out, param); i >= 0 {
		start := i + len(param)
		end := strings.IndexByte(out[start:], '&')
		if end < 0 {
			end = len(out) - start
		}
		out = out[:start] + "xxxxx" + out[start+end:]
	}
	return out
}
