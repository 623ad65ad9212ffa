package intents_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/policy"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
)

func newStore(t *testing.T) state.Store {
	t.Helper()
	s, err := filestore.Open(filepath.Join(t.TempDir(), "s.db"), filestore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func TestDerivedKeyIsStableAndDistinguishesEachPart(t *testing.T) {
	base := intents.DerivedKey("r", "POST", "https://a/x", "sha256:1")
	if base != intents.DerivedKey("r", "POST", "https://a/x", "sha256:1") {
		t.Fatal("the same effect got two keys")
	}
	for _, other := range []string{
		intents.DerivedKey("r2", "POST", "https://a/x", "sha256:1"),
		intents.DerivedKey("r", "PUT", "https://a/x", "sha256:1"),
		intents.DerivedKey("r", "POST", "https://a/y", "sha256:1"),
		intents.DerivedKey("r", "POST", "https://a/x", "sha256:2"),
		intents.DerivedKey("r", "POSThttps://a/x", "", "sha256:1"),
	} {
		if other == base {
			t.Fatalf("different effects share key %s", base)
		}
	}
	if err := state.ValidateKey(base); err != nil {
		t.Fatal(err)
	}
	// Keys already stored must keep naming the same effects: the
	// derivation never changes, whatever its code becomes.
	for _, tc := range []struct{ run, method, target, digest, want string }{
		{"r", "POST", "https://a/x", "sha256:1", "d-2f129ed262f9347041313831"},
		{"run_42", "GET", "http://127.0.0.1:8000/small", "", "d-2e47a755f19e2429d0bb051b"},
		{"r", "GET", "https://a/" + strings.Repeat("x", 300), "d", "d-4e7b9f6bbcd294974c84cff5"},
	} {
		if got := intents.DerivedKey(tc.run, tc.method, tc.target, tc.digest); got != tc.want {
			t.Errorf("DerivedKey(%q, %q, %.20q…, %q) = %s, want %s as ever", tc.run, tc.method, tc.target, tc.digest, got, tc.want)
		}
	}
}

func TestLedgerKeepsLeasesAliveUntilFinish(t *testing.T) {
	s := newStore(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	l := intents.NewLedger(s, intents.LedgerOptions{Owner: "p1", LeaseTTL: 150 * time.Millisecond})
	go l.Run(ctx)
	if _, err := s.Admit(ctx, state.AdmitRequest{RunID: "r", Actor: "t"}); err != nil {
		t.Fatal(err)
	}
	res, err := l.Begin(ctx, state.GuardRequest{RunID: "r", Key: "k", ExplicitKey: true, Boundary: state.BoundaryHTTP})
	if err != nil || !res.Admitted || res.Intent.LeaseOwner != "p1" {
		t.Fatalf("begin: %+v %v", res, err)
	}
	if len(l.Held()) != 1 {
		t.Fatalf("held %v", l.Held())
	}
	time.Sleep(500 * time.Millisecond) // more than three TTLs
	if _, err := s.Tick(ctx, state.TickRequest{RunID: "r", Actor: "t"}); err != nil {
		t.Fatal(err)
	}
	if in, _ := s.Intent(ctx, "r", "k"); in.State != state.IntentInFlight {
		t.Fatalf("a renewed lease expired: %+v", in)
	}
	out, err := l.Finish(ctx, state.FinishRequest{RunID: res.Intent.RunID, Key: res.Intent.Key, Attempt: res.Intent.Attempts, Outcome: state.IntentResponded, StatusCode: 200})
	if err != nil || out.State != state.IntentResponded || len(l.Held()) != 0 {
		t.Fatalf("finish: %+v %v, held %v", out, err, l.Held())
	}
}

// answerTo is a Recorder that sends what it is told to a channel.
type answerTo chan<- error

func (ch answerTo) Recorded(err error) { ch <- err }

// FinishLater lets the lease go at once, records the outcome as the ledger,
// and tells the caller that it was, or why it was not, in Finish's own
// words.
func TestLedgerFinishLaterReleasesAtOnceAndReportsTheRecord(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	l := intents.NewLedger(s, intents.LedgerOptions{Owner: "p1"})
	if _, err := s.Admit(ctx, state.AdmitRequest{RunID: "r", Actor: "t"}); err != nil {
		t.Fatal(err)
	}
	res, err := l.Begin(ctx, state.GuardRequest{RunID: "r", Key: "k", ExplicitKey: true, Boundary: state.BoundaryHTTP})
	if err != nil || !res.Admitted {
		t.Fatalf("begin: %+v %v", res, err)
	}
	later := func(req state.FinishRequest) error {
		ch := make(chan error, 1)
		l.FinishLater(ctx, req, answerTo(ch))
		if len(l.Held()) != 0 {
			t.Fatalf("held after FinishLater: %v", l.Held())
		}
		select {
		case err := <-ch:
			return err
		case <-time.After(10 * time.Second):
			t.Fatal("FinishLater never answered")
			return nil
		}
	}
	err = later(state.FinishRequest{RunID: "r", Key: "k", Attempt: res.Intent.Attempts, Outcome: state.IntentResponded, StatusCode: 200})
	if in, rerr := s.Intent(ctx, "r", "k"); err != nil || rerr != nil || in.State != state.IntentResponded || in.LeaseOwner != "" {
		t.Fatalf("FinishLater: %v; the record %+v %v", err, in, rerr)
	}
	evs, err := s.Events(ctx, "r")
	if err != nil || evs[len(evs)-1].Actor != "p1" {
		t.Fatalf("the outcome's actor: %+v %v, want the ledger p1", evs, err)
	}
	err = later(state.FinishRequest{RunID: "r", Key: "k", Attempt: res.Intent.Attempts, Outcome: state.IntentNotSent})
	var c *state.Conflict
	if !errors.As(err, &c) || !strings.Contains(err.Error(), "record NOT_SENT of intent r/k") {
		t.Fatalf("a second outcome: %v, want a conflict named for the intent", err)
	}
}

func TestLedgerRefusesWhenStoreIsGone(t *testing.T) {
	s := newStore(t)
	l := intents.NewLedger(s, intents.LedgerOptions{Owner: "p1"})
	_ = s.Close()
	_, err := l.Begin(context.Background(), state.GuardRequest{RunID: "r", Key: "k", Boundary: state.BoundaryHTTP})
	if err == nil || !strings.Contains(err.Error(), "guard") {
		t.Fatalf("begin on a closed store: %v", err)
	}
}

func TestSweeperExpiresDeadCarriersAndFinalizesCancels(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	for _, run := range []string{"dead", "drained"} {
		if _, err := s.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "t"}); err != nil {
			t.Fatal(err)
		}
	}
	// A carrier that never renews: its lease runs out.
	if _, err := s.Guard(ctx, state.GuardRequest{RunID: "dead", Key: "k", ExplicitKey: true, Boundary: state.BoundaryHTTP, LeaseOwner: "gone", LeaseTTL: 50 * time.Millisecond, Actor: "gone"}); err != nil {
		t.Fatal(err)
	}
	for _, run := range []string{"dead", "drained"} {
		if _, err := s.Cancel(ctx, state.CancelRequest{RunID: run, Actor: "op", DrainTimeout: time.Minute}); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(100 * time.Millisecond)
	sw := &intents.Sweeper{Store: s, Actor: "sweeper:test"}
	sw.Sweep(ctx)
	dead, _ := s.Get(ctx, "dead")
	drained, _ := s.Get(ctx, "drained")
	if dead.Status != state.StatusUnknown || drained.Status != state.StatusCancelled {
		t.Fatalf("after a sweep: dead %s (want UNKNOWN), drained %s (want CANCELLED)", dead.Status, drained.Status)
	}
	if in, _ := s.Intent(ctx, "dead", "k"); in.Reason != state.ReasonLeaseExpired {
		t.Fatalf("expired intent %+v", in)
	}
}

func TestReconcilerResolvesFromProviderLookup(t *testing.T) {
	var asked atomic.Int64
	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		asked.Add(1)
		if r.Header.Get("Authorization") != "Bearer tok" {
			w.WriteHeader(401)
			return
		}
		switch {
		case strings.HasSuffix(r.URL.Path, "/applied-key"):
			w.WriteHeader(200)
		case strings.HasSuffix(r.URL.Path, "/missing-key"):
			w.WriteHeader(404)
		default:
			w.WriteHeader(503)
		}
	}))
	defer provider.Close()
	t.Setenv("LOOKUP_TOKEN", "tok")
	pol, err := policy.Parse([]byte(`
lookups:
  - host: ` + strings.TrimPrefix(provider.URL, "http://") + `
    url: ` + provider.URL + `/idem/{key}
    headers: {Authorization: "Bearer ${LOOKUP_TOKEN}"}
    applied: [200]
    not_applied: [404]
    interval: 1h
`))
	if err != nil {
		t.Fatal(err)
	}
	s := newStore(t)
	ctx := context.Background()
	if _, err := s.Admit(ctx, state.AdmitRequest{RunID: "r", Actor: "t"}); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"applied-key", "missing-key", "flaky-key"} {
		res, err := s.Guard(ctx, state.GuardRequest{RunID: "r", Key: key, ExplicitKey: true, Boundary: state.BoundaryHTTP, Method: "POST", Target: provider.URL + "/charge", LeaseOwner: "p", LeaseTTL: time.Minute, Actor: "p"})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Finish(ctx, state.FinishRequest{RunID: "r", Key: key, Attempt: res.Intent.Attempts, Outcome: state.IntentUnknown, Reason: "timeout", Actor: "p"}); err != nil {
			t.Fatal(err)
		}
	}
	rec := &intents.Reconciler{Store: s, Lookups: pol.Lookups, Actor: "reconciler:test"}
	rec.Pass(ctx)
	for key, want := range map[string]state.IntentState{"applied-key": state.IntentApplied, "missing-key": state.IntentNotApplied, "flaky-key": state.IntentUnknown} {
		in, _ := s.Intent(ctx, "r", key)
		if in.State != want {
			t.Errorf("%s: %s, want %s", key, in.State, want)
		}
		if want != state.IntentUnknown && (in.Source != "lookup" || !strings.Contains(in.Note, "answered")) {
			t.Errorf("%s: resolution without its source and note: %+v", key, in)
		}
	}
	before := asked.Load()
	rec.Pass(ctx)
	if asked.Load() != before {
		t.Fatalf("the unanswered lookup was retried before its backoff (asked %d more times)", asked.Load()-before)
	}
}

