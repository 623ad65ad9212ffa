package control_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/runwatch"
	"github.com/stopgate/stopgate/state"
)

// The watch specs run the API behind a real HTTP server with the listener
// timeouts serve sets (shortened), and a real runwatch.Watcher on the store,
// as serve wires them.

// watchRecheck is the watcher's re-read of held rows in these tests: what
// carries a transition the broadcast does not (CANCELLING → CANCELLED).
const watchRecheck = 50 * time.Millisecond

// serveWatched serves opts (Store set) with a run watcher, behind a server
// whose read and write timeouts are short, so that a stream that did not
// lift them would be cut within the tests.
func serveWatched(t *testing.T, opts control.Options) (*httptest.Server, *control.Handler) {
	t.Helper()
	return serveWatchedOn(t, opts, nil)
}

// serveWatchedOn is serveWatched with the server's listener wrapped by wrap
// (nil: as it is).
func serveWatchedOn(t *testing.T, opts control.Options, wrap func(net.Listener) net.Listener) (*httptest.Server, *control.Handler) {
	t.Helper()
	w := runwatch.New(opts.Store, runwatch.Options{Interval: watchRecheck, Logger: slog.New(slog.DiscardHandler)})
	if opts.Token == "" && !opts.Open {
		opts.Token = testToken
	}
	opts.Watcher = w
	opts.DrainTimeout = 30 * time.Second
	opts.Logger = slog.New(slog.DiscardHandler)
	h, err := control.New(opts)
	if err != nil {
		t.Fatalf("control.New: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var loop sync.WaitGroup
	loop.Go(func() { w.Run(ctx) })
	srv := httptest.NewUnstartedServer(h)
	srv.Config.ReadTimeout = 300 * time.Millisecond
	srv.Config.WriteTimeout = 300 * time.Millisecond
	if wrap != nil {
		srv.Listener = wrap(srv.Listener)
	}
	srv.Start()
	t.Cleanup(func() { cancel(); loop.Wait() })
	t.Cleanup(srv.Close)
	// Cleanups run last first: the streams end before the server waits for them.
	t.Cleanup(h.EndWatches)
	return srv, h
}

// sseMsg is one thing a stream sent: an event, or a comment.
type sseMsg struct {
	event, data, comment string
}

// sseStream reads one watch stream on its own goroutine.
type sseStream struct {
	resp *http.Response
	msgs chan sseMsg
	// done is closed when the server ended the stream.
	done chan struct{}
}

func openWatch(t *testing.T, srv *httptest.Server, path, token string) *sseStream {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Accept", "text/event-stream")
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	if resp.StatusCode != http.StatusOK {
		var body strings.Builder
		_, _ = bufio.NewReader(resp.Body).WriteTo(&body)
		resp.Body.Close()
		t.Fatalf("GET %s: %d %s", path, resp.StatusCode, body.String())
	}
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("Content-Type %q, want text/event-stream", ct)
	}
	s := &sseStream{resp: resp, msgs: make(chan sseMsg, 64), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		var m sseMsg
		for sc.Scan() {
			line := sc.Text()
			switch {
			case line == "":
				if m != (sseMsg{}) {
					s.msgs <- m
				}
				m = sseMsg{}
			case strings.HasPrefix(line, ":"):
				m.comment = strings.TrimSpace(line[1:])
			case strings.HasPrefix(line, "event: "):
				m.event = line[len("event: "):]
			case strings.HasPrefix(line, "data: "):
				m.data = line[len("data: "):]
			}
		}
	}()
	return s
}

// next is the next event (comments skipped) within d.
func (s *sseStream) next(t *testing.T, d time.Duration) sseMsg {
	t.Helper()
	deadline := time.After(d)
	for {
		select {
		case m := <-s.msgs:
			if m.event != "" {
				return m
			}
		case <-deadline:
			t.Fatalf("no event within %s", d)
		}
	}
}

// row is the next event, which must be a row.
func (s *sseStream) row(t *testing.T, d time.Duration) state.Run {
	t.Helper()
	m := s.next(t, d)
	if m.event != "run" {
		t.Fatalf("event %q (%s), want run", m.event, m.data)
	}
	var row state.Run
	if err := json.Unmarshal([]byte(m.data), &row); err != nil {
		t.Fatalf("data of a run event is not a row: %v: %s", err, m.data)
	}
	return row
}

// end is the next event, which must end the stream for reason.
func (s *sseStream) end(t *testing.T, d time.Duration, reason string) {
	t.Helper()
	m := s.next(t, d)
	var end control.WatchEnd
	if m.event != "end" || json.Unmarshal([]byte(m.data), &end) != nil || end.Reason != reason {
		t.Fatalf("got %q %s, want end with reason %s", m.event, m.data, reason)
	}
	select {
	case <-s.done:
	case <-time.After(5 * time.Second):
		t.Fatal("the server did not close the stream after its end event")
	}
}

func admitRun(t *testing.T, store state.Store, id string) {
	t.Helper()
	if _, err := store.Admit(context.Background(), state.AdmitRequest{RunID: id, Actor: "test"}); err != nil {
		t.Fatal(err)
	}
}

func cancelRun(t *testing.T, store state.Store, id string, drain time.Duration) {
	t.Helper()
	if _, err := store.Cancel(context.Background(), state.CancelRequest{RunID: id, Actor: "test", Reason: "stop", DrainTimeout: drain}); err != nil {
		t.Fatal(err)
	}
}

func TestWatchStreamsTheRowThenEveryTransition(t *testing.T) {
	testkit.OnBothStores(t, func(t *testing.T, store state.Store) {
		srv, h := serveWatched(t, control.Options{Store: store})
		admitRun(t, store, "w1")
		s := openWatch(t, srv, "/v1/runs/w1/watch", testToken)
		if row := s.row(t, 5*time.Second); row.Status != state.StatusActive || row.CancelVersion != 1 {
			t.Fatalf("first event %+v, want the row as it stands: ACTIVE at 1", row)
		}
		if n := h.OpenWatches(); n != 1 {
			t.Fatalf("OpenWatches = %d, want 1", n)
		}
		// The cancel reaches the stream by the store's broadcast.
		cancelRun(t, store, "w1", 0)
		if row := s.row(t, 5*time.Second); row.Status != state.StatusCancelling || row.CancelVersion != 2 || row.Reason != "stop" {
			t.Fatalf("after the cancel: %+v, want CANCELLING at 2", row)
		}
		// The sweeper's move on is not broadcast: the re-read carries it.
		if _, err := store.Tick(context.Background(), state.TickRequest{RunID: "w1", Actor: "sweeper"}); err != nil {
			t.Fatal(err)
		}
		if row := s.row(t, 5*time.Second); row.Status != state.StatusCancelled || row.CancelVersion != 2 || row.StatusReason != "drained" {
			t.Fatalf("after the tick: %+v, want CANCELLED at 2, drained", row)
		}
		// A final row never changes again: the stream says so and ends.
		s.end(t, 5*time.Second, control.WatchEndFinal)
		testkit.Eventually(t, 5*time.Second, "the watch is given back", func() bool { return h.OpenWatches() == 0 })
	})
}

func TestWatchOfAFinalRunSendsTheRowAndEnds(t *testing.T) {
	store := testkit.FileStore(t)
	srv, _ := serveWatched(t, control.Options{Store: store})
	cancelRun(t, store, "never-seen", 0) // a tombstone, CANCELLED at 2
	s := openWatch(t, srv, "/v1/runs/never-seen/watch", testToken)
	if row := s.row(t, 5*time.Second); row.Status != state.StatusCancelled {
		t.Fatalf("row %+v, want the CANCELLED tombstone", row)
	}
	s.end(t, 5*time.Second, control.WatchEndFinal)
}

// TestWatchStreamOutlivesTheListenerTimeouts: the control listener's read
// and write timeouts count from the request; a stream lifts them, and its
// heartbeat keeps coming past them.
func TestWatchStreamOutlivesTheListenerTimeouts(t *testing.T) {
	store := testkit.FileStore(t)
	srv, _ := serveWatched(t, control.Options{Store: store, Watch: control.WatchOptions{Heartbeat: 50 * time.Millisecond}})
	admitRun(t, store, "w1")
	s := openWatch(t, srv, "/v1/runs/w1/watch", testToken)
	s.row(t, 5*time.Second)
	heartbeats := 0
	deadline := time.After(5 * time.Second)
	for heartbeats < 20 { // 1s of heartbeats, three times the listener's timeouts
		select {
		case m := <-s.msgs:
			if m.comment == "heartbeat" {
				heartbeats++
			}
		case <-s.done:
			t.Fatalf("the stream ended after %d heartbeats", heartbeats)
		case <-deadline:
			t.Fatalf("%d heartbeats within 5s, want 20", heartbeats)
		}
	}
	cancelRun(t, store, "w1", time.Minute)
	if row := s.row(t, 5*time.Second); row.Status != state.StatusCancelling {
		t.Fatalf("row %+v, want CANCELLING", row)
	}
}

func TestWatchScopes(t *testing.T) {
	store := testkit.FileStore(t)
	signer, _ := runtoken.New([]byte("0123456789abcdef0123456789abcdef"))
	const readToken = "sgro_watch-reader"
	srv, _ := serveWatched(t, control.Options{Store: store, ReadToken: readToken, Tokens: signer})
	admitRun(t, store, "mine")
	admitRun(t, store, "theirs")
	worker := signer.Sign("mine", 1, time.Now().Add(time.Hour))
	for _, tc := range []struct {
		name, run, token string
		status           int
		code             refusal.Code
	}{
		{"OperatorWatchesAnyRun", "theirs", testToken, 200, ""},
		{"ReaderWatchesAnyRun", "theirs", readToken, 200, ""},
		{"WorkerWatchesItsRun", "mine", worker, 200, ""},
		{"WorkerMayNotWatchAnotherRun", "theirs", worker, 403, refusal.Forbidden},
		{"WrongTokenIsUnauthorized", "mine", "sgop_wrong", 401, refusal.Unauthorized},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// wait=1ms: a long poll answers at once or nearly, a stream would not.
			r := do(t, srv, "GET", "/v1/runs/"+tc.run+"/watch?after_version=1&wait=1ms", "", map[string]string{"Authorization": "Bearer " + tc.token})
			if r.status != tc.status || r.header.Get(refusal.Header) != string(tc.code) {
				t.Fatalf("status %d code %q, want %d %q: %s", r.status, r.header.Get(refusal.Header), tc.status, tc.code, r.body)
			}
			if tc.status == http.StatusForbidden && !strings.Contains(string(r.body), "its own run only") {
				t.Errorf("the refusal does not say why: %s", r.body)
			}
		})
	}
	// The stream itself is scoped the same way.
	s := openWatch(t, srv, "/v1/runs/mine/watch", worker)
	if row := s.row(t, 5*time.Second); row.ID != "mine" {
		t.Fatalf("worker's stream: %+v", row)
	}
}

