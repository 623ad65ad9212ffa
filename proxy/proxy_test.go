package proxy_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/state"
)

func TestRequestOfActiveRunIsForwardedAndRecordedResponded(t *testing.T) {
	for _, tlsOn := range []bool{false, true} {
		t.Run(fmt.Sprintf("tls=%v", tlsOn), func(t *testing.T) {
			e := newEnv(t, envOptions{})
			up := newUpstream(t, tlsOn, nil)
			e.admit("r1")
			resp, body := do(t, e.client("r1", 1), "POST", up.URL+"/charge?secret=s", strings.NewReader(`{"amount":1}`), nil)
			if resp.StatusCode != 200 || string(body) != "hello POST /charge" {
				t.Fatalf("got %d %q", resp.StatusCode, body)
			}
			key := resp.Header.Get(refusal.IntentHeader)
			if key == "" {
				t.Fatal("forwarded response has no X-Stopgate-Intent")
			}
			in := e.intent("r1", key)
			if in.State != state.IntentResponded || in.StatusCode != 200 || in.Method != "POST" || in.Boundary != state.BoundaryHTTP {
				t.Fatalf("intent %+v", in)
			}
			if strings.Contains(in.Target, "secret") || !strings.HasSuffix(in.Target, "/charge") {
				t.Fatalf("recorded target %q must keep the path and drop the query", in.Target)
			}
			if up.Hits.Load() != 1 {
				t.Fatalf("upstream hits %d", up.Hits.Load())
			}
		})
	}
}

func TestUpstreamCannotSpeakInStopgateHeaders(t *testing.T) {
	e := newEnv(t, envOptions{})
	up := newUpstream(t, false, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(refusal.Header, "run_not_active")
		w.Header().Set(refusal.IntentHeader, "forged")
	})
	resp, _ := do(t, e.client("hdr", 1), "GET", up.URL+"/", nil, nil)
	if resp.Header.Get(refusal.Header) != "" || resp.Header.Get(refusal.IntentHeader) == "forged" {
		t.Fatalf("upstream headers reached the agent as stopgate's: %v", resp.Header)
	}
}

func TestRunIdentityNeverReachesUpstream(t *testing.T) {
	for _, tlsOn := range []bool{false, true} {
		t.Run(fmt.Sprintf("tls=%v", tlsOn), func(t *testing.T) {
			e := newEnv(t, envOptions{})
			up := newUpstream(t, tlsOn, nil)
			h := http.Header{"X-Run-Id": {"r2"}, "X-Run-Version": {"1"}, "X-Other": {"kept"}}
			resp, _ := do(t, e.client("r2", 1), "GET", up.URL+"/", nil, h)
			if resp.StatusCode != 200 {
				t.Fatalf("status %d", resp.StatusCode)
			}
			got := up.LastHeader()
			for _, k := range []string{"X-Run-Id", "X-Run-Version", "Proxy-Authorization", "Proxy-Connection"} {
				if got.Get(k) != "" {
					t.Errorf("upstream received %s: %q", k, got.Get(k))
				}
			}
			if got.Get("X-Other") != "kept" {
				t.Errorf("an ordinary header was dropped")
			}
		})
	}
}

func TestRefusalsAreExplicit(t *testing.T) {
	e := newEnv(t, envOptions{noAutoAdmit: true})
	up := newUpstream(t, false, nil)
	e.admit("ok")
	for _, tc := range []struct {
		name       string
		client     *http.Client
		header     http.Header
		wantStatus int
		wantError  string
	}{
		{"no identity", e.client("", 0), nil, 407, "no_run_identity"},
		{"bad version header", e.client("", 0), http.Header{"X-Run-Id": {"ok"}, "X-Run-Version": {"two"}}, 400, "bad_run_identity"},
		{"version without run", e.client("", 0), http.Header{"X-Run-Version": {"1"}}, 400, "bad_run_identity"},
		{"bad run id", e.client("", 0), http.Header{"X-Run-Id": {"a b{c}"}}, 400, "bad_run_identity"},
		{"bad credentials version", e.client("", 0), http.Header{"Proxy-Authorization": {"Basic b2s6LTE="}}, 407, "no_run_identity"},
		{"unseen run without auto-admit", e.client("never", 1), nil, 409, "run_not_admitted"},
		{"stale version", e.client("ok", 5), nil, 409, "stale_version"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := do(t, tc.client, "GET", up.URL+"/", nil, tc.header)
			r := decodeRefusal(t, body)
			if resp.StatusCode != tc.wantStatus || r.Error != tc.wantError || resp.Header.Get(refusal.Header) != tc.wantError {
				t.Fatalf("got %d %s (header %q): %s", resp.StatusCode, r.Error, resp.Header.Get(refusal.Header), body)
			}
			if r.Message == "" {
				t.Fatal("refusal without a message")
			}
			if tc.wantStatus == 407 && resp.Header.Get("Proxy-Authenticate") == "" {
				t.Fatal("407 without Proxy-Authenticate")
			}
		})
	}
	if up.Hits.Load() != 0 {
		t.Fatalf("refused requests reached the upstream %d times", up.Hits.Load())
	}
}

