package redirect_test

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stopgate/stopgate/redirect"
)

func TestRestoreInputIsTheRulesOfOneUID(t *testing.T) {
	dns := []netip.AddrPort{netip.MustParseAddrPort("10.0.0.2:53"), netip.MustParseAddrPort("[fd00::53]:5353")}
	got := redirect.RestoreInput(redirect.Rules{UID: 65534, Port: 15001, DNS: dns}, false)
	for _, line := range []string{
		"*filter\n:STOPGATE-U65534 - [0:0]\n",
		"-A STOPGATE-U65534 -d 10.0.0.2 -p udp --dport 53 -j ACCEPT\n",
		"-A STOPGATE-U65534 -p tcp -m conntrack --ctstate DNAT -j ACCEPT\n",
		"-A STOPGATE-U65534 -j REJECT --reject-with icmp-port-unreachable\nCOMMIT\n",
		"*nat\n:STOPGATE-U65534 - [0:0]\n-A STOPGATE-U65534 -p tcp -j REDIRECT --to-ports 15001\nCOMMIT\n",
	} {
		if !strings.Contains(got, line) {
			t.Errorf("restore input lacks %q:\n%s", line, got)
		}
	}
	// No rule lets UDP to port 53 of any address out: only the resolvers named.
	if strings.Contains(got, "-A STOPGATE-U65534 -p udp") || strings.Contains(got, "fd00::53") {
		t.Errorf("IPv4 rules let UDP out beyond the IPv4 resolver:\n%s", got)
	}
	v6 := redirect.RestoreInput(redirect.Rules{UID: 7, Port: 1, DNS: dns}, true)
	if !strings.Contains(v6, "icmp6-port-unreachable") {
		t.Errorf("IPv6 rules reject with an IPv4 ICMP type:\n%s", v6)
	}
	if !strings.Contains(v6, "-A STOPGATE-U7 -d fd00::53 -p udp --dport 5353 -j ACCEPT\n") || strings.Contains(v6, "10.0.0.2") {
		t.Errorf("IPv6 rules do not name the IPv6 resolver alone:\n%s", v6)
	}
	if got := strings.Join(redirect.JumpSpec(65534), " "); got != `OUTPUT -m owner --uid-owner 65534 -m comment --comment stopgate redirect uid 65534 -j STOPGATE-U65534` {
		t.Errorf("jump: %s", got)
	}
}

func TestMissingIptablesIsAClearError(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	for name, err := range map[string]error{
		"install": redirect.Install(t.Context(), redirect.Rules{UID: 65534, Port: 15001}),
		"remove":  redirect.Remove(t.Context(), 65534),
	} {
		if !errors.Is(err, redirect.ErrNoIptables) || !strings.Contains(err.Error(), "install the iptables package") {
			t.Errorf("%s without iptables: %v", name, err)
		}
	}
}

func TestNotPermittedReadsIptablesOwnWords(t *testing.T) {
	for stderr, want := range map[string]bool{
		"iptables v1.8.9 (nf_tables): Could not fetch rule set generation id: Permission denied (you must be root)\n": true,
		"iptables v1.8.7 (legacy): can't initialize iptables table `nat': Permission denied (you must be root)\n":     true,
		"iptables: Bad rule (does a matching rule exist in that chain?).\n":                                           false,
	} {
		if got := redirect.NotPermitted(stderr); got != want {
			t.Errorf("NotPermitted(%q) = %v", stderr, got)
		}
	}
}

func TestResolversAreTheNameserversOfResolvConf(t *testing.T) {
	path := filepath.Join(t.TempDir(), "resolv.conf")
	if err := os.WriteFile(path, []byte("# generated\nsearch example.internal\nnameserver 10.255.255.53\nnameserver fe80::1%eth0\nnameserver ::ffff:127.0.0.53\nnameserver not-an-address\noptions ndots:5\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	got, err := redirect.Resolvers(path)
	want := []netip.AddrPort{netip.MustParseAddrPort("10.255.255.53:53"), netip.MustParseAddrPort("[fe80::1]:53"), netip.MustParseAddrPort("127.0.0.53:53")}
	if err != nil || len(got) != len(want) {
		t.Fatalf("resolvers: %v %v", got, err)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("resolver %d: %v, want %v", i, got[i], want[i])
		}
	}
	if err := os.WriteFile(path, []byte("search x\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := redirect.Resolvers(path); err == nil || !strings.Contains(err.Error(), "--dns") {
		t.Errorf("a resolv.conf without nameserver: %v", err)
	}
	for in, want := range map[string]string{"127.0.0.1": "127.0.0.1:53", "127.0.0.1:5353": "127.0.0.1:5353", "[::1]:53": "[::1]:53", "::1": "[::1]:53"} {
		if got, err := redirect.ParseResolver(in); err != nil || got.String() != want {
			t.Errorf("ParseResolver(%q) = %v %v, want %s", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "dns.example", "127.0.0.1:0", "1.2.3.4:x"} {
		if _, err := redirect.ParseResolver(bad); err == nil {
			t.Errorf("ParseResolver(%q) accepted", bad)
		}
	}
}
