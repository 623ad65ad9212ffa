package proxy

import (
	"context"
	"errors"
	"net/netip"
	"strings"
	"testing"

	"github.com/stopgate/stopgate/policy"
	"github.com/stopgate/stopgate/refusal"
)

// fixedResolver resolves the names in m, and nothing else.
func fixedResolver(m map[string][]string) func(context.Context, string) ([]netip.Addr, error) {
	return func(_ context.Context, host string) ([]netip.Addr, error) {
		list, ok := m[host]
		if !ok {
			return nil, errors.New("no such host")
		}
		out := make([]netip.Addr, len(list))
		for i, s := range list {
			out[i] = netip.MustParseAddr(s)
		}
		return out, nil
	}
}

func TestDestinationRules(t *testing.T) {
	names := fixedResolver(map[string][]string{
		"api.example.com":          {"93.184.216.34"},
		"metadata.google.internal": {"169.254.169.254"},
		"rebind.example.com":       {"93.184.216.34", "10.1.2.3"},
		"internal.corp":            {"10.9.9.9"},
		"wiki.corp":                {"10.9.9.10"},
		"redis.internal":           {"10.20.0.5"},
		"nat64.example.com":        {"64:ff9b::a9fe:a9fe"},
		"v6.example.com":           {"2606:4700::6810:84e5"},
	})
	d, err := newDestinations(context.Background(), destinationRules{
		allow: []string{"internal.corp", "*.corp", "10.20.0.0/16", "127.0.0.1:9000", "fd00::/8"},
		deny:  []string{"wiki.corp", "10.20.0.9", "evil.example.com"},
		protected: []Protected{
			{Addr: "127.0.0.1:8081", What: "control API"},
			{Addr: "0.0.0.0:8082", What: "browser guard"},
			{Addr: "redis.internal:6379", What: "store"},
		},
		resolve: names,
		local:   []netip.Addr{netip.MustParseAddr("192.0.2.7")},
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		dest string
		// want is "" for allowed, else a word of the refusal's message.
		want string
	}{
		{"api.example.com:443", ""},
		{"93.184.216.34:80", ""},
		{"[2606:4700::6810:84e5]:443", ""},
		{"v6.example.com:443", ""},
		// Never: link-local and metadata, whatever resolves to them, however written.
		{"169.254.169.254:80", "link-local"},
		{"metadata.google.internal:80", "link-local"},
		{"[fe80::1]:80", "link-local"},
		{"[fe80::1%25eth0]:80", "link-local"},
		{"[fd00:ec2::254]:80", "link-local"},
		{"[::ffff:169.254.169.254]:80", "link-local"},
		{"nat64.example.com:80", "embeds 169.254.169.254"},
		{"[2002:a9fe:a9fe::1]:80", "embeds 169.254.169.254"},
		// Never: stopgate's own listeners and its store, even inside an allowed range.
		{"127.0.0.1:8081", "control API"},
		{"0.0.0.0:8081", "control API"},
		{"127.0.0.1:8082", "browser guard"},
		{"127.0.0.2:8082", "browser guard"},
		{"[::1]:8082", "browser guard"},
		{"192.0.2.7:8082", "browser guard"},
		{"192.0.2.7:8083", ""},
		{"redis.internal:6379", "store"},
		{"REDIS.internal.:6379", "store"},
		{"10.20.0.5:6379", "store"},
		// Default: loopback, private and special-purpose ranges.
		{"127.0.0.1:80", "loopback, private"},
		{"localhost.:80", "no such host"},
		{"10.0.0.1:443", "loopback, private"},
		{"172.16.3.4:443", "loopback, private"},
		{"192.168.1.1:443", "loopback, private"},
		{"100.64.0.1:443", "loopback, private"},
		{"0.0.0.0:80", "loopback, private"},
		{"[::1]:80", "loopback, private"},
		{"[::]:80", "loopback, private"},
		{"[fc00::1]:80", "loopback, private"},
		{"[::ffff:10.0.0.1]:80", "loopback, private"},
		{"224.0.0.1:80", "loopback, private"},
		{"rebind.example.com:443", "resolves to 10.1.2.3"},
		// Allowed: by name (whatever it resolves to), by address, by address and port.
		{"internal.corp:443", ""},
		{"10.20.1.1:5432", ""},
		{"127.0.0.1:9000", ""},
		{"127.0.0.1:9001", "loopback, private"},
		{"[fd12::1]:80", ""},
		// Deny wins over allow.
		{"wiki.corp:443", "destinations.deny"},
		{"10.20.0.9:80", "destinations.deny"},
		{"evil.example.com:443", "destinations.deny"},
		// Not a destination at all.
		{"api.example.com", "not host:port"},
		{"api.example.com:0", "not host:port"},
	} {
		t.Run(tc.dest, func(t *testing.T) {
			var got target
			err := d.check(context.Background(), tc.dest, &got)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.want == "" && len(got.addrs) == 0:
				t.Fatalf("allowed without an address to dial: %+v", got)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("got %+v %v, want a refusal saying %q", got, err, tc.want)
			}
			var r *refusal.Refusal
			if err != nil && !errors.Is(err, errUnresolved) && errors.As(err, &r) && r.Code != refusal.DestinationDenied && r.Code != refusal.InvalidRequest {
				t.Fatalf("refused with %s", r.Code)
			}
		})
	}
}

