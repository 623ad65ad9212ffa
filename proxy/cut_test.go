package proxy_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/state"
)

// sse is an upstream that streams an event every 50ms until the client goes.
var sse = testkit.Stream("text/event-stream", "data: %d\n\n", 50*time.Millisecond)

func TestSSEStreamIsCutWithinOneSecondOfCancel(t *testing.T) {
	for _, tlsOn := range []bool{false, true} {
		t.Run(fmt.Sprintf("tls=%v", tlsOn), func(t *testing.T) {
			reg := prometheus.NewRegistry()
			e := newEnv(t, envOptions{registry: reg})
			up := newUpstream(t, tlsOn, sse)
			e.admit("s1")
			c := e.client("s1", 1)
			c.Timeout = 0
			resp, lines := streamed(t, 3)(c.Get(up.URL + "/events"))
			d := endsWithin(t, lines, time.Second, func() { e.cancel("s1", time.Minute) })
			t.Logf("stream ended %v after the cancel", d)
			in := e.intent("s1", resp.Header.Get(refusal.IntentHeader))
			if in.State != state.IntentResponded || in.StatusCode != 200 {
				t.Fatalf("the provider answered before the cut: want RESPONDED 200, got %+v", in)
			}
			testkit.Eventually(t, 2*time.Second, "the cut counted", func() bool {
				return gathered(t, reg)["stopgate_cuts_total/http/run_cancelled"] == 1
			})
		})
	}
}

// gathered reads every counter and gauge of reg by name/label/label.
func gathered(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			name := f.GetName()
			for _, l := range m.GetLabel() {
				name += "/" + l.GetValue()
			}
			got[name] = m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return got
}

// echoServer is a raw TCP upstream for pass-through tunnels: TLS that the
// proxy never sees inside.
func echoTLSServer(t *testing.T) (addr string, roots *x509.CertPool) {
	t.Helper()
	up := newUpstream(t, true, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/stream" {
			sse(w, r)
			return
		}
		io.WriteString(w, "secret inside")
	})
	pool := x509.NewCertPool()
	pool.AddCert(up.Certificate())
	return up.Listener.Addr().String(), pool
}

func TestPassThroughTunnelIsGuardedAtConnectAndCutOnCancel(t *testing.T) {
	addr, roots := echoTLSServer(t)
	host, _, _ := net.SplitHostPort(addr)
	e := newEnv(t, envOptions{passThrough: []string{host}})
	e.admit("p1")
	pu, _ := url.Parse(e.server.URL)
	pu.User = url.UserPassword("p1", "1")
	newClient := func() *http.Client {
		return &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(pu), TLSClientConfig: &tls.Config{RootCAs: roots}}}
	}
	c := newClient()

	// The upstream's own certificate is trusted: the tunnel is not intercepted.
	resp, body := do(t, c, "GET", "https://"+addr+"/", nil, nil)
	if resp.StatusCode != 200 || string(body) != "secret inside" || resp.Header.Get(refusal.IntentHeader) != "" {
		t.Fatalf("through the tunnel: %d %q %v", resp.StatusCode, body, resp.Header)
	}
	// A second client: a second tunnel.
	_, lines := streamed(t, 1)(newClient().Get("https://" + addr + "/stream"))
	var tunnels []state.Intent
	for _, in := range e.intents("p1") {
		if in.Boundary == state.BoundaryTunnel {
			tunnels = append(tunnels, in)
		}
	}
	if len(tunnels) != 2 || tunnels[0].Method != "CONNECT" || tunnels[0].Target != addr {
		t.Fatalf("one intent per tunnel: %+v", tunnels)
	}

	d := endsWithin(t, lines, time.Second, func() { e.cancel("p1", time.Minute) })
	t.Logf("tunnel cut %v after the cancel", d)
	testkit.Eventually(t, 2*time.Second, "cut tunnel recorded UNKNOWN", func() bool {
		return e.intent("p1", tunnels[1].Key).State == state.IntentUnknown
	})

	// A new CONNECT of the cancelled run is refused before any tunnel opens.
	conn, err := net.Dial("tcp", pu.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: %s\r\nProxy-Authorization: Basic cDE6MQ==\r\n\r\n", addr, addr)
	refused, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	if refused.StatusCode != 409 || refused.Header.Get(refusal.Header) != "run_not_active" {
		t.Fatalf("CONNECT after cancel: %d %v", refused.StatusCode, refused.Header)
	}
}