// The ledger fences every guard at half its store timeout: a store whose
// clock reads past that (the guard's turn came too late, or the store's
// clock runs ahead by more than the tolerated skew) records nothing, and
// the caller hears that the store is unavailable.
func TestLedgerFencesGuardsAtHalfTheStoreTimeout(t *testing.T) {
	const timeout = 2 * time.Second
	for _, tc := range []struct {
		name     string
		ahead    time.Duration
		admitted bool
	}{
		{"store clock in step", 0, true},
		{"store clock ahead within the tolerated skew", timeout/2 - 200*time.Millisecond, true},
		{"store clock past the fence", timeout/2 + 200*time.Millisecond, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := filestore.Open(filepath.Join(t.TempDir(), "s.db"), filestore.Options{Now: func() time.Time { return time.Now().Add(tc.ahead) }})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = s.Close() })
			ctx := context.Background()
			if _, err := s.Admit(ctx, state.AdmitRequest{RunID: "r", Actor: "t"}); err != nil {
				t.Fatal(err)
			}
			l := intents.NewLedger(s, intents.LedgerOptions{Owner: "p1", StoreTimeout: timeout})
			res, err := l.Begin(ctx, state.GuardRequest{RunID: "r", Key: "k", ExplicitKey: true, Boundary: state.BoundaryHTTP})
			if tc.admitted {
				if err != nil || !res.Admitted {
					t.Fatalf("begin: %+v %v, want admitted", res, err)
				}
				return
			}
			if !errors.Is(err, state.ErrUnavailable) {
				t.Fatalf("begin: %+v %v, want ErrUnavailable", res, err)
			}
			if _, err := s.Intent(ctx, "r", "k"); !errors.Is(err, state.ErrNotFound) {
				t.Fatalf("a fenced guard left an intent (%v)", err)
			}
			if len(l.Held()) != 0 {
				t.Fatalf("a fenced guard left a lease held: %v", l.Held())
			}
		})
	}
}