func TestLinkLocalCannotBeAllowed(t *testing.T) {
	for _, allow := range []string{"169.254.169.254", "169.254.0.0/16", "fe80::/16", "fd00:ec2::254"} {
		if err := CheckDestinationRules([]string{allow}, nil); err == nil || !strings.Contains(err.Error(), "never reachable") {
			t.Errorf("allow %s: %v, want an error saying it is never reachable", allow, err)
		}
	}
	// A wider range is not an error: it allows what it can, and link-local stays refused.
	d, err := newDestinations(context.Background(), destinationRules{allow: []string{"0.0.0.0/0", "::/0"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, dest := range []string{"169.254.169.254:80", "[fe80::1]:80"} {
		if err := d.check(context.Background(), dest, new(target)); err == nil {
			t.Errorf("%s allowed by an allow-everything rule", dest)
		}
	}
	if err := d.check(context.Background(), "10.0.0.1:80", new(target)); err != nil {
		t.Errorf("allow-everything refused a private address: %v", err)
	}
}

// FuzzDestinationCheck: whatever the rules and the destination, the check
// never panics, never allows a link-local or metadata address (written any
// way, or embedded), never allows stopgate's own addresses, and deny wins:
// an allowed destination is one no deny rule matches.
func FuzzDestinationCheck(f *testing.F) {
	for _, seed := range [][3]string{
		{"127.0.0.1", "", "127.0.0.1:80"},
		{"0.0.0.0/0", "", "169.254.169.254:80"},
		{"::/0", "", "[::ffff:169.254.169.254]:80"},
		{"::/0", "", "[64:ff9b::a9fe:a9fe]:80"},
		{"::/0", "", "[2002:a9fe:a9fe::]:80"},
		{"0.0.0.0/0", "", "0.0.0.0:8081"},
		{"0.0.0.0/0", "10.0.0.0/8", "10.1.1.1:443"},
		{"*.corp", "x.corp", "x.corp:443"},
		{"x.corp:443", "", "x.corp:443"},
		{"", "", "[fe80::1%eth0]:80"},
		{"fd00::/8", "", "[fd00:ec2::254]:80"},
		{"127.0.0.1:8081", "", "127.0.0.1:8081"},
	} {
		f.Add(seed[0], seed[1], seed[2])
	}
	never := prefixes("169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128")
	f.Fuzz(func(t *testing.T, allow, deny, dest string) {
		resolve := func(_ context.Context, host string) ([]netip.Addr, error) {
			// Every name resolves to an address made of its own bytes, so
			// that the fuzzer reaches every range through names as well.
			var b [16]byte
			copy(b[:], host)
			a := netip.AddrFrom16(b)
			if len(host)%2 == 0 {
				a = netip.AddrFrom4([4]byte{b[0], b[1], b[2], b[3]})
			}
			return []netip.Addr{a}, nil
		}
		d, err := newDestinations(context.Background(), destinationRules{
			allow: []string{allow}, deny: []string{deny}, resolve: resolve,
			protected: []Protected{{Addr: "127.0.0.1:8081", What: "control API"}, {Addr: "[::]:8082", What: "browser guard"}},
		})
		if err != nil {
			return
		}
		var got target
		if err := d.check(context.Background(), dest, &got); err != nil {
			return
		}
		for _, ap := range got.addrs {
			a := ap.Addr()
			if a.Zone() != "" || a.Is4In6() {
				t.Fatalf("%s allowed as %s: not the canonical form the rules read", dest, a)
			}
			for _, addr := range []netip.Addr{a, embedded(a)} {
				for _, p := range never {
					if p.Contains(addr) {
						t.Fatalf("allow %q deny %q: %s allowed, dialling %s in %s", allow, deny, dest, a, p)
					}
				}
			}
			if ap.Port() == 8081 && (a == netip.MustParseAddr("127.0.0.1") || a.IsUnspecified()) || ap.Port() == 8082 && (a.IsLoopback() || a.IsUnspecified()) {
				t.Fatalf("allow %q: %s allowed, dialling stopgate's own %s", allow, dest, ap)
			}
			if r, err := policy.ParseDestinationRule(deny); err == nil && r.Host == "" && r.Prefix.Contains(a) && (r.Port == 0 || r.Port == ap.Port()) {
				t.Fatalf("deny %q, allow %q: %s allowed", deny, allow, ap)
			}
		}
	})
}

func embedded(a netip.Addr) netip.Addr {
	if in, ok := embeddedIPv4(a); ok {
		return in
	}
	return a
}

// TestCheckKeepsEveryAddressToDial: a checked name is dialled at every
// address it resolved to, in order, and a copy of its target (the dial's)
// reads the same ones; checking again replaces what a target held.
func TestCheckKeepsEveryAddressToDial(t *testing.T) {
	d, err := newDestinations(context.Background(), destinationRules{resolve: fixedResolver(map[string][]string{
		"one.example.com": {"93.184.216.34"},
		"two.example.com": {"93.184.216.34", "2606:4700::6810:84e5"},
	})})
	if err != nil {
		t.Fatal(err)
	}
	want := func(t *testing.T, got target, hostport string, addrs ...string) {
		t.Helper()
		if got.hostport != hostport || len(got.addrs) != len(addrs) {
			t.Fatalf("checked %+v, want %s at %v", got, hostport, addrs)
		}
		for i, a := range addrs {
			if got.addrs[i] != netip.MustParseAddrPort(a) {
				t.Fatalf("checked %+v, want %s at %v", got, hostport, addrs)
			}
		}
	}
	var dest target
	if err := d.check(context.Background(), "two.example.com:443", &dest); err != nil {
		t.Fatal(err)
	}
	copied := dest
	want(t, copied, "two.example.com:443", "93.184.216.34:443", "[2606:4700::6810:84e5]:443")
	if err := d.check(context.Background(), "one.example.com:80", &dest); err != nil {
		t.Fatal(err)
	}
	want(t, dest, "one.example.com:80", "93.184.216.34:80")
	if err := d.check(context.Background(), "nowhere.example.com:80", &dest); !errors.Is(err, errUnresolved) || dest.addrs != nil {
		t.Fatalf("an unresolved name: %+v %v, want no address to dial and errUnresolved", dest, err)
	}
}

// TestAllowListDefaultsAndReportRules: with destinations.default deny only
// what an allow rule covers is reachable; with report, what deny would
// refuse goes on, named as would_deny; a report rule is a deny in dry run,
// and neither ever opens what the default refuses (private ranges) or
// what nobody may reach.
func TestAllowListDefaultsAndReportRules(t *testing.T) {
	names := fixedResolver(map[string][]string{
		"api.openai.com":        {"162.159.140.245"},
		"uploads.example.com":   {"93.184.216.34"},
		"elsewhere.example.com": {"203.0.113.9"},
		"internal.corp":         {"10.9.9.9"},
	})
	for _, tc := range []struct {
		name      string
		byDefault policy.DestinationDefault
		dest      string
		// want is "" for allowed, else a word of the refusal's message;
		// would is the report rule named, "" for none.
		want, would string
	}{
		{"open: unlisted public", policy.DefaultAllow, "elsewhere.example.com:443", "", ""},
		{"open: unlisted private", policy.DefaultAllow, "10.1.1.1:443", "loopback, private", ""},
		{"open: report rule", policy.DefaultAllow, "uploads.example.com:443", "", "destinations.report"},
		{"open: report by address", policy.DefaultAllow, "93.184.216.40:443", "", "destinations.report (93.184.216.0/24)"},
		{"enforce: listed", policy.DefaultDeny, "api.openai.com:443", "", ""},
		{"enforce: listed private", policy.DefaultDeny, "internal.corp:443", "", ""},
		{"enforce: unlisted", policy.DefaultDeny, "elsewhere.example.com:443", "destinations.default is deny", ""},
		{"enforce: unlisted address", policy.DefaultDeny, "1.1.1.1:443", "destinations.default is deny", ""},
		{"enforce: listed but reported", policy.DefaultDeny, "uploads.example.com:443", "destinations.default is deny", ""},
		{"enforce: deny beats allow", policy.DefaultDeny, "api.openai.com:80", "destinations.deny", ""},
		{"report: listed", policy.DefaultReport, "api.openai.com:443", "", ""},
		{"report: unlisted", policy.DefaultReport, "elsewhere.example.com:443", "", "destinations.default (report)"},
		{"report: unlisted private stays refused", policy.DefaultReport, "10.1.1.1:443", "loopback, private", ""},
		{"report: never reachable stays refused", policy.DefaultReport, "169.254.169.254:80", "link-local", ""},
		{"report: deny stays enforced", policy.DefaultReport, "api.openai.com:80", "destinations.deny", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, err := newDestinations(context.Background(), destinationRules{
				allow:     []string{"api.openai.com", "internal.corp"},
				deny:      []string{"162.159.140.245:80"},
				report:    []string{"uploads.example.com", "93.184.216.0/24"},
				byDefault: tc.byDefault,
				resolve:   names,
			})
			if err != nil {
				t.Fatal(err)
			}
			var got target
			err = d.check(context.Background(), tc.dest, &got)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("got %+v %v, want a refusal saying %q", got, err, tc.want)
			case tc.want == "" && got.wouldDeny != tc.would:
				t.Fatalf("would_deny %q, want %q", got.wouldDeny, tc.would)
			}
		})
	}
	if _, err := newDestinations(context.Background(), destinationRules{byDefault: "block"}); err == nil || !strings.Contains(err.Error(), "want allow, deny or report") {
		t.Fatalf("a default that is no mode: %v", err)
	}
}