func TestUnsafeInFlightRequestMayFinishWithinDrain(t *testing.T) {
	e := newEnv(t, envOptions{})
	release := make(chan struct{})
	up := newUpstream(t, false, func(w http.ResponseWriter, r *http.Request) {
		<-release
		w.WriteHeader(202)
	})
	e.admit("d1")
	done := make(chan *http.Response, 1)
	go func() {
		resp, _ := do(t, e.client("d1", 1), "POST", up.URL+"/slow", strings.NewReader("x"), nil)
		done <- resp
	}()
	testkit.Eventually(t, 5*time.Second, "request in flight", func() bool { return up.Hits.Load() == 1 })
	e.cancel("d1", 30*time.Second)
	time.Sleep(400 * time.Millisecond) // two re-check intervals: nothing may cut it
	close(release)
	resp := <-done
	if resp.StatusCode != 202 {
		t.Fatalf("in-flight POST admitted before the cancel: %d, want the upstream's 202", resp.StatusCode)
	}
	if in := e.intent("d1", resp.Header.Get(refusal.IntentHeader)); in.State != state.IntentResponded {
		t.Fatalf("intent %+v", in)
	}
}

func TestUnsafeInFlightRequestIsCutAtDrainDeadlineAsUnknown(t *testing.T) {
	e := newEnv(t, envOptions{})
	up := newUpstream(t, false, func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
	})
	e.admit("d2")
	done := make(chan []byte, 1)
	go func() {
		_, body := do(t, e.client("d2", 1), "POST", up.URL+"/hang", strings.NewReader("x"), nil)
		done <- body
	}()
	testkit.Eventually(t, 5*time.Second, "request in flight", func() bool { return up.Hits.Load() == 1 })
	e.cancel("d2", 300*time.Millisecond)
	var body []byte
	select {
	case body = <-done:
	case <-time.After(3 * time.Second):
		t.Fatal("request still in flight 3s after a 300ms drain deadline")
	}
	r := decodeRefusal(t, body)
	if r.Recorded != "UNKNOWN" || !strings.Contains(r.Message, "drain_timeout") {
		t.Fatalf("cut at the deadline: %s", body)
	}
	if in := e.intent("d2", r.Intent); in.State != state.IntentUnknown || in.Reason != state.ReasonDrainTimeout {
		t.Fatalf("intent %+v", in)
	}
}