// A sweep ticks one page of ACTIVE runs: a dead carrier's lease on an
// ACTIVE run expires into UNKNOWN within as many sweeps as there are
// pages, never depending on the number of runs in one sweep.
func TestSweeperWalksActiveRunsAPageAtATime(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	runs := []string{"a1", "a2", "a3"}
	for _, run := range runs {
		if _, err := s.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "t"}); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Guard(ctx, state.GuardRequest{RunID: run, Key: "k", ExplicitKey: true, Boundary: state.BoundaryHTTP, LeaseOwner: "gone", LeaseTTL: 20 * time.Millisecond, Actor: "gone"}); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(50 * time.Millisecond)
	sw := &intents.Sweeper{Store: s, Actor: "sweeper:test", PageSize: 2}
	expired := func() []string {
		var out []string
		for _, run := range runs {
			if in, _ := s.Intent(ctx, run, "k"); in.State == state.IntentUnknown {
				out = append(out, run)
			}
		}
		return out
	}
	sw.Sweep(ctx)
	if got := expired(); strings.Join(got, " ") != "a1 a2" {
		t.Fatalf("after the first sweep (page of 2) expired: %v, want [a1 a2]", got)
	}
	sw.Sweep(ctx)
	if got := expired(); len(got) != 3 {
		t.Fatalf("after the second sweep expired: %v, want all three", got)
	}
	for _, run := range runs {
		if r, _ := s.Get(ctx, run); r.Status != state.StatusActive {
			t.Fatalf("an expired lease moved ACTIVE run %s to %s", run, r.Status)
		}
	}
}

