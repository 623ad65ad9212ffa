package policy_test

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/policy"
)

func TestParseReadsEveryRule(t *testing.T) {
	t.Setenv("HOOK_SECRET", "s3cret")
	t.Setenv("PROVIDER_TOKEN", "tok")
	p, err := policy.Parse([]byte(`
pass_through: ["*.googleapis.com"]
delivery: [hooks.example.com]
webhooks:
  stripe: {secret_env: HOOK_SECRET}
  ops: {secret: plain}
lookups:
  - host: api.provider.test
    url: https://api.provider.test/v1/idempotency/{key}?run={run}
    headers: {Authorization: "Bearer ${PROVIDER_TOKEN}"}
    applied: [200]
    not_applied: [404]
    interval: 2s
`))
	if err != nil {
		t.Fatal(err)
	}
	if s, ok := p.Secret("stripe"); !ok || string(s) != "s3cret" {
		t.Fatalf("secret from env: %q %v", s, ok)
	}
	if s, ok := p.Secret("ops"); !ok || string(s) != "plain" {
		t.Fatalf("inline secret: %q %v", s, ok)
	}
	if _, ok := p.Secret("nobody"); ok {
		t.Fatal("an unconfigured source has a secret")
	}
	l := p.Lookups[0]
	if got := l.LookupURL("run 1", "k/1"); got != "https://api.provider.test/v1/idempotency/k%2F1?run=run%201" {
		t.Fatalf("lookup url %q", got)
	}
	if l.HeaderValues()["Authorization"] != "Bearer tok" || l.Interval.Duration != 2*time.Second {
		t.Fatalf("lookup %+v", l)
	}
}

func TestParseRejectsBadPolicies(t *testing.T) {
	for _, tc := range []struct{ doc, want string }{
		{"pass_thru: [x]", "field pass_thru not found"},
		{"delivery: [\"https://x/y\"]", "not a host"},
		{"webhooks: {s: {}}", "exactly one of secret and secret_env"},
		{"webhooks: {s: {secret_env: STOPGATE_TEST_UNSET_VAR}}", "is empty"},
		{"lookups: [{host: a, url: 'ftp://a/{key}', applied: [200], not_applied: [404]}]", "not an http(s) URL"},
		{"lookups: [{host: a, url: 'https://a/x', applied: [200], not_applied: [404]}]", "must contain {key}"},
		{"lookups: [{host: a, url: 'https://a/{key}', applied: [200]}]", "applied and not_applied"},
		{"lookups: [{host: a, url: 'https://a/{key}', applied: [200], not_applied: [200]}]", "both applied and not applied"},
		{"lookups: [{host: a, url: 'https://a/{key}', applied: [200], not_applied: [404], interval: soon}]", "not a positive duration"},
		{"[", "yaml"},
		{"destinations: {allow: [\"https://x/\"]}", "destinations.allow: destination \"https://x/\": a URL"},
		{"destinations: {deny: [10.1.0.0/8]}", "destinations.deny: destination \"10.1.0.0/8\": host bits are set (did you mean 10.0.0.0/8?)"},
		{"destinations: {allow: [\"*\"]}", "a wildcard is only *.domain"},
		{"destinations: {allow: [\"a.example.com:http\"]}", "is not a number from 1 to 65535"},
		{"destinations: {allow: [\"10.0.0.0/8:443\"]}", "not a CIDR"},
		{"destinations: {allow: [\"\"]}", "empty"},
		{"destinations: {permit: [x]}", "field permit not found"},
	} {
		_, err := policy.Parse([]byte(tc.doc))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: got %v, want an error containing %q", tc.doc, err, tc.want)
		}
	}
}

func TestEmptyPathIsTheZeroPolicy(t *testing.T) {
	p, err := policy.Load("")
	if err != nil || len(p.PassThrough)+len(p.Delivery)+len(p.Lookups)+len(p.Webhooks) != 0 {
		t.Fatalf("got %+v %v", p, err)
	}
	if _, err := policy.Load("/nonexistent/stopgate.yaml"); err == nil {
		t.Fatal("a missing file is not an error")
	}
}

// TestShippedExamplePolicyIsValid: the example loads with nothing set in
// the environment (deploy's TestShippedExamplePolicyStartsAsIs starts
// serve with it), and its commented webhook source is valid once its
// variable is set and it is uncommented.
func TestShippedExamplePolicyIsValid(t *testing.T) {
	t.Setenv("STOPGATE_WEBHOOK_PAYMENTS", "")
	p, err := policy.Load("../deploy/stopgate.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if len(p.PassThrough) == 0 || len(p.Delivery) == 0 || len(p.Lookups) == 0 || len(p.Destinations.Allow) == 0 || len(p.Destinations.Deny) == 0 || len(p.Effects) == 0 {
		t.Fatalf("the example should show every rule: %+v", p)
	}
	b, err := os.ReadFile("../deploy/stopgate.yaml")
	if err != nil {
		t.Fatal(err)
	}
	uncommented := strings.NewReplacer("# webhooks:", "webhooks:", "#   payments:", "  payments:", "#     secret_env:", "    secret_env:").Replace(string(b))
	t.Setenv("STOPGATE_WEBHOOK_PAYMENTS", "x")
	if p, err = policy.Parse([]byte(uncommented)); err != nil || len(p.Webhooks) != 1 {
		t.Fatalf("the commented webhook source, uncommented: %+v %v", p.Webhooks, err)
	}
}