func TestWatchBounds(t *testing.T) {
	store := testkit.FileStore(t)
	srv, h := serveWatched(t, control.Options{Store: store, Watch: control.WatchOptions{Max: 3, MaxPerRun: 2}})
	for _, id := range []string{"r1", "r2", "r3"} {
		admitRun(t, store, id)
	}
	openWatch(t, srv, "/v1/runs/r1/watch", testToken).row(t, 5*time.Second)
	second := openWatch(t, srv, "/v1/runs/r1/watch", testToken)
	second.row(t, 5*time.Second)

	r := do(t, srv, "GET", "/v1/runs/r1/watch", "", nil)
	if r.status != http.StatusTooManyRequests || r.header.Get(refusal.Header) != string(refusal.TooManyConnections) ||
		!strings.Contains(string(r.body), "run r1 already has 2 watches open") {
		t.Fatalf("a third watch of one run: %d %s, want 429 too_many_connections naming the run's bound", r.status, r.body)
	}
	openWatch(t, srv, "/v1/runs/r2/watch", testToken).row(t, 5*time.Second)
	r = do(t, srv, "GET", "/v1/runs/r3/watch?after_version=1", "", nil)
	if r.status != http.StatusTooManyRequests || !strings.Contains(string(r.body), "already serves 3 watches") {
		t.Fatalf("a fourth watch in all: %d %s, want 429 naming the instance's bound", r.status, r.body)
	}
	// A watch given back frees its slot.
	second.resp.Body.Close()
	testkit.Eventually(t, 5*time.Second, "the closed stream is given back", func() bool { return h.OpenWatches() == 2 })
	openWatch(t, srv, "/v1/runs/r3/watch", testToken).row(t, 5*time.Second)
}