// With a retention, the sweeper prunes the intents and events of runs
// final for longer; the rows stay, and runs not final are untouched.
func TestSweeperPrunesFinishedRunsPastRetention(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	for _, run := range []string{"done", "live"} {
		if _, err := s.Admit(ctx, state.AdmitRequest{RunID: run, Actor: "t"}); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Guard(ctx, state.GuardRequest{RunID: run, Key: "k", ExplicitKey: true, Boundary: state.BoundaryHTTP, LeaseOwner: "p", LeaseTTL: time.Minute, Actor: "p"}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Complete(ctx, state.CompleteRequest{RunID: "done", Version: 1, Actor: "w"}); err != nil {
		t.Fatal(err)
	}
	keep := &intents.Sweeper{Store: s, Actor: "sweeper:test"}
	keep.Sweep(ctx)
	if ins, _ := s.Intents(ctx, "done"); len(ins) != 1 {
		t.Fatalf("a sweeper without retention pruned: %+v", ins)
	}
	time.Sleep(30 * time.Millisecond)
	sw := &intents.Sweeper{Store: s, Actor: "sweeper:test", Retention: 10 * time.Millisecond}
	sw.Sweep(ctx)
	if ins, _ := s.Intents(ctx, "done"); len(ins) != 0 {
		t.Fatalf("the finished run's intents after retention: %+v", ins)
	}
	if r, _ := s.Get(ctx, "done"); r.Status != state.StatusCompleted || r.PrunedAt.IsZero() {
		t.Fatalf("the finished run's row after retention: %+v", r)
	}
	if ins, _ := s.Intents(ctx, "live"); len(ins) != 1 {
		t.Fatalf("the ACTIVE run's intents were pruned: %+v", ins)
	}
}

// outage is a real store whose reads a test can cut off, as a store that
// stops answering for a while: the sweeper's view of runs then fails.
type outage struct {
	state.Store
	down atomic.Bool
}

func (o *outage) err() error { return fmt.Errorf("test outage: %w", state.ErrUnavailable) }

func (o *outage) Get(ctx context.Context, id string) (state.Run, error) {
	if o.down.Load() {
		return state.Run{}, o.err()
	}
	return o.Store.Get(ctx, id)
}

func (o *outage) Tick(ctx context.Context, req state.TickRequest) (state.Run, error) {
	if o.down.Load() {
		return state.Run{}, o.err()
	}
	return o.Store.Tick(ctx, req)
}

func (o *outage) DrainingRuns(ctx context.Context) ([]string, error) {
	if o.down.Load() {
		return nil, o.err()
	}
	return o.Store.DrainingRuns(ctx)
}

func (o *outage) ActiveRuns(ctx context.Context, after string, limit int) ([]string, error) {
	if o.down.Load() {
		return nil, o.err()
	}
	return o.Store.ActiveRuns(ctx, after, limit)
}

func TestSweeperTellsADrainOnceEvenIfItSettledDuringAStoreOutage(t *testing.T) {
	real := newStore(t)
	s := &outage{Store: real}
	ctx := context.Background()
	if _, err := s.Admit(ctx, state.AdmitRequest{RunID: "r", Actor: "t"}); err != nil {
		t.Fatal(err)
	}
	g, err := s.Guard(ctx, state.GuardRequest{RunID: "r", Key: "k", ExplicitKey: true, Boundary: state.BoundaryHTTP, LeaseOwner: "w", LeaseTTL: time.Minute, Actor: "w"})
	if err != nil || !g.Admitted {
		t.Fatalf("guard: %+v %v", g, err)
	}
	if _, err := s.Cancel(ctx, state.CancelRequest{RunID: "r", Actor: "op", DrainTimeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
	var drained []state.Run
	sw := &intents.Sweeper{Store: s, Actor: "sweeper:test", Drained: func(r state.Run) { drained = append(drained, r) }}
	sw.Sweep(ctx) // sees r CANCELLING

	// The run settles while the sweeper cannot read the store.
	s.down.Store(true)
	if _, err := real.Finish(ctx, state.FinishRequest{RunID: "r", Key: "k", Attempt: 1, Outcome: state.IntentResponded, StatusCode: 200, Actor: "w"}); err != nil {
		t.Fatal(err)
	}
	sw.Sweep(ctx)
	if len(drained) != 0 {
		t.Fatalf("a sweep that could read nothing told of drains: %+v", drained)
	}
	s.down.Store(false)
	sw.Sweep(ctx)
	sw.Sweep(ctx)
	if len(drained) != 1 || drained[0].ID != "r" || drained[0].Status != state.StatusCancelled {
		t.Fatalf("drains told after the outage: %+v, want r CANCELLED once", drained)
	}
}