func TestEffectsPerDestination(t *testing.T) {
	p, err := policy.Parse([]byte("effects:\n  api.openai.com: none\n  '*.bank.example': all\n  other.example: writes\n"))
	if err != nil {
		t.Fatal(err)
	}
	if got := p.HostsWith(policy.EffectsNone); len(got) != 1 || got[0] != "api.openai.com" {
		t.Errorf("hosts without effects: %v", got)
	}
	if got := p.HostsWith(policy.EffectsAll); len(got) != 1 || got[0] != "*.bank.example" {
		t.Errorf("hosts whose reads are effects: %v", got)
	}
	for _, bad := range []string{"effects:\n  api.example: some\n", "effects:\n  'a b': none\n", "effects:\n  '': none\n"} {
		if _, err := policy.Parse([]byte(bad)); err == nil {
			t.Errorf("accepted %q", bad)
		}
	}
}

func TestDestinationRules(t *testing.T) {
	p, err := policy.Parse([]byte(`
destinations:
  allow: [10.0.0.0/8, "fd00::/8", 127.0.0.1, "127.0.0.1:9000", "[::1]:9000", "::ffff:192.168.0.0/112", internal.corp, "*.svc.cluster.local:8443", "API.Example.COM."]
  deny: [10.9.0.0/16, wiki.internal.corp]
`))
	if err != nil {
		t.Fatal(err)
	}
	allow, err := policy.ParseDestinationRules(p.Destinations.Allow)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, r := range allow {
		got = append(got, r.String())
	}
	want := []string{"10.0.0.0/8", "fd00::/8", "127.0.0.1", "127.0.0.1:9000", "[::1]:9000", "192.168.0.0/16", "internal.corp", "*.svc.cluster.local:8443", "api.example.com"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("allow rules read as %q, want %q", got, want)
	}
	if r := allow[3]; r.Port != 9000 || !r.Prefix.IsSingleIP() || r.Host != "" {
		t.Fatalf("IP:port rule %+v", r)
	}
	if len(p.Destinations.Deny) != 2 {
		t.Fatalf("deny %q", p.Destinations.Deny)
	}
}

// FuzzPolicyParse: whatever the file, Parse answers a policy or an error
// and never panics; a policy it accepts has only destination rules that
// read back to themselves, and parses again the same way.
func FuzzPolicyParse(f *testing.F) {
	for _, seed := range []string{
		"",
		"pass_through: [\"*.googleapis.com\"]\ndelivery: [hooks.example.com]",
		"destinations: {allow: [10.0.0.0/8, \"127.0.0.1:9000\", internal.corp], deny: [10.9.0.0/16]}",
		"destinations: {allow: [\"::ffff:10.0.0.0/104\", \"[::1]:80\", \"*.corp\"]}",
		"webhooks: {ops: {secret: s}}",
		"lookups: [{host: a, url: 'https://a/{key}', applied: [200], not_applied: [404], interval: 2s}]",
		"destinations: {allow: [\"10.1.0.0/8\"]}",
		"[",
		"destinations: [1, 2]",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, doc []byte) {
		p, err := policy.Parse(doc)
		if err != nil {
			return
		}
		for _, list := range [][]string{p.Destinations.Allow, p.Destinations.Deny} {
			rules, err := policy.ParseDestinationRules(list)
			if err != nil {
				t.Fatalf("Parse accepted %q but its rules do not parse: %v", list, err)
			}
			for _, r := range rules {
				again, err := policy.ParseDestinationRule(r.String())
				if err != nil || again != r {
					t.Fatalf("rule %+v reads back from %q as %+v, %v", r, r.String(), again, err)
				}
			}
		}
		if _, err := policy.Parse(doc); err != nil {
			t.Fatalf("the same document parsed once and then failed: %v", err)
		}
	})
}

// TestRuleCountsNameEveryKind: each kind of rule a policy holds is counted
// under its name in RuleKinds, the names a start line and a reload use, so
// a kind added to the policy and not to the count shows here.
func TestRuleCountsNameEveryKind(t *testing.T) {
	one := policy.Policy{
		PassThrough: []string{"a.example"}, Delivery: []string{"b.example"}, Effects: map[string]policy.Effects{"c.example": policy.EffectsNone},
		Lookups: []policy.Lookup{{Host: "d.example"}}, Webhooks: map[string]policy.Webhook{"src": {}},
		Destinations: policy.Destinations{Allow: []string{"10.0.0.0/8"}, Deny: []string{"e.example"}, Report: []string{"f.example"}},
		Budgets:      policy.Budgets{Rules: []policy.BudgetRule{{Name: "ci"}}}, Tripwires: []policy.Tripwire{{Name: "t"}},
		LLM: policy.LLM{Providers: []policy.Provider{{API: "openai"}}, Prices: map[string]policy.ModelPrice{"m*": {}}},
	}
	counts := one.RuleCounts()
	if len(counts) != len(policy.RuleKinds) {
		t.Errorf("RuleCounts has %d kinds, RuleKinds %d", len(counts), len(policy.RuleKinds))
	}
	for _, k := range policy.RuleKinds {
		if counts[k] != 1 {
			t.Errorf("%s: %d, want 1", k, counts[k])
		}
	}
	if got := (policy.Destinations{}).InForce(); got != policy.DefaultAllow {
		t.Errorf("no default: in force %q, want allow", got)
	}
	if got := (policy.Destinations{Default: policy.DefaultReport}).InForce(); got != policy.DefaultReport {
		t.Errorf("default report: in force %q", got)
	}
}