func TestCancelledRunIsRefusedOverHTTPAndInsideTunnel(t *testing.T) {
	for _, tlsOn := range []bool{false, true} {
		t.Run(fmt.Sprintf("tls=%v", tlsOn), func(t *testing.T) {
			e := newEnv(t, envOptions{})
			up := newUpstream(t, tlsOn, nil)
			e.admit("r3")
			c := e.client("r3", 1)
			// The same kept-alive client (one tunnel when TLS) before and after the cancel.
			if resp, _ := do(t, c, "POST", up.URL+"/a", strings.NewReader("x"), nil); resp.StatusCode != 200 {
				t.Fatalf("before cancel: %d", resp.StatusCode)
			}
			e.cancel("r3", time.Minute)
			resp, body := do(t, c, "POST", up.URL+"/b", strings.NewReader("y"), nil)
			r := decodeRefusal(t, body)
			if resp.StatusCode != 409 || r.Error != "run_not_active" || r.Status != "CANCELLING" || r.CancelVersion != 2 || r.ObservedVersion != 1 || r.Recorded != "CANCELLED_BEFORE_DISPATCH" || r.RunID != "r3" {
				t.Fatalf("after cancel: %d %s", resp.StatusCode, body)
			}
			if resp.Header.Get(refusal.Header) != "run_not_active" || resp.Header.Get(refusal.IntentHeader) != r.Intent {
				t.Fatalf("refusal headers %v", resp.Header)
			}
			if in := e.intent("r3", r.Intent); in.State != state.IntentCancelledBeforeDispatch {
				t.Fatalf("refused intent %+v", in)
			}
			if up.Hits.Load() != 1 {
				t.Fatalf("upstream hits %d, want 1", up.Hits.Load())
			}
		})
	}
}

func TestIdempotencyKeyRules(t *testing.T) {
	e := newEnv(t, envOptions{})
	release := make(chan struct{})
	up := newUpstream(t, false, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			<-release
		}
		w.WriteHeader(201)
	})
	e.admit("r4")
	c := e.client("r4", 1)
	h := http.Header{"Idempotency-Key": {"charge-1"}}

	done := make(chan int)
	go func() {
		resp, _ := do(t, c, "POST", up.URL+"/slow", strings.NewReader("A"), h)
		done <- resp.StatusCode
	}()
	testkit.Eventually(t, 5*time.Second, "first attempt in flight", func() bool { return up.Hits.Load() == 1 })
	resp, body := do(t, e.client("r4", 1), "POST", up.URL+"/slow", strings.NewReader("A"), h)
	if r := decodeRefusal(t, body); resp.StatusCode != 409 || r.Error != "intent_in_progress" {
		t.Fatalf("duplicate while in flight: %d %s", resp.StatusCode, body)
	}
	close(release)
	if code := <-done; code != 201 {
		t.Fatalf("first attempt: %d", code)
	}
	resp, body = do(t, c, "POST", up.URL+"/slow", strings.NewReader("B"), h)
	if r := decodeRefusal(t, body); resp.StatusCode != 409 || r.Error != "idempotency_key_reused" {
		t.Fatalf("same key, other body: %d %s", resp.StatusCode, body)
	}
	// The effect is over: a replay gets its record, never a second charge.
	resp, body = do(t, c, "POST", up.URL+"/slow", strings.NewReader("A"), h)
	var over struct {
		Error  string       `json:"error"`
		Record state.Intent `json:"intent_record"`
	}
	if err := json.Unmarshal(body, &over); err != nil || resp.StatusCode != 409 || over.Error != "idempotency_key_reused" ||
		over.Record.State != state.IntentResponded || over.Record.StatusCode != 201 || resp.Header.Get(refusal.IntentHeader) != "charge-1" {
		t.Fatalf("replay after RESPONDED: %d %v %s", resp.StatusCode, resp.Header, body)
	}
	// Another request under the key is refused too, whatever its body.
	resp, body = do(t, c, "GET", up.URL+"/harmless", nil, h)
	if r := decodeRefusal(t, body); resp.StatusCode != 409 || r.Error != "idempotency_key_reused" {
		t.Fatalf("a GET under a finished POST's key: %d %s", resp.StatusCode, body)
	}
	// Duplicates are refused without touching the record; the audit log has them.
	if in := e.intent("r4", "charge-1"); in.Attempts != 1 || in.State != state.IntentResponded || in.Refusals != 0 ||
		in.Method != "POST" || !strings.HasSuffix(in.Target, "/slow") || in.StatusCode != 201 {
		t.Fatalf("intent after replays %+v", in)
	}
	if up.Hits.Load() != 1 {
		t.Fatalf("upstream hits %d, want 1", up.Hits.Load())
	}
	if got := up.LastHeader().Get("Idempotency-Key"); got != "charge-1" {
		t.Fatalf("Idempotency-Key must reach the provider, got %q", got)
	}
}

