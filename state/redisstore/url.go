package redisstore

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/state"
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
		return target{}, fmt.Errorf("store URL %q has no scheme: want redis://, rediss://, redis-sentinel:// or redis-cluster://", Redact(raw))
	}
	switch strings.ToLower(scheme) {
	case "redis", "rediss":
		opt, err := redis.ParseURL(raw)
		if err != nil {
			return target{}, fmt.Errorf("store URL %q: %w", Redact(raw), err)
		}
		return target{kind: "node", node: opt}, nil
	case "redis-sentinel":
		t, q, err := parseMultiHost(rest, "sentinel")
		if err != nil {
			return target{}, fmt.Errorf("store URL %q: %w", Redact(raw), err)
		}
		t.kind = "sentinel"
		t.master = q.Get("master")
		t.sentinelPassword = q.Get("sentinel_password")
		q.Del("master")
		q.Del("sentinel_password")
		if t.master == "" {
			return target{}, fmt.Errorf("store URL %q: a sentinel URL needs the master's name: add ?master=NAME", Redact(raw))
		}
		if err := noOtherParams(q, "master, sentinel_password"); err != nil {
			return target{}, fmt.Errorf("store URL %q: %w", Redact(raw), err)
		}
		return t, nil
	case "redis-cluster":
		t, q, err := parseMultiHost(rest, "cluster node")
		if err != nil {
			return target{}, fmt.Errorf("store URL %q: %w", Redact(raw), err)
		}
		t.kind = "cluster"
		if t.db != 0 {
			return target{}, fmt.Errorf("store URL %q: Redis Cluster has only database 0, not %d", Redact(raw), t.db)
		}
		if err := noOtherParams(q, "none"); err != nil {
			return target{}, fmt.Errorf("store URL %q: %w", Redact(raw), err)
		}
		return t, nil
	default:
		return target{}, fmt.Errorf("store URL %q: unknown scheme %q: want redis, rediss, redis-sentinel or redis-cluster", Redact(raw), scheme)
	}
}

// withPassword makes p the password of the data nodes (of every URL form:
// the node, the Sentinels' master, every cluster node), for a password
// kept out of the URL; "" leaves the URL's. A URL that has one too is an
// error: two passwords, one of them wrong, is a mistake to say, not to
// settle.
func (t *target) withPassword(p string) error {
	if p == "" {
		return nil
	}
	if t.password != "" || (t.node != nil && t.node.Password != "") {
		return errors.New("it has a password, and a store password is given besides (a file or the environment): give one")
	}
	t.password = p
	if t.node != nil {
		t.node.Password = p
	}
	return nil
}

// HasSecret reports whether a store URL holds a secret (a password, or a
// query parameter Redact hides): a URL on a command line shows it to
// every user of the machine.
func HasSecret(raw string) bool { return Redact(raw) != raw }

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

// Redact hides every secret a store URL may hold — the password of its user
// information (whatever the scheme, and in a string with no scheme at all)
// and the value of every query parameter that names a secret
// (sentinel_password, and any other *pass*, *secret*, *token*, *auth* or
// *key* parameter) — and keeps what names the servers and the database.
// Every log line and error that shows a store URL shows it through Redact.
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

// CheckURL reports what is wrong with a store URL without connecting; the
// error wraps state.ErrInvalid and shows the URL redacted.
func CheckURL(raw string) error { return CheckURLWithPassword(raw, "") }

// CheckURLWithPassword is CheckURL for a URL used with a password given
// apart (Options.Password).
func CheckURLWithPassword(raw, password string) error {
	t, err := parseURL(raw)
	if err == nil {
		if err = t.withPassword(password); err != nil {
			err = fmt.Errorf("store URL %q: %w", Redact(raw), err)
		}
	}
	if err != nil {
		return fmt.Errorf("%w: %w", state.ErrInvalid, err)
	}
	return nil
}
