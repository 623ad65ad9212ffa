package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"

	"github.com/stopgate/stopgate/policy"
	"github.com/stopgate/stopgate/refusal"
)

// Protected is an address the proxy never connects to, whatever is allowed:
// one of stopgate's own listeners, or its store.
type Protected struct {
	// Addr is host:port; a host of 0.0.0.0 or :: (a listener on every
	// interface) protects the port on every address of this machine.
	Addr string
	// What it is, for the refusal's message ("the control API").
	What string
}

// destinations decides where the proxy may connect. The rules, in order:
//
//  1. never: link-local and cloud metadata addresses, stopgate's own
//     listeners and its store, whatever is allowed;
//  2. deny: the operator's deny rules (by name, or by address);
//  3. report: deny rules in dry run — what they cover goes on down this
//     list as if they were not there, noted as would_deny;
//  4. allow: the operator's allow rules (by name: whatever the name
//     resolves to; by address);
//  5. loopback, private and other special-purpose addresses are refused;
//  6. the default: every other address is allowed (default allow),
//     refused (deny), or allowed and noted as would_deny (report).
//
// A name is resolved once; every address it resolves to must pass, and the
// addresses that passed are the only ones dialled (see target).
type destinations struct {
	linkLocal []netip.Prefix
	special   []netip.Prefix
	// protected are exact addresses; protectedPorts are the ports of
	// listeners on an unspecified address, protected on every local address.
	protected      map[netip.AddrPort]string
	protectedPorts map[uint16]string
	protectedNames map[string]string // a store named by a host name, by "host:port"
	local          map[netip.Addr]bool
	allowHosts     policy.HostSet
	denyHosts      policy.HostSet
	reportHosts    policy.HostSet
	allowNets      []policy.DestinationRule
	denyNets       []policy.DestinationRule
	reportNets     []policy.DestinationRule
	byDefault      policy.DestinationDefault
	resolve        func(ctx context.Context, host string) ([]netip.Addr, error)
}

// target is a destination that passed the check: what the client named,
// and the addresses that may be dialled for it. addrs is nil when the name
// did not resolve at the check; the dial then resolves and checks again.
type target struct {
	hostport string
	addrs    []netip.AddrPort
	// one holds addrs when there is one address (an address literal, most
	// names), so that checking a request's destination in its exchange
	// allocates nothing; a copy of the target reads the original's.
	one [1]netip.AddrPort
	// wouldDeny names the report rule (or the report default) that would
	// have refused the destination: it is forwarded, and the edge logs
	// and counts it as would_deny.
	wouldDeny string
	// by is the check that decided, whose rules a second check of the
	// same request applies.
	by *destinations
}

// errUnresolved is a destination whose name did not resolve: not a
// decision about the destination, an upstream failure (NOT_SENT).
var errUnresolved = errors.New("cannot resolve the destination")

// destinationRules is what destinations are built from.
type destinationRules struct {
	allow, deny, report []string
	byDefault           policy.DestinationDefault
	protected           []Protected
	resolve             func(context.Context, string) ([]netip.Addr, error)
	// local are this machine's addresses, where a listener on an
	// unspecified address is reached (see localAddrs).
	local []netip.Addr
}

// localAddrs are the addresses of this machine's interfaces now.
func localAddrs() []netip.Addr {
	var out []netip.Addr
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil
	}
	for _, a := range addrs {
		if pfx, err := netip.ParsePrefix(a.String()); err == nil {
			out = append(out, pfx.Addr().Unmap().WithZone(""))
		}
	}
	return out
}

func newDestinations(ctx context.Context, rules destinationRules) (*destinations, error) {
	allow, deny, protected, resolve := rules.allow, rules.deny, rules.protected, rules.resolve
	d := &destinations{
		linkLocal: prefixes("169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128"),
		special: prefixes(
			"0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "172.16.0.0/12", "192.0.0.0/24",
			"192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4",
			"::/96", "100::/64", "fc00::/7", "ff00::/8",
		),
		protected: map[netip.AddrPort]string{}, protectedPorts: map[uint16]string{}, protectedNames: map[string]string{},
		local: map[netip.Addr]bool{}, resolve: resolve, byDefault: rules.byDefault,
	}
	if err := (policy.Destinations{Default: rules.byDefault}).Check(); err != nil {
		return nil, err
	}
	if d.resolve == nil {
		d.resolve = func(ctx context.Context, host string) ([]netip.Addr, error) {
			return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
		}
	}
	var err error
	if d.allowHosts, d.allowNets, err = d.rules(allow); err != nil {
		return nil, fmt.Errorf("allowed destinations: %w", err)
	}
	for _, r := range d.allowNets {
		for _, ll := range d.linkLocal {
			if ll.Bits() <= r.Prefix.Bits() && ll.Contains(r.Prefix.Addr()) {
				return nil, fmt.Errorf("allowed destinations: %s is link-local or cloud metadata (%s), which is never reachable through the proxy", r, ll)
			}
		}
	}
	if d.denyHosts, d.denyNets, err = d.rules(deny); err != nil {
		return nil, fmt.Errorf("denied destinations: %w", err)
	}
	if d.reportHosts, d.reportNets, err = d.rules(rules.report); err != nil {
		return nil, fmt.Errorf("reported destinations: %w", err)
	}
	for _, a := range rules.local {
		d.local[a] = true
	}
	for _, p := range protected {
		if err := d.protect(ctx, p); err != nil {
			return nil, err
		}
	}
	return d, nil
}

