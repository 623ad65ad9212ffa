package policy

import (
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
)

// Destinations are the operator's rules for where the egress proxy may
// connect, on top of the rules nobody can change (stopgate's own listeners,
// its store and link-local addresses are never reachable). Deny wins over
// allow; an allowed entry opens a loopback or private destination, which is
// refused otherwise; Default decides what no rule names.
type Destinations struct {
	// Default is what becomes of a destination no allow rule covers:
	// DefaultAllow (the default when empty), DefaultDeny (an allow-list)
	// or DefaultReport (an allow-list in dry run).
	Default DestinationDefault `yaml:"default"`
	Allow   []string           `yaml:"allow"`
	Deny    []string           `yaml:"deny"`
	// Report rules are deny rules in dry run: what they cover is
	// forwarded as if they were not there, and logged and counted as
	// would_deny, so that a deny can be rolled out after watching what it
	// would have refused.
	Report []string `yaml:"report"`
}

// DestinationDefault is what becomes of a destination no allow rule covers.
type DestinationDefault string

const (
	// DefaultAllow: public addresses are reachable; loopback, private and
	// special-purpose ones are refused (smokescreen's "open", with its
	// private-range rule).
	DefaultAllow DestinationDefault = "allow"
	// DefaultDeny: only what an allow rule covers is reachable
	// (smokescreen's "enforce").
	DefaultDeny DestinationDefault = "deny"
	// DefaultReport: what DefaultDeny would refuse is forwarded, and
	// logged and counted as would_deny (smokescreen's "report"). It never
	// opens what DefaultAllow refuses.
	DefaultReport DestinationDefault = "report"
)

// InForce is the default that applies: Default, or DefaultAllow when the
// policy names none.
func (d Destinations) InForce() DestinationDefault {
	if d.Default == "" {
		return DefaultAllow
	}
	return d.Default
}

// Check says what is wrong with d's lists and default, naming the field.
func (d Destinations) Check() error {
	switch d.Default {
	case "", DefaultAllow, DefaultDeny, DefaultReport:
	default:
		return fmt.Errorf("destinations.default: %q: want allow, deny or report", d.Default)
	}
	for field, list := range map[string][]string{"destinations.allow": d.Allow, "destinations.deny": d.Deny, "destinations.report": d.Report} {
		if _, err := ParseDestinationRules(list); err != nil {
			return fmt.Errorf("%s: %w", field, err)
		}
	}
	return nil
}

// DestinationRule is one entry of an allow or deny list: a host pattern
// (api.example.com, *.example.com, either with :port: the grammar of
// HostPattern) or an address rule (an IP, an IP:port, or a CIDR).
type DestinationRule struct {
	// Host is the host pattern, lower case without a trailing dot; empty
	// for an address rule.
	Host string
	// Prefix is what an address rule covers (a single IP is a /32 or /128).
	Prefix netip.Prefix
	// Port limits the rule to one port; 0 is every port.
	Port uint16
}

// String is the rule as an operator writes it.
func (r DestinationRule) String() string {
	what := r.Host
	if what == "" {
		what = r.Prefix.String()
		if r.Prefix.IsSingleIP() {
			what = r.Prefix.Addr().String()
		}
	}
	if r.Port == 0 {
		return what
	}
	return net.JoinHostPort(what, strconv.Itoa(int(r.Port)))
}

// ParseDestinationRule reads one allow or deny entry. Errors say what was
// expected; the rule is never guessed (a CIDR with host bits set, a URL, a
// bare "*" are errors, not approximations).
func ParseDestinationRule(s string) (DestinationRule, error) {
	in := s
	s = strings.TrimSpace(s)
	bad := func(why string) (DestinationRule, error) {
		return DestinationRule{}, fmt.Errorf("destination %q: %s; want a host (api.example.com), *.domain, an IP, a CIDR (10.0.0.0/8), or any of these but a CIDR with :port", in, why)
	}
	switch {
	case s == "":
		return bad("empty")
	case strings.Contains(s, "://"):
		return bad("a URL, not a destination")
	case strings.ContainsAny(s, " \t\r\n,@?#\\"):
		return bad("has a character no host or address has")
	}
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return bad("not a CIDR")
		}
		if p.Addr().Zone() != "" {
			return bad("a CIDR with a zone")
		}
		if m := p.Masked(); m != p {
			return bad("host bits are set (did you mean " + m.String() + "?)")
		}
		return DestinationRule{Prefix: unmapPrefix(p)}, nil
	}
	host, port, why := splitPort(s)
	if why != "" {
		return bad(why)
	}
	if a, err := netip.ParseAddr(host); err == nil {
		if a.Zone() != "" {
			return bad("an address with a zone")
		}
		a = a.Unmap()
		return DestinationRule{Prefix: netip.PrefixFrom(a, a.BitLen()), Port: port}, nil
	}
	name, err := hostName(host)
	if err != nil {
		return bad(err.Error())
	}
	return DestinationRule{Host: name, Port: port}, nil
}

// unmapPrefix turns an IPv4-mapped IPv6 prefix (::ffff:10.0.0.0/104) into
// the IPv4 prefix it stands for, so that it matches the unmapped addresses
// the proxy compares.
func unmapPrefix(p netip.Prefix) netip.Prefix {
	a := p.Addr()
	if !a.Is4In6() {
		return p
	}
	bits := p.Bits() - 96
	if bits < 0 {
		// Wider than the mapped range: it covers every IPv4 address.
		bits = 0
	}
	return netip.PrefixFrom(a.Unmap(), bits).Masked()
}

// ParseDestinationRules reads a list, naming the entry that is wrong.
func ParseDestinationRules(list []string) ([]DestinationRule, error) {
	out := make([]DestinationRule, 0, len(list))
	for _, s := range list {
		r, err := ParseDestinationRule(s)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, nil
}
