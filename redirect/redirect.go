// Package redirect installs and removes, in the current network namespace,
// the kernel rules that put one user behind stopgate's transparent listener:
// every TCP connection the uid opens is redirected (iptables nat REDIRECT)
// to the listener's port, and every other packet it sends is refused but DNS
// to the resolvers named (UDP to their address and port, nothing else over
// UDP), so nothing it runs reaches the network around the guard,
// whatever proxy settings it honours or ignores. The same rules go into
// ip6tables; where IPv6 is up and ip6tables is missing, Install fails
// rather than leave IPv6 open.
//
// The rules live in one chain per uid and table (STOPGATE-U<uid>), entered
// from OUTPUT by one jump that matches the uid; a chain's content is
// replaced atomically (iptables-restore --noflush), so Install is
// idempotent and a re-install to another port leaves no moment unguarded.
//
// It also names what such rules point at, a Binding: the transparent
// listener the proxy binds to one run for one uid, the one type the proxy,
// the control API and its client share.
//
// It uses the system's iptables commands and never reads or changes rules
// other than its own; it opens no listener (the proxy does).
package redirect

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
)

// MaxUID is the largest user id a rule can name: uids are 32 bits, and
// 2^32-1 is (uid_t)-1, "no user", which the kernel never gives a process.
const MaxUID = 1<<32 - 2

// CheckUID says what is wrong with uid as a user id to redirect ("" when
// nothing is), in words every edge that takes one (a flag, the control
// API) can lead with its own name of it.
func CheckUID(uid int64) string {
	if uid < 0 || uid > MaxUID {
		return fmt.Sprintf("uid %d: want 0 to %d", uid, int64(MaxUID))
	}
	return ""
}

// Rules put one uid behind one port.
type Rules struct {
	UID uint32
	// Port is the transparent listener's port; REDIRECT sends a local
	// connection to 127.0.0.1 (or ::1) at this port.
	Port uint16
	// DNS are the resolvers the uid may send UDP to (Resolvers reads
	// them from /etc/resolv.conf): every other datagram is refused, since
	// "any UDP to port 53" is a tunnel to any address that answers there.
	DNS []netip.AddrPort
}

// Errors callers can test for.
var (
	// ErrNoIptables: the iptables commands are not installed (or not in PATH).
	ErrNoIptables = errors.New("iptables not found")
	// ErrNotPermitted: the caller may not change the rules (not root, no CAP_NET_ADMIN).
	ErrNotPermitted = errors.New("not permitted to change iptables rules")
)

// ChainName is the chain holding uid's rules, in the nat and filter tables.
func ChainName(uid uint32) string { return "STOPGATE-U" + strconv.FormatUint(uint64(uid), 10) }

// family is one of IPv4 (iptables) and IPv6 (ip6tables).
type family struct {
	name    string // iptables or ip6tables
	restore string // iptables-restore or ip6tables-restore
	v6      bool
}

var families = []family{
	{name: "iptables", restore: "iptables-restore"},
	{name: "ip6tables", restore: "ip6tables-restore", v6: true},
}

// lockWait is how long (seconds) a command waits for another one's xtables lock.
const lockWait = "5"

// Install puts r in place: the filter chain first, so that from the moment
// the uid is matched at all its traffic is either redirected or refused.
func Install(ctx context.Context, r Rules) error {
	if r.Port == 0 {
		return errors.New("redirect: port 0: want the transparent listener's port")
	}
	for _, d := range r.DNS {
		if !d.IsValid() || d.Port() == 0 {
			return fmt.Errorf("redirect: resolver %q: want an address and a port", d)
		}
	}
	fams, err := available()
	if err != nil {
		return err
	}
	for _, f := range fams {
		if err := f.run(ctx, f.restore, []string{"-w", lockWait, "--noflush"}, RestoreInput(r, f.v6)); err != nil {
			return fmt.Errorf("redirect uid %d to port %d (%s): %w", r.UID, r.Port, f.name, err)
		}
		for _, table := range []string{"filter", "nat"} {
			if err := f.ensureJump(ctx, table, r.UID); err != nil {
				return fmt.Errorf("redirect uid %d to port %d (%s): %w", r.UID, r.Port, f.name, err)
			}
		}
	}
	return nil
}

// Remove takes uid's rules away: the redirect first, so that until the end
// the uid's connections are refused rather than let through. Removing rules
// that are not there is not an error.
func Remove(ctx context.Context, uid uint32) error {
	fams, err := available()
	if err != nil {
		return err
	}
	var errs []error
	for _, f := range fams {
		for _, table := range []string{"nat", "filter"} {
			if err := f.removeTable(ctx, table, uid); err != nil {
				errs = append(errs, fmt.Errorf("remove the redirect of uid %d (%s, %s table): %w", uid, f.name, table, err))
			}
		}
	}
	return errors.Join(errs...)
}

