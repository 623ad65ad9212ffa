package clients_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control/client"
	"github.com/stopgate/stopgate/state"
)

// heard is when a watcher got the cancel's row.
type heard struct {
	at  time.Time
	row state.Run
	err error
}

// watchCancel follows run through c and sends on ready once it holds the
// row, then the time it got the first row that is not ACTIVE.
func watchCancel(ctx context.Context, c *client.Client, run string, ready chan<- struct{}) <-chan heard {
	out := make(chan heard, 1)
	go func() {
		for row, err := range c.Watch(ctx, run) {
			if err != nil {
				out <- heard{err: err}
				return
			}
			if row.Status == state.StatusActive {
				ready <- struct{}{}
				continue
			}
			out <- heard{at: time.Now(), row: row}
			return
		}
		out <- heard{err: fmt.Errorf("the watch ended before the cancel: %w", ctx.Err())}
	}()
	return out
}

// TestWatchLatency measures how soon a watch stream hears a cancel, on the
// instance that takes the cancel and on another sharing its Redis store, and
// checks that every stream hears every cancel with its row. It logs the
// figures (go test -v); it asserts no time. STOPGATE_WATCH_CANCELS sets how
// many cancels (20 by default; 100 for the figures docs/workers.md quotes).
func TestWatchLatency(t *testing.T) {
	n := 20
	if v := os.Getenv("STOPGATE_WATCH_CANCELS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 1 {
			t.Fatalf("STOPGATE_WATCH_CANCELS=%q: want a count", v)
		}
	}
	f := startFleet(t)
	opA, err := client.New(f.a.control, client.Options{Token: f.token, Actor: "test:latency"})
	if err != nil {
		t.Fatal(err)
	}
	opB, _ := client.New(f.b.control, client.Options{Token: f.token})
	var sameSent, sameCommit, sameAnswer, otherSent, otherCommit, otherAnswer []time.Duration
	for i := range n {
		run := fmt.Sprintf("latency-%d-%d", time.Now().UnixNano(), i)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		if _, err := opA.Admit(ctx, run); err != nil {
			t.Fatal(err)
		}
		ready := make(chan struct{}, 2)
		onA := watchCancel(ctx, opA, run, ready)
		onB := watchCancel(ctx, opB, run, ready)
		for range 2 {
			select {
			case <-ready:
			case <-ctx.Done():
				t.Fatalf("cancel %d: the watches did not get the row", i)
			}
		}
		sent := time.Now()
		res, err := opA.Cancel(ctx, run, client.CancelOptions{Reason: "latency"})
		answered := time.Now()
		if err != nil {
			t.Fatal(err)
		}
		commit := res.Value.Run.CancelledAt
		for _, w := range []struct {
			name                 string
			ch                   <-chan heard
			fromSent, fromCommit *[]time.Duration
			fromAnswer           *[]time.Duration
		}{
			{"the same instance", onA, &sameSent, &sameCommit, &sameAnswer},
			{"another instance", onB, &otherSent, &otherCommit, &otherAnswer},
		} {
			h := <-w.ch
			if h.err != nil {
				t.Fatalf("cancel %d, watch on %s: %v", i, w.name, h.err)
			}
			// Nothing is in flight, so the sweeper may drain the run before
			// the watch reads it: CANCELLED is the same news, later.
			if h.row.Status == state.StatusActive || h.row.CancelVersion != 2 || h.row.Reason != "latency" {
				t.Fatalf("cancel %d, watch on %s: row %+v, want the cancel's at version 2", i, w.name, h.row)
			}
			*w.fromSent = append(*w.fromSent, h.at.Sub(sent))
			*w.fromCommit = append(*w.fromCommit, h.at.Sub(commit))
			*w.fromAnswer = append(*w.fromAnswer, h.at.Sub(answered))
		}
		cancel()
	}
	t.Logf("watch stream, cancel → event at the worker, %d cancels, Redis store, two instances:", n)
	t.Logf("| watch on | from the cancel sent p50 / p99 | from cancelled_at (the store's clock, ms) p50 / p99 | from the cancel's answer p50 / p99 |")
	t.Logf("|---|---|---|---|")
	t.Logf("| the instance that took the cancel | %s | %s | %s |", pct(sameSent), pct(sameCommit), pct(sameAnswer))
	t.Logf("| another instance | %s | %s | %s |", pct(otherSent), pct(otherCommit), pct(otherAnswer))
}

func pct(ds []time.Duration) string {
	s := slices.Clone(ds)
	slices.Sort(s)
	at := func(q float64) time.Duration { return s[max(0, int(math.Ceil(q*float64(len(s))))-1)] }
	return fmt.Sprintf("%s / %s", at(0.50).Round(10*time.Microsecond), at(0.99).Round(10*time.Microsecond))
}

// TestServeShutdownEndsWatchStreams: a stream that would never end by itself
// gets its last event (end, shutdown) at SIGTERM, and does not hold serve's
// shutdown for its 10 s of grace.
func TestServeShutdownEndsWatchStreams(t *testing.T) {
	dataDir := t.TempDir()
	s := startServe(t, dataDir, nil)
	tok, err := os.ReadFile(dataDir + "/operator.token")
	if err != nil {
		t.Fatal(err)
	}
	token := strings.TrimSpace(string(tok))
	c, _ := client.New(s.control, client.Options{Token: token})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := c.Admit(ctx, "r1"); err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.control+"/v1/runs/r1/watch", nil)
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("watch: %v %v", resp, err)
	}
	defer resp.Body.Close()
	lines := make(chan string, 16)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	waitLine := func(want string) {
		t.Helper()
		for {
			select {
			case l, ok := <-lines:
				if !ok {
					t.Fatalf("the stream closed before %q", want)
				}
				if l == want {
					return
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("no %q within 10s", want)
			}
		}
	}
	waitLine("event: run")
	start := time.Now()
	stopped := make(chan error, 1)
	go func() { stopped <- s.Stop() }()
	waitLine("event: end")
	waitLine(`data: {"reason":"shutdown"}`)
	if err := <-stopped; err != nil {
		t.Fatalf("serve's exit: %v\n%s", err, s.Log())
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("serve took %s to stop with a watch open: the stream held the shutdown", d)
	}
}

// TestServeBoundsWatches: serve's --max-watches-per-run reaches the
// control API: past it, a watch is refused 429 with the bound named.
func TestServeBoundsWatches(t *testing.T) {
	dataDir := t.TempDir()
	s := startServe(t, dataDir, nil, "--max-watches-per-run", "1")
	tok, err := os.ReadFile(dataDir + "/operator.token")
	if err != nil {
		t.Fatal(err)
	}
	c, _ := client.New(s.control, client.Options{Token: strings.TrimSpace(string(tok))})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := c.Admit(ctx, "r1"); err != nil {
		t.Fatal(err)
	}
	ready := make(chan struct{}, 1)
	first := watchCancel(ctx, c, "r1", ready)
	select {
	case <-ready:
	case h := <-first:
		t.Fatalf("the first watch: %v", h.err)
	}
	_, err = c.Poll(ctx, "r1", state.Run{CancelVersion: 1, Status: state.StatusActive}, time.Second)
	var ae *client.APIError
	if !errors.As(err, &ae) || ae.StatusCode != http.StatusTooManyRequests || !strings.Contains(ae.Message, "run r1 already has 1 watches open") {
		t.Fatalf("a second watch of the run: %v, want 429 naming the bound", err)
	}
}
