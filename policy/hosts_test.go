package policy_test

import (
	"strings"
	"testing"

	"github.com/stopgate/stopgate/policy"
)

func TestHostSetMatches(t *testing.T) {
	for _, tc := range []struct {
		pattern  string
		hostport string
		want     bool
	}{
		{"api.openai.com", "api.openai.com:443", true},
		{"api.openai.com", "api.openai.com.:443", true},
		{"api.openai.com.", "API.OPENAI.COM:443", true},
		{"api.openai.com", "api.openai.com", true},
		{"api.openai.com", "xapi.openai.com:443", false},
		{"api.example.com:8443", "api.example.com:8443", true},
		{"api.example.com:8443", "api.example.com.:8443", true},
		{"api.example.com:8443", "api.example.com:443", false},
		{"api.example.com:8443", "api.example.com", false},
		{"*.example.com", "a.b.example.com:443", true},
		{"*.example.com", "a.example.com.:443", true},
		{"*.example.com", "example.com:443", false},
		{"*.example.com", "badexample.com:443", false},
		// A wildcard with a port is that port only.
		{"*.example.com:8443", "a.example.com:8443", true},
		{"*.example.com:8443", "a.example.com:443", false},
		// Addresses compare in their canonical form.
		{"127.0.0.1:8443", "127.0.0.1:8443", true},
		{"[::1]:8443", "[0:0::1]:8443", true},
		{"::1", "[::1]:80", true},
		{"10.0.0.1", "[::ffff:10.0.0.1]:80", true},
	} {
		set, err := policy.NewHostSet([]string{tc.pattern})
		if err != nil {
			t.Fatalf("%q: %v", tc.pattern, err)
		}
		if got := set.Match(tc.hostport); got != tc.want {
			t.Errorf("%q matches %q: %v, want %v", tc.pattern, tc.hostport, got, tc.want)
		}
	}
}

// TestHostPatternsHaveOneGrammar: every list that names hosts in the
// policy file — pass_through, delivery, effects, the destination rules,
// lookups — refuses the same entries, with the same words.
func TestHostPatternsHaveOneGrammar(t *testing.T) {
	lookup := func(host string) string {
		return "lookups:\n  - {host: " + host + ", url: \"https://x.example/{key}\", applied: [200], not_applied: [404]}\n"
	}
	lists := map[string]func(string) string{
		"pass_through":        func(h string) string { return "pass_through: [" + h + "]\n" },
		"delivery":            func(h string) string { return "delivery: [" + h + "]\n" },
		"effects":             func(h string) string { return "effects: {" + h + ": none}\n" },
		"destinations.allow":  func(h string) string { return "destinations: {allow: [" + h + "]}\n" },
		"destinations.deny":   func(h string) string { return "destinations: {deny: [" + h + "]}\n" },
		"destinations.report": func(h string) string { return "destinations: {report: [" + h + "]}\n" },
		"lookups":             lookup,
	}
	for _, bad := range []string{`"a*b.example.com"`, `"*"`, `"api.example.com:0"`, `"10.0.0.1."`, `"https://api.example.com"`, `"api example.com"`} {
		for field, doc := range lists {
			_, err := policy.Parse([]byte(doc(bad)))
			if err == nil {
				t.Errorf("%s: %s accepted", field, bad)
				continue
			}
			if !strings.Contains(err.Error(), field) {
				t.Errorf("%s: %s refused without naming the field: %v", field, bad, err)
			}
		}
	}
	for _, good := range []string{"api.example.com", "api.example.com.", "api.example.com:8443", `"*.example.com"`, `"*.example.com:8443"`, "_svc.example.com"} {
		for field, doc := range lists {
			if _, err := policy.Parse([]byte(doc(good))); err != nil {
				t.Errorf("%s: %s refused: %v", field, good, err)
			}
		}
	}
}