func (d *destinations) rules(list []string) (policy.HostSet, []policy.DestinationRule, error) {
	rules, err := policy.ParseDestinationRules(list)
	if err != nil {
		return policy.HostSet{}, nil, err
	}
	var hosts []string
	var nets []policy.DestinationRule
	for _, r := range rules {
		if r.Host != "" {
			hosts = append(hosts, r.String())
		} else {
			nets = append(nets, r)
		}
	}
	set, err := policy.NewHostSet(hosts)
	return set, nets, err
}

// protect adds one of stopgate's own addresses; a name is resolved now, and
// refused by name as well.
func (d *destinations) protect(ctx context.Context, p Protected) error {
	host, portStr, err := net.SplitHostPort(p.Addr)
	if err != nil {
		return fmt.Errorf("protected address %q (%s): %w", p.Addr, p.What, err)
	}
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil {
		return fmt.Errorf("protected address %q (%s): bad port", p.Addr, p.What)
	}
	what := fmt.Sprintf("stopgate's %s (%s)", p.What, p.Addr)
	var addrs []netip.Addr
	if a, err := netip.ParseAddr(host); err == nil {
		addrs = []netip.Addr{a}
	} else if host == "" {
		addrs = []netip.Addr{netip.IPv6Unspecified()}
	} else {
		d.protectedNames[net.JoinHostPort(policy.NormalName(host), portStr)] = what
		if addrs, err = d.resolve(ctx, host); err != nil {
			return fmt.Errorf("protected address %q (%s): %w", p.Addr, p.What, err)
		}
	}
	for _, a := range addrs {
		a = a.Unmap().WithZone("")
		if a.IsUnspecified() {
			d.protectedPorts[uint16(port)] = what
			continue
		}
		d.protected[netip.AddrPortFrom(a, uint16(port))] = what
	}
	return nil
}

// check decides whether hostport may be reached and resolves it into t. A
// refusal is destination_denied (or invalid_request for a hostport that is
// not one); an error wrapping errUnresolved is a name that did not
// resolve, which is for the dial to report.
func (d *destinations) check(ctx context.Context, hostport string, t *target) error {
	*t = target{by: d}
	host, portStr, err := net.SplitHostPort(hostport)
	port, perr := strconv.ParseUint(portStr, 10, 16)
	if err != nil || perr != nil || port == 0 || host == "" {
		return refusal.New(refusal.InvalidRequest, "destination %q is not host:port", hostport)
	}
	t.hostport = hostport
	var addrs []netip.Addr
	byName := false
	if a, err := netip.ParseAddr(host); err == nil {
		addrs = []netip.Addr{a}
	} else {
		name := net.JoinHostPort(policy.NormalName(host), portStr)
		if what, ok := d.protectedNames[name]; ok {
			return denied(hostport, what)
		}
		if d.denyHosts.Match(name) {
			return denied(hostport, "denied by the policy's destinations.deny")
		}
		if d.reportHosts.Match(name) {
			t.wouldDeny = "destinations.report"
		}
		byName = d.allowHosts.Match(name)
		addrs, err = d.resolve(ctx, host)
		if err == nil && len(addrs) == 0 {
			err = errors.New("no address")
		}
		if err != nil {
			return fmt.Errorf("%w %s: %w", errUnresolved, host, err)
		}
	}
	t.addrs = t.one[:0]
	for _, a := range addrs {
		ap := netip.AddrPortFrom(a.Unmap().WithZone(""), uint16(port))
		why, would := d.decide(ap, byName)
		if why != "" {
			if ap.Addr().String() != host {
				why = fmt.Sprintf("%s resolves to %s, %s", host, ap.Addr(), why)
			}
			*t = target{hostport: hostport, by: d}
			return denied(hostport, why)
		}
		if t.wouldDeny == "" {
			t.wouldDeny = would
		}
		t.addrs = append(t.addrs, ap)
	}
	return nil
}

