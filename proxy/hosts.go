package proxy

import (
	"fmt"
	"net"
	"strings"
)

// HostSet matches destination hosts: "api.example.com" (any port),
// "api.example.com:8443" (that port), "*.example.com" (any subdomain).
type HostSet struct {
	exact    map[string]bool
	suffixes []string
}

// NewHostSet parses patterns; an empty or malformed one is an error.
func NewHostSet(patterns []string) (HostSet, error) {
	s := HostSet{exact: map[string]bool{}}
	for _, p := range patterns {
		p = strings.ToLower(strings.TrimSpace(p))
		switch {
		case p == "" || strings.ContainsAny(p, "/ "):
			return HostSet{}, fmt.Errorf("host pattern %q: want host, host:port or *.domain", p)
		case strings.HasPrefix(p, "*."):
			s.suffixes = append(s.suffixes, p[1:])
		default:
			s.exact[p] = true
		}
	}
	return s, nil
}

// Match reports whether hostport (host or host:port) is in the set.
func (s HostSet) Match(hostport string) bool {
	if len(s.exact) == 0 && len(s.suffixes) == 0 {
		// Most sets are empty (no delivery hosts, say), and every request
		// asks three of them.
		return false
	}
	hostport = strings.ToLower(hostport)
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	}
	if s.exact[hostport] || s.exact[host] {
		return true
	}
	for _, suf := range s.suffixes {
		if strings.HasSuffix(host, suf) {
			return true
		}
	}
	return false
}