// TestDeliveryDestinationOutlivesActiveButNotCancelled: a status webhook
// may still be reached while the run drains, recorded like any effect, and
// is refused once the run is CANCELLED.
func TestDeliveryDestinationOutlivesActiveButNotCancelled(t *testing.T) {
	hook := newUpstream(t, false, nil)
	other := newUpstream(t, false, nil)
	hookURL, _ := url.Parse(hook.URL)
	e := newEnv(t, envOptions{delivery: []string{hookURL.Host}})
	e.admit("dl")
	e.cancel("dl", time.Minute)

	resp, _ := do(t, e.client("dl", 1), "POST", hook.URL+"/status", strings.NewReader(`{"status":"cancelling"}`), nil)
	if resp.StatusCode != 200 {
		t.Fatalf("delivery while CANCELLING: %d", resp.StatusCode)
	}
	in := e.intent("dl", resp.Header.Get(refusal.IntentHeader))
	if in.Boundary != state.BoundaryDelivery || in.State != state.IntentResponded {
		t.Fatalf("delivery intent %+v", in)
	}
	resp, _ = do(t, e.client("dl", 1), "POST", other.URL+"/charge", strings.NewReader("x"), nil)
	if resp.StatusCode != 409 {
		t.Fatalf("an ordinary destination while CANCELLING: %d", resp.StatusCode)
	}

	if r, err := e.store.Tick(context.Background(), state.TickRequest{RunID: "dl", Actor: "test"}); err != nil || r.Status != state.StatusCancelled {
		t.Fatalf("tick: %v %+v", err, r)
	}
	resp, body := do(t, e.client("dl", 1), "POST", hook.URL+"/status", strings.NewReader(`{"status":"cancelled"}`), nil)
	if r := decodeRefusal(t, body); resp.StatusCode != 409 || r.Status != "CANCELLED" {
		t.Fatalf("delivery once CANCELLED: %d %s", resp.StatusCode, body)
	}
	if hook.Hits.Load() != 1 || other.Hits.Load() != 0 {
		t.Fatalf("hook hits %d (want 1), other hits %d (want 0)", hook.Hits.Load(), other.Hits.Load())
	}
}

// TestUpgradedConnectionIsCarriedAndCutOnCancel: a WebSocket through the
// proxy works both ways while the run is ACTIVE and is cut by its cancel.
func TestUpgradedConnectionIsCarriedAndCutOnCancel(t *testing.T) {
	up := newUpstream(t, false, func(w http.ResponseWriter, r *http.Request) {
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		fmt.Fprint(brw, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
		brw.Flush()
		// Echo, as a WebSocket server would its frames.
		io.Copy(conn, brw)
	})
	e := newEnv(t, envOptions{})
	e.admit("ws")
	conn, err := net.Dial("tcp", strings.TrimPrefix(e.server.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "GET %s/socket HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nX-Run-ID: ws\r\n\r\n", up.URL, strings.TrimPrefix(up.URL, "http://"))
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != 101 {
		t.Fatalf("upgrade through the proxy: %v %v", resp, err)
	}
	fmt.Fprint(conn, "ping\n")
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	if line, err := br.ReadString('\n'); err != nil || line != "ping\n" {
		t.Fatalf("echo through the upgraded connection: %q %v", line, err)
	}
	cancelled := time.Now()
	e.cancel("ws", time.Minute)
	_ = conn.SetReadDeadline(time.Now().Add(time.Second))
	if _, err := br.ReadString('\n'); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("upgraded connection still open a second after the cancel (%v)", err)
	}
	t.Logf("upgraded connection cut %v after the cancel", time.Since(cancelled))
}

// TestAnswerToUnsafeRequestReachesClientAfterCancel: the provider answered
// a POST; the cancel lands while the answer is on its way back, and the run
// drains to CANCELLED at once (nothing is in flight). The effect has
// happened, so the agent still gets the whole answer (within the drain).
func TestAnswerToUnsafeRequestReachesClientAfterCancel(t *testing.T) {
	head, tail := strings.Repeat("a", 64<<10), `"status":"succeeded"}`
	up := newUpstream(t, false, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", fmt.Sprint(len(head)+len(tail)))
		io.WriteString(w, head) // more than the proxy's write buffer: the agent sees it now
		http.NewResponseController(w).Flush()
		// Several re-checks (every 200ms here) see the run CANCELLED meanwhile.
		time.Sleep(800 * time.Millisecond)
		io.WriteString(w, tail)
	})
	e := newEnv(t, envOptions{})
	e.admit("ans")
	resp, err := e.client("ans", 1).Post(up.URL+"/charge", "application/json", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	e.cancel("ans", time.Minute)
	if r, err := e.store.Tick(context.Background(), state.TickRequest{RunID: "ans", Actor: "test"}); err != nil || r.Status != state.StatusCancelled {
		t.Fatalf("tick: %+v %v", r, err)
	}
	body, err := io.ReadAll(resp.Body)
	if err != nil || string(body) != head+tail {
		t.Fatalf("answer after the cancel: %d bytes, %v", len(body), err)
	}
}

// endsWithin runs cancel and reports how long after it the stream ended;
// it fails the test if the stream outlives the limit.
// endsWithin cancels, then reads the stream until it ends, which must be
// within limit and as an error: a cut presented as a clean end of body
// would tell the agent its answer was whole.
func endsWithin(t *testing.T, stream *bufio.Reader, limit time.Duration, cancel func()) time.Duration {
	t.Helper()
	start := time.Now()
	cancel()
	type end struct {
		d   time.Duration
		err error
	}
	ended := make(chan end, 1)
	go func() {
		for {
			if _, err := stream.ReadString('\n'); err != nil {
				ended <- end{time.Since(start), err}
				return
			}
		}
	}()
	select {
	case e := <-ended:
		if errors.Is(e.err, io.EOF) {
			t.Fatalf("the cut stream ended cleanly (%v): the client cannot tell it was cut", e.err)
		}
		return e.d
	case <-time.After(limit):
		t.Fatalf("stream still open %v after the cancel", limit)
		return 0
	}
}

// TestUnknownLengthAnswerIsPassedOnAsItComes: an NDJSON stream (chunked,
// not SSE) reaches the agent line by line, not when a buffer fills.
func TestUnknownLengthAnswerIsPassedOnAsItComes(t *testing.T) {
	for _, tlsOn := range []bool{false, true} {
		t.Run(fmt.Sprintf("tls=%v", tlsOn), func(t *testing.T) {
			release := make(chan struct{})
			up := newUpstream(t, tlsOn, func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "application/x-ndjson")
				io.WriteString(w, "{\"token\":\"a\"}\n")
				http.NewResponseController(w).Flush()
				<-release
				io.WriteString(w, "{\"token\":\"b\"}\n")
			})
			defer close(release)
			e := newEnv(t, envOptions{})
			e.admit("nd")
			resp, err := e.client("nd", 1).Post(up.URL+"/generate", "application/json", strings.NewReader("{}"))
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			line, err := bufio.NewReader(resp.Body).ReadString('\n')
			if err != nil || line != "{\"token\":\"a\"}\n" {
				t.Fatalf("first line: %q %v", line, err)
			}
		})
	}
}