func TestLargeUploadIsStreamedWholeAndCapped(t *testing.T) {
	e := newEnv(t, envOptions{maxBody: 8 << 20})
	up := newUpstream(t, true, nil)
	e.admit("r5")
	big := bytes.Repeat([]byte("0123456789abcdef"), (5<<20)/16)
	resp, _ := do(t, e.client("r5", 1), "PUT", up.URL+"/upload", bytes.NewReader(big), nil)
	if resp.StatusCode != 200 {
		t.Fatalf("upload: %d", resp.StatusCode)
	}
	got := up.LastBody()
	if !bytes.Equal(got, big) {
		t.Fatalf("upstream got %d bytes, want %d identical", len(got), len(big))
	}
	in := e.intent("r5", resp.Header.Get(refusal.IntentHeader))
	if !strings.HasPrefix(in.BodyDigest, "sha256:") {
		t.Fatalf("digest %q", in.BodyDigest)
	}
	tooBig := bytes.Repeat([]byte("x"), 9<<20)
	resp, body := do(t, e.client("r5", 1), "PUT", up.URL+"/upload", bytes.NewReader(tooBig), nil)
	if r := decodeRefusal(t, body); resp.StatusCode != 413 || r.Error != "body_too_large" {
		t.Fatalf("over the cap: %d %s", resp.StatusCode, body)
	}
	if up.Hits.Load() != 1 {
		t.Fatalf("upstream hits %d, want 1", up.Hits.Load())
	}
}

func TestUpstreamFailuresAreRecordedHonestly(t *testing.T) {
	e := newEnv(t, envOptions{})
	e.admit("r6")
	c := e.client("r6", 1)

	// Nothing listens: the dial fails before a byte is written.
	dead := newUpstream(t, false, nil)
	deadURL := dead.URL
	dead.Close()
	resp, body := do(t, c, "POST", deadURL+"/x", strings.NewReader("p"), nil)
	r := decodeRefusal(t, body)
	if resp.StatusCode != 502 || r.Recorded != "NOT_SENT" {
		t.Fatalf("dial failure: %d %s", resp.StatusCode, body)
	}
	if in := e.intent("r6", r.Intent); in.State != state.IntentNotSent {
		t.Fatalf("dial failure recorded %+v", in)
	}

	// The upstream reads the request and hangs up without an answer.
	up := newUpstream(t, false, func(w http.ResponseWriter, r *http.Request) {
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			conn.Close()
		}
	})
	resp, body = do(t, c, "POST", up.URL+"/y", strings.NewReader("p"), nil)
	r = decodeRefusal(t, body)
	if resp.StatusCode != 502 || r.Recorded != "UNKNOWN" {
		t.Fatalf("hang-up after send: %d %s", resp.StatusCode, body)
	}
	if in := e.intent("r6", r.Intent); in.State != state.IntentUnknown {
		t.Fatalf("hang-up recorded %+v", in)
	}
}

