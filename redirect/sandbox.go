package redirect

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"path/filepath"
	"strings"
)

// Sandbox are the rules of a network namespace made for one command
// (stopgate exec): every process in it is the command's, so the rules
// match them all, not one uid. Every TCP connection, to any address, goes
// to TCPPort on the namespace's loopback; DNS to a nameserver goes to
// DNSPort; everything else is refused. The namespace has no interface but
// lo, so nothing leaves it but through whoever holds those two sockets.
type Sandbox struct {
	TCPPort uint16
	DNSPort uint16
	// Nameservers are the resolvers the command's resolver library asks
	// (/etc/resolv.conf's); UDP to port 53 of these, and nothing else, is
	// DNS.
	Nameservers []netip.AddrPort
}

// SandboxRestoreInput is the iptables-restore input of s (IPv4: IPv6 is
// switched off in the namespace).
func SandboxRestoreInput(s Sandbox) string {
	var b strings.Builder
	b.WriteString("*nat\n:OUTPUT ACCEPT [0:0]\n")
	fmt.Fprintf(&b, "-A OUTPUT -p tcp -j REDIRECT --to-ports %d\n", s.TCPPort)
	for _, ns := range s.Nameservers {
		if a := ns.Addr().Unmap(); a.Is4() {
			fmt.Fprintf(&b, "-A OUTPUT -d %s -p udp --dport %d -j REDIRECT --to-ports %d\n", a, ns.Port(), s.DNSPort)
		}
	}
	b.WriteString("COMMIT\n*filter\n:OUTPUT ACCEPT [0:0]\n")
	// What the nat table sent to the two sockets; answers on connections
	// made to the command's own servers; nothing else.
	b.WriteString("-A OUTPUT -p tcp -m conntrack --ctstate DNAT -j ACCEPT\n")
	fmt.Fprintf(&b, "-A OUTPUT -p udp -d 127.0.0.1 --dport %d -m conntrack --ctstate DNAT -j ACCEPT\n", s.DNSPort)
	b.WriteString("-A OUTPUT -m conntrack --ctstate ESTABLISHED,RELATED --ctdir REPLY -j ACCEPT\n")
	b.WriteString("-A OUTPUT -j REJECT --reject-with icmp-port-unreachable\nCOMMIT\n")
	return b.String()
}

// InstallSandbox writes s into the current network namespace, which must
// be the command's own: it replaces the nat and filter tables' OUTPUT
// chains. The caller needs CAP_NET_ADMIN there (root of the namespace's
// user namespace will do).
func InstallSandbox(ctx context.Context, s Sandbox) error {
	if s.TCPPort == 0 || s.DNSPort == 0 {
		return errors.New("redirect: sandbox rules need both ports")
	}
	bin, err := sbinLookPath("iptables-restore")
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, bin)
	cmd.Stdin = strings.NewReader(SandboxRestoreInput(s))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		msg := strings.TrimSpace(out.String())
		if NotPermitted(msg) {
			return fmt.Errorf("%w in the sandbox's network namespace (%s): %s", ErrNotPermitted, err, msg)
		}
		return fmt.Errorf("iptables-restore in the sandbox's network namespace: %v: %s", err, msg)
	}
	return nil
}

// sbinLookPath finds an iptables command in PATH, else where Debian keeps
// it (an ordinary user's PATH often lacks /usr/sbin).
func sbinLookPath(bin string) (string, error) {
	if p, err := exec.LookPath(bin); err == nil {
		return p, nil
	}
	for _, dir := range []string{"/usr/sbin", "/sbin"} {
		p := filepath.Join(dir, bin)
		if _, err := exec.LookPath(p); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("%w: %s is not in PATH, /usr/sbin or /sbin (install the iptables package)", ErrNoIptables, bin)
}
