package redirect_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/stopgate/stopgate/redirect"
)

func TestRestoreInputIsTheRulesOfOneUID(t *testing.T) {
	got := redirect.RestoreInput(redirect.Rules{UID: 65534, Port: 15001}, false)
	for _, line := range []string{
		"*filter\n:STOPGATE-U65534 - [0:0]\n",
		"-A STOPGATE-U65534 -p udp --dport 53 -j ACCEPT\n",
		"-A STOPGATE-U65534 -p tcp -m conntrack --ctstate DNAT -j ACCEPT\n",
		"-A STOPGATE-U65534 -j REJECT --reject-with icmp-port-unreachable\nCOMMIT\n",
		"*nat\n:STOPGATE-U65534 - [0:0]\n-A STOPGATE-U65534 -p tcp -j REDIRECT --to-ports 15001\nCOMMIT\n",
	} {
		if !strings.Contains(got, line) {
			t.Errorf("restore input lacks %q:\n%s", line, got)
		}
	}
	if v6 := redirect.RestoreInput(redirect.Rules{UID: 7, Port: 1}, true); !strings.Contains(v6, "icmp6-port-unreachable") {
		t.Errorf("IPv6 rules reject with an IPv4 ICMP type:\n%s", v6)
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