// Installed reports the port uid is redirected to (IPv4 rules), if any.
func Installed(ctx context.Context, uid uint32) (port uint16, ok bool, err error) {
	fams, err := available()
	if err != nil {
		return 0, false, err
	}
	// The whole table: asking for a chain that is not there is an error
	// whose wording differs between iptables backends.
	out, err := fams[0].output(ctx, "-w", lockWait, "-t", "nat", "-S")
	if err != nil {
		return 0, false, err
	}
	prefix := "-A " + ChainName(uid) + " "
	for _, line := range strings.Split(out, "\n") {
		if !strings.HasPrefix(line, prefix) {
			continue
		}
		if _, p, found := strings.Cut(line, "--to-ports "); found {
			n, err := strconv.ParseUint(strings.Fields(p)[0], 10, 16)
			if err != nil {
				return 0, false, fmt.Errorf("redirect rule %q: %w", line, err)
			}
			return uint16(n), true, nil
		}
	}
	return 0, false, nil
}

// RestoreInput is the iptables-restore input that (re)writes uid's chains:
// declaring a chain under --noflush empties it, so the chain is replaced in
// one commit per table.
func RestoreInput(r Rules, v6 bool) string {
	chain := ChainName(r.UID)
	reject := "REJECT --reject-with icmp-port-unreachable"
	if v6 {
		reject = "REJECT --reject-with icmp6-port-unreachable"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "*filter\n:%s - [0:0]\n", chain)
	// DNS to the resolvers named, so that names resolve; everything else
	// but TCP is refused. Each family gets its own family's resolvers.
	for _, d := range r.DNS {
		if a := d.Addr().Unmap(); a.Is4() != v6 {
			fmt.Fprintf(&b, "-A %s -d %s -p udp --dport %d -j ACCEPT\n", chain, a, d.Port())
		}
	}
	// TCP the nat chain redirected to the listener.
	fmt.Fprintf(&b, "-A %s -p tcp -m conntrack --ctstate DNAT -j ACCEPT\n", chain)
	// Answers on connections others opened to the uid (its own servers).
	fmt.Fprintf(&b, "-A %s -m conntrack --ctstate ESTABLISHED,RELATED --ctdir REPLY -j ACCEPT\n", chain)
	fmt.Fprintf(&b, "-A %s -j %s\n", chain, reject)
	b.WriteString("COMMIT\n")
	fmt.Fprintf(&b, "*nat\n:%s - [0:0]\n", chain)
	fmt.Fprintf(&b, "-A %s -p tcp -j REDIRECT --to-ports %d\n", chain, r.Port)
	b.WriteString("COMMIT\n")
	return b.String()
}

// JumpSpec is the OUTPUT rule that sends uid's packets to its chain.
func JumpSpec(uid uint32) []string {
	u := strconv.FormatUint(uint64(uid), 10)
	return []string{"OUTPUT", "-m", "owner", "--uid-owner", u, "-m", "comment", "--comment", "stopgate redirect uid " + u, "-j", ChainName(uid)}
}

func (f family) ensureJump(ctx context.Context, table string, uid uint32) error {
	spec := JumpSpec(uid)
	err := f.run(ctx, f.name, append([]string{"-w", lockWait, "-t", table, "-C"}, spec...), "")
	if err == nil {
		return nil
	}
	if !isNoRule(err) {
		return err
	}
	// First in OUTPUT, before any rule that would accept the uid's packets.
	return f.run(ctx, f.name, append([]string{"-w", lockWait, "-t", table, "-I", spec[0], "1"}, spec[1:]...), "")
}

func (f family) removeTable(ctx context.Context, table string, uid uint32) error {
	spec := JumpSpec(uid)
	// Every copy of the jump (a hand-made duplicate included), bounded.
	for range 16 {
		err := f.run(ctx, f.name, append([]string{"-w", lockWait, "-t", table, "-D"}, spec...), "")
		if err != nil {
			if isNoRule(err) || isNoChain(err) {
				break
			}
			return err
		}
	}
	for _, op := range []string{"-F", "-X"} {
		if err := f.run(ctx, f.name, []string{"-w", lockWait, "-t", table, op, ChainName(uid)}, ""); err != nil && !isNoChain(err) {
			return err
		}
	}
	return nil
}

// cmdError is a failed iptables command with what it said.
type cmdError struct {
	cmd    string
	code   int
	stderr string
}

func (e *cmdError) Error() string {
	return fmt.Sprintf("%s exited %d: %s", e.cmd, e.code, strings.TrimSpace(e.stderr))
}

func (f family) run(ctx context.Context, bin string, args []string, stdin string) error {
	_, err := f.exec(ctx, bin, args, stdin)
	return err
}

