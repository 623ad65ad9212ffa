package cli

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
)

// The reconciliation and boundary verbs, in-process against a real control
// API over the real embedded store.

const testPEM = "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIBATAKBggqhkjOPQQDAjAA\n-----END CERTIFICATE-----\n"

func newHarnessWithCA(t *testing.T, pem []byte) *harness {
	t.Helper()
	store, err := filestore.Open(filepath.Join(t.TempDir(), "stopgate.db"), filestore.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatalf("open store: %v", err)
	}
	t.Cleanup(func() { _ = store.Close() })
	h, err := control.New(control.Options{Store: store, Token: harnessToken, DrainTimeout: time.Hour, CACertPEM: pem})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &harness{store: store, url: srv.URL, token: harnessToken}
}

// squash collapses the padding of aligned tables, so that checks do not
// depend on the width of the widest field.
func squash(s string) string {
	lines := strings.Split(s, "\n")
	for i, l := range lines {
		lines[i] = strings.Join(strings.Fields(l), " ")
	}
	return strings.Join(lines, "\n")
}

func TestResolveVerb(t *testing.T) {
	h := newHarness(t, "")
	ctx := context.Background()
	h.want(t, []string{"admit", "u1"}, 0, "admitted", "")
	g, err := h.store.Guard(ctx, state.GuardRequest{RunID: "u1", Key: "charge/42", ExplicitKey: true, Boundary: state.BoundaryHTTP,
		Method: "POST", Target: "https://pay.example.com/charges", LeaseOwner: "proxy:test", LeaseTTL: time.Minute, Actor: "proxy:test"})
	if err != nil || !g.Admitted {
		t.Fatalf("guard: %+v %v", g, err)
	}
	h.want(t, []string{"resolve", "u1", "charge/42", "--applied"}, 1, "", "intent_not_unknown")
	h.want(t, []string{"cancel", "u1"}, 0, "CANCELLING", "")
	if _, err := h.store.Finish(ctx, state.FinishRequest{RunID: "u1", Key: "charge/42", Attempt: 1, Outcome: state.IntentUnknown, Actor: "proxy:test"}); err != nil {
		t.Fatal(err)
	}
	h.want(t, []string{"status", "u1"}, 0, "UNKNOWN", "")

	out := h.want(t, []string{"resolve", "u1", "charge/42", "--not-applied", "--note", "no charge at the provider"}, 0,
		"recorded charge/42 of u1 as NOT_APPLIED (source operator)", "")
	for _, s := range []string{"state NOT_APPLIED", "note no charge at the provider", "target https://pay.example.com/charges"} {
		if !strings.Contains(squash(out), s) {
			t.Errorf("resolve output lacks %q:\n%s", s, out)
		}
	}
	h.want(t, []string{"status", "u1"}, 0, "CANCELLED", "")
	out = h.want(t, []string{"audit", "u1"}, 0, "intent.resolved", "")
	if !strings.Contains(out, "cli:tester") || !strings.Contains(out, "operator: no charge at the provider") {
		t.Errorf("audit does not say who resolved it and why:\n%s", out)
	}
	h.want(t, []string{"resolve", "u1", "charge/42", "--applied"}, 1, "", "intent_not_unknown")
	h.want(t, []string{"resolve", "u1", "nope", "--applied"}, 1, "", "no intent nope")

	// --json prints the intent as the API sent it, and --source is recorded.
	h.want(t, []string{"admit", "u2"}, 0, "admitted", "")
	if _, err := h.store.Guard(ctx, state.GuardRequest{RunID: "u2", Key: "k", ExplicitKey: true, Boundary: state.BoundaryCustom,
		LeaseOwner: "w", LeaseTTL: time.Minute}); err != nil {
		t.Fatal(err)
	}
	if _, err := h.store.Finish(ctx, state.FinishRequest{RunID: "u2", Key: "k", Attempt: 1, Outcome: state.IntentUnknown}); err != nil {
		t.Fatal(err)
	}
	out = h.want(t, []string{"resolve", "--json", "--applied", "--source", "provider-console", "u2", "k"}, 0, `"state":"APPLIED"`, "")
	var in state.Intent
	if err := json.Unmarshal([]byte(out), &in); err != nil || in.Source != "provider-console" || strings.Count(out, "\n") != 1 {
		t.Errorf("resolve --json: %v %s", err, out)
	}
}