// held is an upstream that holds every request until the proxy cuts it,
// and says when a request has arrived.
func held(t *testing.T) (*testkit.Upstream, chan struct{}) {
	t.Helper()
	arrived := make(chan struct{}, 16)
	up := newUpstream(t, false, func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-r.Context().Done()
	})
	return up, arrived
}

// TestCutRecordsWhatTheRequestCouldHaveDone: a request in flight at the
// cancel that is cut after its bytes left is recorded for what it could
// have done — a read as NOT_APPLIED (safe_method), anything sent to a
// destination without effects as NOT_APPLIED (policy), a read where reads
// are effects as UNKNOWN — so a run with nothing unknown reaches CANCELLED
// by itself, with no operator.
//
// The rows that name a destination (api.openai.com., API.OpenAI.com) send
// to a name the proxy resolves to the upstream, under a policy file's
// `effects: {api.openai.com: none}` read by the policy's parser and applied
// by the proxy: the entry covers the name written with a trailing dot or in
// another case (one host-pattern rule, policy.HostSet).
func TestCutRecordsWhatTheRequestCouldHaveDone(t *testing.T) {
	const llm = "effects:\n  api.openai.com: none\n"
	for _, tc := range []struct {
		name        string
		method      string
		noEffects   bool
		readEffects bool
		want        state.IntentState
		source      string
		runStatus   state.Status
		// dest is the host the request names; policy the policy file.
		dest, policy string
	}{
		{"a GET", "GET", false, false, state.IntentNotApplied, state.SourceSafeMethod, state.StatusCancelled, "", ""},
		{"a POST to a destination without effects", "POST", true, false, state.IntentNotApplied, state.SourcePolicy, state.StatusCancelled, "", ""},
		{"a GET where reads are effects", "GET", false, true, state.IntentUnknown, "", state.StatusUnknown, "", ""},
		{"a POST to api.openai.com. under effects none", "POST", false, false, state.IntentNotApplied, state.SourcePolicy, state.StatusCancelled, "api.openai.com.", llm},
		{"a POST to API.OpenAI.com under effects none", "POST", false, false, state.IntentNotApplied, state.SourcePolicy, state.StatusCancelled, "API.OpenAI.com", llm},
	} {
		t.Run(tc.name, func(t *testing.T) {
			up, arrived := held(t)
			host := up.Listener.Addr().String()
			opts := envOptions{policyYAML: tc.policy}
			if tc.noEffects {
				opts.noEffects = []string{host}
			}
			if tc.readEffects {
				opts.readEffects = []string{host}
			}
			target := up.URL
			if tc.dest != "" {
				_, port, _ := net.SplitHostPort(host)
				target = "http://" + net.JoinHostPort(tc.dest, port)
				opts.resolve = func(ctx context.Context, name string) ([]netip.Addr, error) {
					if !strings.EqualFold(strings.TrimSuffix(name, "."), "api.openai.com") {
						return nil, fmt.Errorf("no such host %s", name)
					}
					return []netip.Addr{netip.MustParseAddr("127.0.0.1")}, nil
				}
			}
			e := newEnv(t, opts)
			e.admit("cut")
			done := make(chan *http.Response, 1)
			go func() {
				req, _ := http.NewRequest(tc.method, target+"/held", strings.NewReader(""))
				resp, err := e.client("cut", 1).Do(req)
				if err != nil {
					done <- nil
					return
				}
				done <- resp
			}()
			select {
			case <-arrived:
			case <-time.After(5 * time.Second):
				t.Fatal("the request never reached the upstream")
			}
			// A short drain: the request where reads are effects waits for
			// it, then the deadline cuts it.
			e.cancel("cut", 300*time.Millisecond)
			var resp *http.Response
			select {
			case resp = <-done:
			case <-time.After(5 * time.Second):
				t.Fatal("the request in flight was not cut")
			}
			if resp == nil || resp.StatusCode != http.StatusConflict {
				t.Fatalf("the cut request answered %v, want 409 run_not_active", resp)
			}
			key := resp.Header.Get(refusal.IntentHeader)
			resp.Body.Close()
			in := e.intent("cut", key)
			if in.State != tc.want || in.Source != tc.source {
				t.Fatalf("the cut request is recorded %s (source %q), want %s (%q): %+v", in.State, in.Source, tc.want, tc.source, in)
			}
			var row state.Run
			testkit.Eventually(t, 5*time.Second, "the run settles by itself", func() bool {
				r, err := e.store.Tick(context.Background(), state.TickRequest{RunID: "cut", Actor: "sweeper:test"})
				row = r
				return err == nil && r.Status != state.StatusCancelling
			})
			if row.Status != tc.runStatus {
				t.Fatalf("the run ended %s, want %s", row.Status, tc.runStatus)
			}
		})
	}
}