// TestRaceConcurrentPostsWhileCancelLands: many POSTs race one cancel. The
// upstream must have seen exactly the requests the store admitted (all
// before the cancel), and every other one must be CANCELLED_BEFORE_DISPATCH.
func TestRaceConcurrentPostsWhileCancelLands(t *testing.T) {
	e := newEnv(t, envOptions{})
	up := newUpstream(t, false, nil)
	const workers, perWorker = 8, 10
	for round := range raceRounds(t) {
		run := fmt.Sprintf("race-%d", round)
		e.admit(run)
		before := up.Hits.Load()
		var wg sync.WaitGroup
		var forwarded, refused, other int64
		var others []string
		var mu sync.Mutex
		for w := range workers {
			wg.Go(func() {
				c := e.client(run, 1)
				for i := range perWorker {
					resp, body := do(t, c, "POST", up.URL+"/effect", strings.NewReader(fmt.Sprintf("%d-%d", w, i)), nil)
					mu.Lock()
					switch resp.StatusCode {
					case 200:
						forwarded++
					case 409:
						refused++
					default:
						other++
						others = append(others, fmt.Sprintf("%d %s", resp.StatusCode, body))
					}
					mu.Unlock()
				}
			})
		}
		wg.Go(func() {
			time.Sleep(time.Duration(round%10) * 3 * time.Millisecond)
			e.cancel(run, time.Minute)
		})
		wg.Wait()
		hits := up.Hits.Load() - before
		counts := map[state.IntentState]int64{}
		for _, in := range e.intents(run) {
			counts[in.State]++
		}
		admitted := counts[state.IntentResponded] + counts[state.IntentInFlight]
		if other != 0 || hits != forwarded || hits != admitted || counts[state.IntentCancelledBeforeDispatch] != refused || forwarded+refused != workers*perWorker {
			t.Fatalf("%s: upstream %d, forwarded %d, refused %d, other %d %q, ledger %v", run, hits, forwarded, refused, other, others, counts)
		}
		evs, err := e.store.Events(context.Background(), run)
		if err != nil {
			t.Fatal(err)
		}
		cancelled := false
		for _, ev := range evs {
			if ev.Kind == state.EventRunCancelled {
				cancelled = true
			}
			if cancelled && ev.Kind == state.EventIntentAdmitted {
				t.Fatalf("%s: intent %s admitted after the cancel committed", run, ev.Intent)
			}
		}
		if round < 10 {
			t.Logf("%s: %d forwarded before the cancel, %d refused after", run, forwarded, refused)
		}
	}
}

func TestNotAProxyRequestIsAClearError(t *testing.T) {
	e := newEnv(t, envOptions{})
	resp, err := http.Get(e.server.URL + "/v1/runs")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if r := decodeRefusal(t, body); resp.StatusCode != 400 || r.Error != "not_a_proxy_request" {
		t.Fatalf("got %d %s", resp.StatusCode, body)
	}
}

func TestMetricsCountWhatTheProxyDid(t *testing.T) {
	reg := prometheus.NewRegistry()
	e := newEnv(t, envOptions{registry: reg})
	up := newUpstream(t, false, nil)
	e.admit("m")
	do(t, e.client("m", 1), "GET", up.URL+"/", nil, nil)
	e.cancel("m", time.Minute)
	do(t, e.client("m", 1), "GET", up.URL+"/", nil, nil)
	got := gathered(t, reg)
	for name, want := range map[string]float64{
		"stopgate_decisions_total/http/admitted":      1,
		"stopgate_decisions_total/http/finished":      1,
		"stopgate_decisions_total/http/refused":       1,
		"stopgate_refusals_total/http/run_not_active": 1,
		"stopgate_open/flows":                         0,
	} {
		if got[name] != want {
			t.Errorf("%s = %v, want %v (all: %v)", name, got[name], want, got)
		}
	}
}

// raceRounds is how many times the race tests repeat: 10 by default, more
// with STOPGATE_RACE_ROUNDS for a soak.
func raceRounds(t *testing.T) int {
	n := 10
	if v := os.Getenv("STOPGATE_RACE_ROUNDS"); v != "" {
		if _, err := fmt.Sscan(v, &n); err != nil || n < 1 {
			t.Fatalf("STOPGATE_RACE_ROUNDS=%q: want a whole number of 1 or more", v)
		}
	}
	return n
}

func TestListenerBoundToRunNamesEveryRequest(t *testing.T) {
	e := newEnv(t, envOptions{})
	up := newUpstream(t, true, nil)
	h, err := e.proxy.ForRun("bound")
	if err != nil {
		t.Fatal(err)
	}
	bound := httptest.NewServer(h)
	defer bound.Close()
	e.admit("bound")
	e.admit("other")
	c := e.client("", 0)
	u, _ := url.Parse(bound.URL)
	c.Transport.(*http.Transport).Proxy = http.ProxyURL(u)
	if resp, _ := do(t, c, "GET", up.URL+"/", nil, nil); resp.StatusCode != 200 {
		t.Fatalf("through the bound listener: %d", resp.StatusCode)
	}
	// A page script naming another run, inside the intercepted tunnel.
	if resp, _ := do(t, c, "GET", up.URL+"/", nil, http.Header{"X-Run-Id": {"other"}}); resp.StatusCode != 200 {
		t.Fatalf("a request naming another run: %d", resp.StatusCode)
	}
	if n := len(e.intents("bound")); n != 2 {
		t.Fatalf("bound run has %d intents, want 2", n)
	}
	if ins, _ := e.store.Intents(context.Background(), "other"); len(ins) != 0 {
		t.Fatalf("a client of the bound listener spent another run's effects: %+v", ins)
	}
	if got := up.LastHeader().Get("X-Run-Id"); got != "" {
		t.Fatalf("the named run reached the upstream: %q", got)
	}
	e.cancel("bound", time.Minute)
	for _, h := range []http.Header{nil, {"X-Run-Id": {"other"}}} {
		if resp, _ := do(t, c, "GET", up.URL+"/", nil, h); resp.StatusCode != 409 {
			t.Fatalf("bound run after its cancel (headers %v): %d", h, resp.StatusCode)
		}
	}
	if _, err := e.proxy.ForRun("bad run"); err == nil {
		t.Fatal("a bad run id was bound")
	}
}

