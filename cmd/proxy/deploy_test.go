package main

import (
	"net/http"
	"strings"
	"testing"

	"github.com/stopgate/stopgate/policy"
)

// The tests of deploy/: the files an operator copies must work as shipped.

// TestShippedExamplePolicyStartsAsIs: deploy/stopgate.yaml loads with the
// policy package and serve starts on it, with nothing set in the
// environment (it used to need STOPGATE_WEBHOOK_PAYMENTS, so it did not).
func TestShippedExamplePolicyStartsAsIs(t *testing.T) {
	const example = "../../deploy/stopgate.yaml"
	t.Setenv("STOPGATE_WEBHOOK_PAYMENTS", "")
	pol, err := policy.Load(example)
	if err != nil {
		t.Fatalf("policy.Load(%s): %v", example, err)
	}
	s := startServe(t, "--data-dir", t.TempDir(), "--config", example)
	resp, err := http.Get(s.control + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/readyz: %d\n%s", resp.StatusCode, s.log())
	}
	if want := "pass_through=1 delivery=2 lookups=1"; !strings.Contains(s.log(), want) || len(pol.Delivery) != 2 {
		t.Fatalf("serve did not start on the example's rules (want %q in its log):\n%s", want, s.log())
	}
}