// TestStreamToDestinationWithoutEffectsIsCutAtTheCancel: a streamed POST to
// an inference API (effects: none) stops at the cancel — the spending
// stops — rather than running on until the drain deadline; the client
// sees the cut as an error, and the audit log has it.
func TestStreamToDestinationWithoutEffectsIsCutAtTheCancel(t *testing.T) {
	// NDJSON, not SSE: an answer stream of an unsafe request that only the
	// destination's policy cuts at once (an SSE stream is cut anyway).
	up := newUpstream(t, false, testkit.Stream("application/x-ndjson", "{\"token\":%d}\n", 20*time.Millisecond))
	e := newEnv(t, envOptions{noEffects: []string{up.Listener.Addr().String()}})
	e.admit("llm")
	c := e.client("llm", 1)
	c.Timeout = 0
	resp, lines := streamed(t, 2)(c.Post(up.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{"stream":true}`)))
	// A long drain: only the destination's policy cuts the stream now.
	d := endsWithin(t, lines, 5*time.Second, func() { e.cancel("llm", time.Hour) })
	t.Logf("stream to a destination without effects cut %v after the cancel", d)
	key := resp.Header.Get(refusal.IntentHeader)
	e.awaitCut("llm", func(ev state.Event) bool {
		return ev.Intent == key && strings.Contains(ev.Reason, state.ReasonRunCancelled)
	})
}

// TestCurlSeesThePlainHTTPStreamCut: curl reading a plain-HTTP SSE stream
// through the proxy exits with an error when the cancel cuts it, never as
// if the answer were whole.
func TestCurlSeesThePlainHTTPStreamCut(t *testing.T) {
	curl, err := exec.LookPath("curl")
	if err != nil {
		t.Fatal("curl is not installed: run scripts/test-deps")
	}
	up := newUpstream(t, false, sse)
	e := newEnv(t, envOptions{})
	e.admit("curl-sse")
	cmd := exec.Command(curl, "--silent", "--show-error", "--no-buffer", "--max-time", "20",
		"--proxy", e.server.URL, "--proxy-user", "curl-sse:1", up.URL+"/events")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := bufio.NewReader(out)
	for range 2 {
		if _, err := lines.ReadString('\n'); err != nil {
			t.Fatalf("curl before the cancel: %v (%s)", err, stderr.String())
		}
	}
	e.cancel("curl-sse", time.Minute)
	_, _ = io.Copy(io.Discard, lines)
	err = cmd.Wait()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() == 0 {
		t.Fatalf("curl exited %v after the cut, want a non-zero exit; stderr: %s", err, stderr.String())
	}
	t.Logf("curl exit %d: %s", exit.ExitCode(), strings.TrimSpace(stderr.String()))
	e.awaitCut("curl-sse", func(state.Event) bool { return true })
}

// TestStreamedAnswerOfAnEffectDrains: a POST whose answer streams (SSE or
// NDJSON) to a destination not declared effects: none is an effect like
// any other: its answer goes on reaching the agent after the cancel, until
// the drain deadline, where it is cut (the client sees an error, the audit
// log has the cut); the format of the answer decides nothing.
func TestStreamedAnswerOfAnEffectDrains(t *testing.T) {
	for _, contentType := range []string{"text/event-stream", "application/x-ndjson"} {
		t.Run(contentType, func(t *testing.T) {
			up := newUpstream(t, false, testkit.Stream(contentType, "{\"progress\":%d}\n\n", 20*time.Millisecond))
			e := newEnv(t, envOptions{})
			e.admit("job")
			c := e.client("job", 1)
			c.Timeout = 0
			resp, lines := streamed(t, 1)(c.Post(up.URL+"/deploy", "application/json", strings.NewReader(`{"stream":true}`)))
			const drain = 1500 * time.Millisecond
			e.cancel("job", drain)
			// Well inside the drain, the answer still comes.
			for deadline := time.Now().Add(drain / 2); time.Now().Before(deadline); {
				if _, err := lines.ReadString('\n'); err != nil {
					t.Fatalf("the streamed answer of an effect was cut inside its drain: %v", err)
				}
			}
			d := endsWithin(t, lines, 5*time.Second, func() {})
			t.Logf("cut %v after the middle of the drain", d)
			key := resp.Header.Get(refusal.IntentHeader)
			if in := e.intent("job", key); in.State != state.IntentResponded {
				t.Fatalf("the provider answered: want RESPONDED, got %s", in.State)
			}
			e.awaitCut("job", func(ev state.Event) bool {
				return ev.Intent == key && strings.HasPrefix(ev.Reason, state.ReasonDrainTimeout)
			})
		})
	}
}
