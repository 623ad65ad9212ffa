package client_test

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/control/client"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/runwatch"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
)

// watched serves the control API with a run watcher, as serve wires it,
// and returns its URL and store.
func watched(t *testing.T, opts control.Options) (string, state.Store) {
	t.Helper()
	store, err := filestore.Open(filepath.Join(t.TempDir(), "stopgate.db"), filestore.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = store.Close() })
	w := runwatch.New(store, runwatch.Options{Interval: 50 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	opts.Store, opts.Token, opts.Watcher, opts.DrainTimeout = store, operatorToken, w, time.Minute
	h, err := control.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var loop sync.WaitGroup
	loop.Go(func() { w.Run(ctx) })
	srv := httptest.NewServer(h)
	t.Cleanup(func() { cancel(); loop.Wait() })
	t.Cleanup(srv.Close)
	t.Cleanup(h.EndWatches)
	return srv.URL, store
}

// TestWatchYieldsEachTransitionOnceAcrossReconnects: the streams here end
// every 200ms (max_age); the client opens them again and still yields each
// row once, in order, and stops at the final one.
func TestWatchYieldsEachTransitionOnceAcrossReconnects(t *testing.T) {
	url, store := watched(t, control.Options{Watch: control.WatchOptions{MaxAge: 200 * time.Millisecond}})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := client.New(url, client.Options{Token: operatorToken})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Admit(ctx, "r1"); err != nil {
		t.Fatal(err)
	}
	var seen []state.Status
	for row, err := range c.Watch(ctx, "r1") {
		if err != nil {
			t.Fatalf("watch: %v", err)
		}
		seen = append(seen, row.Status)
		switch row.Status {
		case state.StatusActive:
			// Past a few reconnects before the cancel.
			time.Sleep(700 * time.Millisecond)
			if _, err := c.Cancel(ctx, "r1", client.CancelOptions{Reason: "stop"}); err != nil {
				t.Fatal(err)
			}
		case state.StatusCancelling:
			time.Sleep(300 * time.Millisecond)
			if _, err := store.Tick(ctx, state.TickRequest{RunID: "r1", Actor: "sweeper"}); err != nil {
				t.Fatal(err)
			}
		}
	}
	want := []state.Status{state.StatusActive, state.StatusCancelling, state.StatusCancelled}
	if len(seen) != len(want) || seen[0] != want[0] || seen[1] != want[1] || seen[2] != want[2] {
		t.Fatalf("rows yielded %v, want %v", seen, want)
	}
	if ctx.Err() != nil {
		t.Fatal("the watch ended only with the context, not at the final row")
	}
}

func TestWatchEndsWithARefusalThatWillNotPass(t *testing.T) {
	signer, _ := runtoken.New([]byte("0123456789abcdef0123456789abcdef"))
	url, store := watched(t, control.Options{Tokens: signer})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, id := range []string{"mine", "theirs"} {
		if _, err := store.Admit(ctx, state.AdmitRequest{RunID: id, Actor: "test"}); err != nil {
			t.Fatal(err)
		}
	}
	c, _ := client.New(url, client.Options{Token: signer.Sign("mine", 1, time.Now().Add(time.Hour))})
	n := 0
	for _, err := range c.Watch(ctx, "theirs") {
		n++
		var ae *client.APIError
		if !errors.As(err, &ae) || ae.StatusCode != http.StatusForbidden || ae.Code != refusal.Forbidden {
			t.Fatalf("watch of another run: %v, want 403 forbidden", err)
		}
	}
	if n != 1 {
		t.Fatalf("%d values yielded, want the one refusal", n)
	}
}

func TestPollAnswersAtTheCancel(t *testing.T) {
	url, _ := watched(t, control.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, _ := client.New(url, client.Options{Token: operatorToken})
	admitted, err := c.Admit(ctx, "r1")
	if err != nil {
		t.Fatal(err)
	}
	// The client's own timeout (30s by default) does not cut a long poll.
	unchanged, err := c.Poll(ctx, "r1", admitted.Value, 300*time.Millisecond)
	if err != nil || unchanged.Value.Status != state.StatusActive {
		t.Fatalf("poll without a transition: %+v %v", unchanged.Value, err)
	}
	go func() {
		time.Sleep(200 * time.Millisecond)
		_, _ = c.Cancel(ctx, "r1", client.CancelOptions{})
	}()
	start := time.Now()
	got, err := c.Poll(ctx, "r1", admitted.Value, 10*time.Second)
	if err != nil || got.Value.Status != state.StatusCancelling || !control.After(got.Value, 1, state.StatusActive) {
		t.Fatalf("poll across the cancel: %+v %v", got.Value, err)
	}
	if time.Since(start) > 8*time.Second {
		t.Fatalf("the poll answered after %s, at its wait rather than at the cancel", time.Since(start))
	}
}

func TestRenewAndDispatchRetry(t *testing.T) {
	url, _ := watched(t, control.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, _ := client.New(url, client.Options{Token: operatorToken})
	if _, err := c.Admit(ctx, "r1"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Claim(ctx, "r1", control.ClaimRequest{StepID: "s1", Worker: "w1"}); err != nil {
		t.Fatal(err)
	}
	renewed, err := c.Renew(ctx, "r1", "claim:s1", control.RenewRequest{Worker: "w1"})
	if err != nil || renewed.Value.Run.Status != state.StatusActive || renewed.Value.Intent.State != state.IntentInFlight {
		t.Fatalf("renew: %+v %v", renewed.Value, err)
	}
	at := time.Now().Add(-time.Second).UTC().Format(time.RFC3339)
	if _, err := c.Retry(ctx, "r1", control.RetryRequest{StepID: "s1", Attempt: 2, NotBefore: at}); err != nil {
		t.Fatal(err)
	}
	d, err := c.DispatchRetry(ctx, "r1", "s1", 2, control.DispatchRequest{Worker: "w1"})
	if err != nil || d.Value.Intent.Key != "retry:s1:2" || d.Value.Intent.State != state.IntentInFlight {
		t.Fatalf("dispatch: %+v %v", d.Value, err)
	}
	// After the cancel, a scheduled retry is revoked and its dispatch refused.
	if _, err := c.Retry(ctx, "r1", control.RetryRequest{StepID: "s1", Attempt: 3, NotBefore: at}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Cancel(ctx, "r1", client.CancelOptions{}); err != nil {
		t.Fatal(err)
	}
	_, err = c.DispatchRetry(ctx, "r1", "s1", 3, control.DispatchRequest{Worker: "w1"})
	var ae *client.APIError
	if !errors.As(err, &ae) || ae.Code != refusal.RunNotActive {
		t.Fatalf("dispatch after the cancel: %v, want run_not_active", err)
	}
}
