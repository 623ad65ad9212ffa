package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/proxy"
	"github.com/stopgate/stopgate/redirect"
	"github.com/stopgate/stopgate/runwatch"
	"github.com/stopgate/stopgate/state"
)

// TestServeDefaultsAreTheirOwners: each default serve's flags show is the
// one the package that applies it exports (what it uses when given none),
// and docs/cli.md says the same: a copy in the flags or in the docs drifts
// and this fails.
func TestServeDefaultsAreTheirOwners(t *testing.T) {
	fs, _ := newServeFlags()
	docs, err := os.ReadFile("../../docs/cli.md")
	if err != nil {
		t.Fatal(err)
	}
	for flag, owner := range map[string]string{
		"lease-ttl":        intents.DefaultLeaseTTL.String(),
		"sweep-interval":   intents.DefaultSweepInterval.String(),
		"recheck-interval": runwatch.DefaultInterval.String(),
		"store-timeout":    state.DefaultTimeout.String(),
		"max-body":         "268435456",
		"data-dir":         control.DefaultDataDir,
	} {
		f := fs.Lookup(flag)
		if f == nil {
			t.Fatalf("no --%s", flag)
		}
		if f.DefValue != owner {
			t.Errorf("--%s defaults to %s, its owner to %s", flag, f.DefValue, owner)
		}
		if !bytes.Contains(docs, []byte("| `--"+flag+"` | `"+envName(flag)+"` | `"+owner+"` |")) {
			t.Errorf("docs/cli.md does not give --%s the default %s", flag, owner)
		}
	}
	if proxy.DefaultMaxBody != 268435456 {
		t.Errorf("proxy.DefaultMaxBody is %d, the docs say 268435456", proxy.DefaultMaxBody)
	}
}

// neverBinder fails the test if the control API gets as far as binding.
type neverBinder struct{ t *testing.T }

func (b neverBinder) Bind(uint32, string, int64, time.Duration) (redirect.Binding, error) {
	b.t.Error("a uid out of range reached Bind")
	return redirect.Binding{}, nil
}
func (b neverBinder) Renew(string) (redirect.Binding, error) {
	return redirect.Binding{}, redirect.ErrNoBinding
}
func (b neverBinder) Unbind(string) error { return redirect.ErrNoBinding }

// TestBoundsAreRefusedTheSameByEveryEdge: the bounds package state and
// package redirect own — a cancel's drain of at most 7 days, a uid from 0
// to 2^32-2 — are refused with their owner's words by serve's flags, the
// CLI's verbs and the control API alike.
func TestBoundsAreRefusedTheSameByEveryEdge(t *testing.T) {
	store := testkit.FileStore(t)
	api, err := control.New(control.Options{Store: store, Open: true, DrainTimeout: time.Minute, Transparent: neverBinder{t}, Logger: testkit.Logger()})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	post := func(path, body string) (int, string) {
		resp, err := http.Post(srv.URL+path, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var r struct{ Error, Message string }
		_ = json.NewDecoder(resp.Body).Decode(&r)
		return resp.StatusCode, r.Error + ": " + r.Message
	}
	cli := func(args ...string) (int, string) {
		var stdout, stderr bytes.Buffer
		c := newCLI(&stdout, &stderr, env(map[string]string{"STOPGATE_CONTROL": srv.URL}))
		return c.run(context.Background(), args), stderr.String()
	}

	tooLong := state.MaxDrainTimeout + time.Hour
	drainWords := state.Why(state.CheckDrainTimeout(tooLong))
	if _, err := parseServeConfig([]string{"--drain-timeout", tooLong.String()}, env(nil)); err == nil || !strings.Contains(err.Error(), drainWords) {
		t.Errorf("serve --drain-timeout %s: %v, want %q", tooLong, err, drainWords)
	}
	if code, out := cli("cancel", "r", "--drain", tooLong.String()); code != 2 || !strings.Contains(out, drainWords) {
		t.Errorf("stopgate cancel --drain %s: exit %d %s, want 2 and %q", tooLong, code, out, drainWords)
	}
	if code, msg := post("/v1/runs/r/cancel", `{"drain_timeout":"`+tooLong.String()+`"}`); code != http.StatusBadRequest || !strings.Contains(msg, drainWords) {
		t.Errorf("POST /v1/runs/r/cancel with a drain of %s: %d %s, want 400 and %q", tooLong, code, msg, drainWords)
	}
	if _, err := store.Get(context.Background(), "r"); err == nil {
		t.Errorf("a refused cancel wrote a row")
	}

	const uid = int64(redirect.MaxUID) + 1
	uidWords := redirect.CheckUID(uid)
	if code, out := cli("redirect", "install", "--uid", "4294967295", "--port", "1"); code != 2 || !strings.Contains(out, uidWords) {
		t.Errorf("stopgate redirect --uid %d: exit %d %s, want 2 and %q", uid, code, out, uidWords)
	}
	if code, out := cli("exec", "--run", "r", "--isolate", "--uid", "4294967295", "--", "true"); code != 2 || !strings.Contains(out, uidWords) {
		t.Errorf("stopgate exec --uid %d: exit %d %s, want 2 and %q", uid, code, out, uidWords)
	}
	if code, msg := post("/v1/transparent/bindings", `{"uid":4294967295,"run_id":"r"}`); code != http.StatusBadRequest || !strings.Contains(msg, uidWords) {
		t.Errorf("POST /v1/transparent/bindings uid %d: %d %s, want 400 and %q", uid, code, msg, uidWords)
	}
}