func TestWatchLongPoll(t *testing.T) {
	store := testkit.FileStore(t)
	srv, _ := serveWatched(t, control.Options{Store: store})
	admitRun(t, store, "p1")
	cancelRun(t, store, "done", 0)

	pollRow := func(t *testing.T, r reply, status int, watch string) state.Run {
		t.Helper()
		if r.status != status || r.header.Get(control.WatchHeader) != watch {
			t.Fatalf("status %d %s %q, want %d %q: %s", r.status, control.WatchHeader, r.header.Get(control.WatchHeader), status, watch, r.body)
		}
		var row state.Run
		r.json(t, &row)
		return row
	}
	t.Run("BehindAnswersAtOnce", func(t *testing.T) {
		start := time.Now()
		row := pollRow(t, do(t, srv, "GET", "/v1/runs/p1/watch?after_version=0&wait=30s", "", nil), 200, control.WatchChanged)
		if row.Status != state.StatusActive || time.Since(start) > 5*time.Second {
			t.Fatalf("row %+v after %s, want ACTIVE at once", row, time.Since(start))
		}
	})
	t.Run("FinalAnswersAtOnce", func(t *testing.T) {
		row := pollRow(t, do(t, srv, "GET", "/v1/runs/done/watch?after_version=2&after_status=CANCELLED&wait=30s", "", nil), 200, control.WatchFinal)
		if row.Status != state.StatusCancelled {
			t.Fatalf("row %+v", row)
		}
	})
	t.Run("UnchangedAfterTheWait", func(t *testing.T) {
		start := time.Now()
		row := pollRow(t, do(t, srv, "GET", "/v1/runs/p1/watch?after_version=1&after_status=active&wait=200ms", "", nil), 200, control.WatchUnchanged)
		if row.Status != state.StatusActive || time.Since(start) < 200*time.Millisecond {
			t.Fatalf("row %+v after %s, want ACTIVE after the wait", row, time.Since(start))
		}
	})
	t.Run("TheCancelAnswersAWaitingPoll", func(t *testing.T) {
		got := make(chan reply, 1)
		go func() { got <- do(t, srv, "GET", "/v1/runs/p1/watch?after_version=1&wait=8s", "", nil) }()
		time.Sleep(100 * time.Millisecond)
		cancelRun(t, store, "p1", 0)
		select {
		case r := <-got:
			if row := pollRow(t, r, 200, control.WatchChanged); row.Status != state.StatusCancelling || row.CancelVersion != 2 {
				t.Fatalf("row %+v, want CANCELLING at 2", row)
			}
		case <-time.After(6 * time.Second):
			t.Fatal("the poll was not answered at the cancel")
		}
		// The move on keeps the version: after_status tells it apart.
		got2 := make(chan reply, 1)
		go func() {
			got2 <- do(t, srv, "GET", "/v1/runs/p1/watch?after_version=2&after_status=CANCELLING&wait=8s", "", nil)
		}()
		time.Sleep(100 * time.Millisecond)
		if _, err := store.Tick(context.Background(), state.TickRequest{RunID: "p1", Actor: "sweeper"}); err != nil {
			t.Fatal(err)
		}
		select {
		case r := <-got2:
			if row := pollRow(t, r, 200, control.WatchChanged); row.Status != state.StatusCancelled {
				t.Fatalf("row %+v, want CANCELLED", row)
			}
		case <-time.After(6 * time.Second):
			t.Fatal("the poll was not answered at the sweeper's move")
		}
	})
	for _, tc := range []struct{ name, query, message string }{
		{"WaitWithoutVersion", "wait=5s", "needs after_version"},
		{"StatusWithoutVersion", "after_status=ACTIVE", "needs after_version"},
		{"NegativeVersion", "after_version=-1", "after_version"},
		{"VersionNotANumber", "after_version=one", "after_version"},
		{"UnknownStatus", "after_version=1&after_status=PAUSED", "after_status"},
		{"WaitZero", "after_version=1&wait=0", "wait 0s"},
		{"WaitTooLong", "after_version=1&wait=2m", "at most 1m0s"},
		{"WaitNotADuration", "after_version=1&wait=soon", "wait"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := do(t, srv, "GET", "/v1/runs/p1/watch?"+tc.query, "", nil)
			if r.status != http.StatusBadRequest || r.header.Get(refusal.Header) != string(refusal.InvalidRequest) || !strings.Contains(string(r.body), tc.message) {
				t.Fatalf("%s: %d %s, want 400 invalid_request saying %q", tc.query, r.status, r.body, tc.message)
			}
		})
	}
}