// decide is the rule for one address: "" if it may be dialled, else why
// not; would names the report rule that would have refused it ("" if none).
// byName says an allow rule matched the name the address was resolved from.
func (d *destinations) decide(ap netip.AddrPort, byName bool) (why, would string) {
	a, port := ap.Addr().Unmap().WithZone(""), ap.Port()
	if inner, ok := embeddedIPv4(a); ok {
		why, would := d.decide(netip.AddrPortFrom(inner, port), byName)
		if why != "" {
			return fmt.Sprintf("%s embeds %s: %s", a, inner, why), ""
		}
		if would != "" {
			return "", would
		}
	}
	why = d.hard(a, port)
	if why != "" {
		return why, ""
	}
	for _, r := range d.denyNets {
		if r.Prefix.Contains(a) && (r.Port == 0 || r.Port == port) {
			return "denied by the policy's destinations.deny (" + r.String() + ")", ""
		}
	}
	for _, r := range d.reportNets {
		if r.Prefix.Contains(a) && (r.Port == 0 || r.Port == port) {
			would = "destinations.report (" + r.String() + ")"
			break
		}
	}
	if byName {
		return "", would
	}
	for _, r := range d.allowNets {
		if r.Prefix.Contains(a) && (r.Port == 0 || r.Port == port) {
			return "", would
		}
	}
	if d.byDefault == policy.DefaultDeny {
		return "no rule of destinations.allow covers it, and destinations.default is deny", ""
	}
	for _, s := range d.special {
		if s.Contains(a) {
			return "a loopback, private or special-purpose address (" + s.String() + "), refused unless allowed (--allow-dest, or destinations.allow in the policy)", ""
		}
	}
	if d.byDefault == policy.DefaultReport {
		if would == "" {
			would = "destinations.default (report)"
		}
	}
	return "", would
}

// hard is the part of the rule nobody can change: "" if a may be dialled
// on port as far as it goes, else why not.
func (d *destinations) hard(a netip.Addr, port uint16) string {
	for _, ll := range d.linkLocal {
		if ll.Contains(a) {
			return "a link-local or cloud metadata address, never reachable through the proxy"
		}
	}
	if what, ok := d.protected[netip.AddrPortFrom(a, port)]; ok {
		return what + ", never reachable through the proxy"
	}
	if what, ok := d.protectedPorts[port]; ok && (d.local[a] || a.IsLoopback() || a.IsUnspecified()) {
		return what + ", never reachable through the proxy"
	}
	if a.IsUnspecified() {
		// Connecting to 0.0.0.0 or :: reaches this machine's loopback.
		for p, what := range d.protected {
			if p.Port() == port && p.Addr().IsLoopback() {
				return what + ", never reachable through the proxy"
			}
		}
	}
	return ""
}

// embeddedIPv4 is the IPv4 address an IPv6 address carries to be reached
// through a translator (NAT64: 64:ff9b::/96, 64:ff9b:1::/48) or a 6to4
// relay (2002::/16): the rules apply to it as well.
func embeddedIPv4(a netip.Addr) (netip.Addr, bool) {
	if !a.Is6() {
		return netip.Addr{}, false
	}
	b := a.As16()
	switch {
	case b[0] == 0x00 && b[1] == 0x64 && b[2] == 0xff && b[3] == 0x9b:
		// The whole 64:ff9b::/32 is read as NAT64 with the address in its
		// last 32 bits: wider than the two prefixes in use, never narrower.
		return netip.AddrFrom4([4]byte{b[12], b[13], b[14], b[15]}), true
	case b[0] == 0x20 && b[1] == 0x02:
		return netip.AddrFrom4([4]byte{b[2], b[3], b[4], b[5]}), true
	}
	return netip.Addr{}, false
}

func denied(hostport, why string) *refusal.Refusal {
	return refusal.New(refusal.DestinationDenied, "destination %s is not allowed: %s; nothing was sent", hostport, why)
}

func prefixes(list ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(list))
	for i, s := range list {
		out[i] = netip.MustParsePrefix(s)
	}
	return out
}

// CheckDestinationRules reports what is wrong with allow and deny lists
// before anything starts: an entry that is not a rule, or an allow of a
// link-local or metadata address, which nothing can allow.
func CheckDestinationRules(allow, deny []string) error {
	_, err := newDestinations(context.Background(), destinationRules{allow: allow, deny: deny})
	return err
}