func (f family) output(ctx context.Context, args ...string) (string, error) {
	return f.exec(ctx, f.name, args, "")
}

func (f family) exec(ctx context.Context, bin string, args []string, stdin string) (string, error) {
	path, err := exec.LookPath(bin)
	if err != nil {
		return "", fmt.Errorf("%w: %s is not in PATH (install the iptables package; run as root, whose PATH has /usr/sbin)", ErrNoIptables, bin)
	}
	cmd := exec.CommandContext(ctx, path, args...)
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	if err == nil {
		return stdout.String(), nil
	}
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return "", fmt.Errorf("%s: %w", bin, err)
	}
	ce := &cmdError{cmd: bin + " " + strings.Join(args, " "), code: ee.ExitCode(), stderr: stderr.String()}
	if NotPermitted(ce.stderr) {
		return "", fmt.Errorf("%w (run as root, or with CAP_NET_ADMIN): %w", ErrNotPermitted, ce)
	}
	return "", ce
}

// NotPermitted reports whether an iptables command's standard error says
// the caller lacks the privilege.
func NotPermitted(stderr string) bool {
	s := strings.ToLower(stderr)
	return strings.Contains(s, "permission denied") || strings.Contains(s, "operation not permitted") || strings.Contains(s, "you must be root")
}

// isNoRule: -C or -D of a rule that is not there (exit 1, "does a matching
// rule exist", or "Bad rule" on older versions).
func isNoRule(err error) bool {
	var ce *cmdError
	if !errors.As(err, &ce) {
		return false
	}
	s := strings.ToLower(ce.stderr)
	return ce.code == 1 && (strings.Contains(s, "does a matching rule exist") || strings.Contains(s, "bad rule") || strings.Contains(s, "no chain/target/match") || strings.TrimSpace(s) == "")
}

// isNoChain: a chain that is not there.
func isNoChain(err error) bool {
	var ce *cmdError
	if !errors.As(err, &ce) {
		return false
	}
	s := strings.ToLower(ce.stderr)
	return strings.Contains(s, "no chain") || strings.Contains(s, "does not exist") || strings.Contains(s, "couldn't load target")
}

// available returns the families to install: IPv4 always, IPv6 when the
// namespace has it. IPv6 up without ip6tables is an error, not a gap.
func available() ([]family, error) {
	if _, err := exec.LookPath(families[0].name); err != nil {
		return nil, fmt.Errorf("%w: iptables is not in PATH (install the iptables package; run as root, whose PATH has /usr/sbin)", ErrNoIptables)
	}
	if !ipv6Up() {
		return families[:1], nil
	}
	for _, bin := range []string{families[1].name, families[1].restore} {
		if _, err := exec.LookPath(bin); err != nil {
			return nil, fmt.Errorf("%w: IPv6 is up in this network namespace but %s is not in PATH: the uid's IPv6 traffic would go around the guard", ErrNoIptables, bin)
		}
	}
	return families, nil
}

// ipv6Up reports whether this network namespace has any IPv6 address.
func ipv6Up() bool {
	b, err := os.ReadFile("/proc/net/if_inet6")
	return err == nil && len(bytes.TrimSpace(b)) > 0
}

// ResolvConf is where the system's resolvers are named.
const ResolvConf = "/etc/resolv.conf"

// Resolvers reads the nameserver lines of a resolv.conf file, each at port
// 53. A file that names none is an error: with no resolver, nothing would
// resolve, and the caller should say so rather than refuse all DNS.
func Resolvers(path string) ([]netip.AddrPort, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading the resolvers: %w", err)
	}
	var out []netip.AddrPort
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || f[0] != "nameserver" {
			continue
		}
		// A link-local IPv6 resolver may carry a zone (fe80::1%eth0).
		host, _, _ := strings.Cut(f[1], "%")
		a, err := netip.ParseAddr(host)
		if err != nil {
			continue
		}
		out = append(out, netip.AddrPortFrom(a.Unmap(), 53))
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s names no nameserver: give the resolvers to use (--dns)", path)
	}
	return out, nil
}

// ParseResolver reads a resolver as --dns gives it: an address, with an
// optional port (53 when none).
func ParseResolver(s string) (netip.AddrPort, error) {
	if ap, err := netip.ParseAddrPort(s); err == nil {
		if ap.Port() == 0 {
			return netip.AddrPort{}, fmt.Errorf("resolver %q: port 0", s)
		}
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), nil
	}
	a, err := netip.ParseAddr(strings.TrimSuffix(strings.TrimPrefix(s, "["), "]"))
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("resolver %q: want an IP address, optionally with :PORT", s)
	}
	return netip.AddrPortFrom(a.Unmap(), 53), nil
}