func TestWatchRefusals(t *testing.T) {
	store := testkit.FileStore(t)
	srv, _ := serveWatched(t, control.Options{Store: store})
	unwatched := serve(t, store, "")
	run(t, srv, []spec{
		{name: "UnknownRun", method: "GET", path: "/v1/runs/nobody/watch", status: 404, code: string(refusal.NotFound), message: "never admitted"},
		{name: "BadRunID", method: "GET", path: "/v1/runs/bad%20id/watch", status: 400, code: string(refusal.InvalidRequest)},
		{name: "Post", method: "POST", path: "/v1/runs/r1/watch", status: 405, code: string(refusal.MethodNotAllowed), check: func(t *testing.T, r reply) {
			if r.header.Get("Allow") != "GET, HEAD" {
				t.Errorf("Allow %q", r.header.Get("Allow"))
			}
		}},
	})
	run(t, unwatched, []spec{
		{name: "NoWatcher", method: "GET", path: "/v1/runs/r1/watch", status: 404, code: string(refusal.NotFound), message: "watches no runs"},
	})
}

func TestWatchHeadAnswersTheHeadersOnly(t *testing.T) {
	store := testkit.FileStore(t)
	srv, h := serveWatched(t, control.Options{Store: store})
	admitRun(t, store, "w1")
	r := do(t, srv, "HEAD", "/v1/runs/w1/watch", "", nil)
	if r.status != 200 || r.header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("HEAD: %d %v", r.status, r.header)
	}
	testkit.Eventually(t, 5*time.Second, "the HEAD's watch is given back", func() bool { return h.OpenWatches() == 0 })
}

