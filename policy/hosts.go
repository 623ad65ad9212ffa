package policy

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
)

// HostPattern is one entry of a host list (pass_through, delivery, effects,
// and the name rules of destinations): a host name (api.example.com), every
// name below a domain (*.example.com, not the domain itself), or an IP
// address; any of them on every port or, with :port, on one. Names are
// compared without case and without a trailing dot, so api.openai.com. is
// api.openai.com; an address in its canonical form, so [::ffff:10.0.0.1] is
// 10.0.0.1. A pattern matches the name the client wrote, never what it
// resolves to.
type HostPattern struct {
	// Host is the name in lower case without a trailing dot ("*.domain"
	// for a wildcard), or the address in its canonical form.
	Host string
	// Port limits the pattern to one port; 0 is every port.
	Port uint16
}

// String is the pattern as an operator writes it.
func (p HostPattern) String() string {
	if p.Port == 0 {
		if strings.Contains(p.Host, ":") {
			return "[" + p.Host + "]"
		}
		return p.Host
	}
	return net.JoinHostPort(p.Host, strconv.Itoa(int(p.Port)))
}

// ParseHostPattern reads one entry of a host list. It is the one grammar
// of host patterns: what it refuses (a wildcard anywhere but a leading
// "*.", a URL, a "name" ending in a numeric label) is refused in every list.
func ParseHostPattern(s string) (HostPattern, error) {
	in := s
	s = strings.TrimSpace(s)
	bad := func(why string) (HostPattern, error) {
		return HostPattern{}, fmt.Errorf("host pattern %q: %s; want a host (api.example.com), *.domain or an IP address, each with :port or not", in, why)
	}
	if strings.Contains(s, "://") {
		return bad("a URL, not a host")
	}
	host, port, why := splitPort(s)
	if why != "" {
		return bad(why)
	}
	if a, ok := parseAddr(host); ok {
		return HostPattern{Host: a.String(), Port: port}, nil
	}
	name, err := hostName(host)
	if err != nil {
		return bad(err.Error())
	}
	return HostPattern{Host: name, Port: port}, nil
}

// splitPort separates an entry's :port, if it has one; why says what is
// wrong with it.
func splitPort(s string) (host string, port uint16, why string) {
	switch {
	case s == "":
		return "", 0, "empty"
	case strings.ContainsAny(s, " \t\r\n,@?#\\/"):
		return "", 0, "has a character no host or address has"
	case strings.HasPrefix(s, "[") && strings.HasSuffix(s, "]"):
		return s[1 : len(s)-1], 0, ""
	}
	if h, ps, err := net.SplitHostPort(s); err == nil {
		n, perr := strconv.Atoi(ps)
		if perr != nil || n < 1 || n > 65535 {
			return "", 0, "port " + strconv.Quote(ps) + " is not a number from 1 to 65535"
		}
		return h, uint16(n), ""
	} else if strings.Count(s, ":") == 1 {
		// host:port whose port is missing or not a port at all.
		return "", 0, "not host:port"
	}
	return s, 0, ""
}

// parseAddr reads an IP address without a zone, IPv4-mapped ones as the
// IPv4 address they stand for.
func parseAddr(host string) (netip.Addr, bool) {
	a, err := netip.ParseAddr(host)
	if err != nil || a.Zone() != "" {
		return netip.Addr{}, false
	}
	return a.Unmap(), true
}

// hostName checks a host name or *.domain pattern and returns it in the
// form names are compared in: lower case, without a trailing dot.
func hostName(host string) (string, error) {
	if strings.HasPrefix(host, "[") {
		return "", errors.New("not an IPv6 address in brackets")
	}
	if a, err := netip.ParseAddr(host); err == nil && a.Zone() != "" {
		return "", errors.New("an address with a zone")
	}
	host = NormalName(host)
	name := strings.TrimPrefix(host, "*.")
	if name == "" || strings.Contains(name, "*") {
		return "", errors.New("a wildcard is only *.domain")
	}
	if len(host) > 253 {
		return "", errors.New("longer than a host name can be")
	}
	numeric := false
	for label := range strings.SplitSeq(name, ".") {
		if label == "" || len(label) > 63 {
			return "", errors.New("not a host name")
		}
		numeric = true
		for _, c := range label {
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return "", fmt.Errorf("%q in a host name", c)
			}
			numeric = numeric && c >= '0' && c <= '9'
		}
	}
	if numeric {
		// No top-level domain is all digits: this is an address written
		// oddly (10.0.0.1., 010.1, 167772161), which a name rule would
		// match by its spelling only.
		return "", errors.New("ends in a numeric label, so it is no host name; write an IP address as such")
	}
	return host, nil
}

// NormalName is a host name as patterns compare it: lower case, without a
// trailing dot.
func NormalName(host string) string { return strings.TrimSuffix(strings.ToLower(host), ".") }

// HostSet is a list of host patterns, ready to match.
type HostSet struct {
	// exact holds the patterns without a wildcard, by Host and port (0:
	// every port).
	exact map[HostPattern]bool
	// below holds the wildcards, by the ".domain" they end in.
	below []HostPattern
}

// NewHostSet parses a host list; the error names the entry that is wrong.
func NewHostSet(patterns []string) (HostSet, error) {
	var s HostSet
	for _, raw := range patterns {
		p, err := ParseHostPattern(raw)
		if err != nil {
			return HostSet{}, err
		}
		if rest, ok := strings.CutPrefix(p.Host, "*"); ok {
			s.below = append(s.below, HostPattern{Host: rest, Port: p.Port})
			continue
		}
		if s.exact == nil {
			s.exact = map[HostPattern]bool{}
		}
		s.exact[p] = true
	}
	return s, nil
}

// Len is how many patterns the set holds.
func (s HostSet) Len() int { return len(s.exact) + len(s.below) }

// Match reports whether hostport (host, or host:port as a client names its
// destination) is covered by a pattern of the set.
func (s HostSet) Match(hostport string) bool {
	if len(s.exact) == 0 && len(s.below) == 0 {
		// Most sets are empty (no delivery hosts, say), and every request
		// asks several of them.
		return false
	}
	host, port := hostport, uint16(0)
	if h, ps, err := net.SplitHostPort(hostport); err == nil {
		n, err := strconv.ParseUint(ps, 10, 16)
		if err != nil {
			return false
		}
		host, port = h, uint16(n)
	} else {
		host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	}
	if a, ok := parseAddr(host); ok {
		host = a.String()
	} else {
		host = NormalName(host)
	}
	if s.exact[HostPattern{Host: host}] || port != 0 && s.exact[HostPattern{Host: host, Port: port}] {
		return true
	}
	for _, p := range s.below {
		if strings.HasSuffix(host, p.Host) && (p.Port == 0 || p.Port == port) {
			return true
		}
	}
	return false
}