func TestRequiredRunTokenIsTheOnlyWayToNameARun(t *testing.T) {
	signer, err := runtoken.New([]byte("0123456789abcdef0123456789abcdef"))
	if err != nil {
		t.Fatal(err)
	}
	e := newEnv(t, envOptions{tokens: signer, requireTok: true})
	up := newUpstream(t, true, nil)
	e.admit("tk")
	token := signer.Sign("tk", 1, time.Now().Add(time.Hour))
	u, _ := url.Parse(e.server.URL)
	u.User = url.UserPassword("tk", token)
	withToken := e.client("", 0)
	withToken.Transport.(*http.Transport).Proxy = http.ProxyURL(u)

	if resp, _ := do(t, withToken, "POST", up.URL+"/x", strings.NewReader("a"), nil); resp.StatusCode != 200 {
		t.Fatalf("with the run's token: %d", resp.StatusCode)
	}
	// A bare version is refused at the CONNECT, before any tunnel opens.
	if _, err := e.client("tk", 1).Post(up.URL+"/x", "text/plain", strings.NewReader("b")); err == nil || !strings.Contains(err.Error(), "Proxy Authentication Required") {
		t.Fatalf("with a bare version: %v, want the CONNECT refused with 407", err)
	}
	plain := newUpstream(t, false, nil)
	resp, body := do(t, e.client("tk", 1), "POST", plain.URL+"/x", strings.NewReader("b"), nil)
	if r := decodeRefusal(t, body); resp.StatusCode != 407 || !strings.Contains(r.Message, "a signed run token is required") {
		t.Fatalf("with a bare version over plain HTTP: %d %s", resp.StatusCode, body)
	}
	e.cancel("tk", time.Minute)
	resp, body = do(t, withToken, "POST", up.URL+"/x", strings.NewReader("c"), nil)
	if r := decodeRefusal(t, body); resp.StatusCode != 409 || r.Error != "run_not_active" || r.ObservedVersion != 1 {
		t.Fatalf("the token after the cancel: %d %s", resp.StatusCode, body)
	}
	if up.Hits.Load() != 1 || plain.Hits.Load() != 0 {
		t.Fatalf("upstreams saw %d and %d requests, want 1 and 0", up.Hits.Load(), plain.Hits.Load())
	}
}

// TestClientGoneMidBodyIsNotAStoreFailure: a client that hangs up in the
// middle of its request body sends nothing upstream, and is counted as the
// client's doing (client_gone, or bad_request_body when the proxy reads
// the cut first), never as the store failing.
func TestClientGoneMidBodyIsNotAStoreFailure(t *testing.T) {
	reg := prometheus.NewRegistry()
	e := newEnv(t, envOptions{registry: reg})
	up := newUpstream(t, false, nil)
	for range 5 {
		conn, err := net.Dial("tcp", e.server.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(conn, "POST %s/pay HTTP/1.1\r\nHost: %s\r\nProxy-Authorization: Basic %s\r\nContent-Length: 100\r\n\r\n0123456789",
			up.URL, up.Listener.Addr(), base64.StdEncoding.EncodeToString([]byte("gone:1")))
		_ = conn.Close()
	}
	testkit.Eventually(t, 5*time.Second, "five refusals of cut bodies counted", func() bool {
		got := gathered(t, reg)
		return got["stopgate_refusals_total/http/client_gone"]+got["stopgate_refusals_total/http/bad_request_body"] == 5
	})
	for name, v := range gathered(t, reg) {
		if strings.HasPrefix(name, "stopgate_store_errors_total") && v != 0 || strings.Contains(name, "store_unavailable") {
			t.Errorf("a client gone mid-body counted as a store failure: %s = %v", name, v)
		}
	}
	if n := up.Hits.Load(); n != 0 {
		t.Fatalf("a truncated body reached the upstream %d times", n)
	}
}