// TestEndWatchesEndsEveryWatch: serve's shutdown ends the streams (event
// end, reason shutdown), answers the long polls, and a watch that comes
// after it gets the row and ends at once.
func TestEndWatchesEndsEveryWatch(t *testing.T) {
	store := testkit.FileStore(t)
	srv, h := serveWatched(t, control.Options{Store: store})
	admitRun(t, store, "w1")
	s := openWatch(t, srv, "/v1/runs/w1/watch", testToken)
	s.row(t, 5*time.Second)
	polled := make(chan reply, 1)
	go func() { polled <- do(t, srv, "GET", "/v1/runs/w1/watch?after_version=1&wait=30s", "", nil) }()
	testkit.Eventually(t, 5*time.Second, "the poll waits", func() bool { return h.OpenWatches() == 2 })

	h.EndWatches()
	s.end(t, 5*time.Second, control.WatchEndShutdown)
	select {
	case r := <-polled:
		if r.status != 200 || r.header.Get(control.WatchHeader) != control.WatchUnchanged {
			t.Fatalf("poll at shutdown: %d %v %s", r.status, r.header, r.body)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the long poll was not answered at the shutdown")
	}
	late := openWatch(t, srv, "/v1/runs/w1/watch", testToken)
	late.row(t, 5*time.Second)
	late.end(t, 5*time.Second, control.WatchEndShutdown)
}

func TestWatchStreamEndsAtItsMaxAge(t *testing.T) {
	store := testkit.FileStore(t)
	srv, h := serveWatched(t, control.Options{Store: store, Watch: control.WatchOptions{MaxAge: 300 * time.Millisecond}})
	admitRun(t, store, "w1")
	s := openWatch(t, srv, "/v1/runs/w1/watch", testToken)
	s.row(t, 5*time.Second)
	s.end(t, 5*time.Second, control.WatchEndMaxAge)
	testkit.Eventually(t, 5*time.Second, "the aged stream is given back", func() bool { return h.OpenWatches() == 0 })
}

// TestWatchLetsGoOfAClientThatDoesNotRead: a client that opens a stream
// and never reads holds it only until its buffers are full and one write
// has waited WriteTimeout, long before the stream's max age.
func TestWatchLetsGoOfAClientThatDoesNotRead(t *testing.T) {
	store := testkit.FileStore(t)
	srv, h := serveWatchedOn(t, control.Options{Store: store, Watch: control.WatchOptions{
		Heartbeat: time.Millisecond, WriteTimeout: 200 * time.Millisecond, MaxAge: time.Hour,
	}}, func(ln net.Listener) net.Listener { return smallSendBuffers{ln} })
	admitRun(t, store, "w1")
	conn, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// Small buffers on both sides fill within seconds of heartbeats.
	_ = conn.(*net.TCPConn).SetReadBuffer(4096)
	fmt.Fprintf(conn, "GET /v1/runs/w1/watch HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n\r\n", testToken)
	testkit.Eventually(t, 5*time.Second, "the stream opens", func() bool { return h.OpenWatches() == 1 })
	testkit.Eventually(t, 30*time.Second, "the stuck client's stream is let go", func() bool { return h.OpenWatches() == 0 })
}

// smallSendBuffers accepts connections whose kernel send buffer is small.
type smallSendBuffers struct{ net.Listener }

func (l smallSendBuffers) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetWriteBuffer(4096)
	}
	return c, err
}