func TestCAVerb(t *testing.T) {
	h := newHarnessWithCA(t, []byte(testPEM))
	code, out, errOut := h.cli(t, nil, "ca")
	if code != 0 || out != testPEM || errOut != "" {
		t.Fatalf("ca: exit %d\nstdout %q\nstderr %q\nwant the PEM exactly and nothing else", code, out, errOut)
	}
	without := newHarness(t, "")
	without.want(t, []string{"ca"}, 1, "", "no MITM CA")
	h.want(t, []string{"ca", "extra"}, 2, "", "takes no arguments")
	h.want(t, []string{"ca", "--json"}, 2, "", "-json")
}

func TestClaimAndRetryVerbs(t *testing.T) {
	h := newHarness(t, "")
	h.want(t, []string{"admit", "q1"}, 0, "admitted", "")
	out := h.want(t, []string{"claim", "q1", "s1", "--worker", "worker-7", "--lease", "5m", "--version", "1"}, 0,
		"claimed s1 of q1: attempt 1, leased to worker-7 until", "")
	if !strings.Contains(squash(out), "key claim:s1") || !strings.Contains(squash(out), "state IN_FLIGHT") {
		t.Errorf("claim output:\n%s", out)
	}
	h.want(t, []string{"claim", "q1", "s1"}, 1, "", "intent_in_progress")
	out = h.want(t, []string{"claim", "q1", "s2", "--json"}, 0, `"admitted":true`, "")
	var g control.GuardResponse
	if err := json.Unmarshal([]byte(out), &g); err != nil || g.Intent.LeaseOwner != "operator (cli:tester)" {
		t.Errorf("claim --json: %v %s", err, out)
	}
	at := time.Now().Add(time.Hour).UTC().Truncate(time.Second)
	h.want(t, []string{"retry", "q1", "s1", "2", "--at", at.Format(time.RFC3339)}, 0,
		"scheduled attempt 2 of s1 of q1 at "+at.Format(timeLayout)+"; a cancel revokes it", "")
	h.want(t, []string{"claim", "q1", "s3", "--version", "4"}, 1, "", "stale_version")

	h.want(t, []string{"cancel", "q1"}, 0, "CANCELLING", "")
	h.want(t, []string{"claim", "q1", "s3"}, 1, "", "CANCELLED_BEFORE_DISPATCH")
	h.want(t, []string{"retry", "q1", "s1", "3", "--at", at.Format(time.RFC3339)}, 1, "", "run_not_active")
	out = h.want(t, []string{"audit", "q1"}, 0, "retry:s1:2", "")
	for _, s := range []string{"REVOKED", "intent.revoked", "claim:s3"} {
		if !strings.Contains(out, s) {
			t.Errorf("audit lacks %q:\n%s", s, out)
		}
	}
}

func TestBoundaryVerbUsage(t *testing.T) {
	h := newHarness(t, "")
	for _, tc := range []struct {
		args []string
		say  string
	}{
		{[]string{"resolve", "r1"}, "stopgate resolve: missing KEY"},
		{[]string{"resolve", "r1", "k"}, "exactly one of --applied and --not-applied"},
		{[]string{"resolve", "r1", "k", "--applied", "--not-applied"}, "exactly one of --applied and --not-applied"},
		{[]string{"resolve", "r1", "bad key", "--applied"}, "intent key"},
		{[]string{"resolve", "r1", "k", "x", "--applied"}, "want RUN KEY, got 3"},
		{[]string{"claim", "r1"}, "missing STEP"},
		{[]string{"claim", "r1", "s1", "--lease", "soon"}, "lease_ttl: want a duration"},
		{[]string{"claim", "r1", "s1", "--lease", "0"}, "not positive"},
		{[]string{"claim", "r1", "s1", "--version", "-1"}, "--version -1"},
		{[]string{"retry", "r1", "s1"}, "missing ATTEMPT"},
		{[]string{"retry", "r1", "s1", "1"}, "--at is required"},
		{[]string{"retry", "r1", "s1", "0", "--at", "2030-01-01T00:00:00Z"}, `ATTEMPT "0"`},
		{[]string{"retry", "r1", "s1", "1", "--at", "tomorrow"}, `--at "tomorrow"`},
	} {
		code, _, errOut := h.cli(t, nil, tc.args...)
		if code != ExitUsage || !strings.Contains(errOut, tc.say) {
			t.Errorf("stopgate %q: exit %d, stderr %q; want %d saying %q", tc.args, code, errOut, ExitUsage, tc.say)
		}
	}
	for _, verb := range []string{"resolve", "ca", "claim", "retry"} {
		if code, out, _ := h.cli(t, nil, "help", verb); code != 0 || !strings.Contains(out, "Usage: stopgate "+verb) {
			t.Errorf("help %s: %d %s", verb, code, out)
		}
	}
}
