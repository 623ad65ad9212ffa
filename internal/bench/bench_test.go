package bench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stopgate/stopgate/state"
)

func TestParseStatCountsUserAndSystemTicksPastAnyCommandName(t *testing.T) {
	// Fields 14 and 15 are utime 250 and stime 50: 300 ticks of 10 ms.
	line := "4242 (a (weird) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 8 0 100 0 0\n"
	got, err := parseStat([]byte(line))
	if err != nil {
		t.Fatal(err)
	}
	if got != 3*time.Second {
		t.Fatalf("cpu = %s, want 3s", got)
	}
	for _, bad := range []string{"", "4242 no-parens S 1", "1 (x) S 1 2 3"} {
		if _, err := parseStat([]byte(bad)); err == nil {
			t.Errorf("parseStat(%q) accepted a malformed line", bad)
		}
	}
}

func TestCPUTimeOfThisProcessGrowsWithWork(t *testing.T) {
	before, err := cpuTime(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	// Spin until the kernel has counted at least one tick, within a bound
	// that a busy machine still meets.
	deadline := time.Now().Add(10 * time.Second)
	after := before
	for after <= before && time.Now().Before(deadline) {
		for i := 0; i < 1_000_000; i++ {
			_ = i * i
		}
		if after, err = cpuTime(os.Getpid()); err != nil {
			t.Fatal(err)
		}
	}
	if after <= before {
		t.Fatalf("cpu time did not grow over 10 s of spinning: %s → %s", before, after)
	}
	if _, err := cpuTime(-1); err == nil {
		t.Fatal("no error for a process that does not exist")
	}
}

func TestMachineCPUCountsBusyStatesOnly(t *testing.T) {
	// user nice system idle iowait irq softirq steal guest guest_nice
	got, err := parseMachineStat([]byte("cpu  100 2 30 9000 500 4 6 8 50 1\ncpu0 1 2 3 4\n"))
	if err != nil {
		t.Fatal(err)
	}
	if want := 150 * clockTick; got != want {
		t.Fatalf("busy = %s, want %s (user+nice+system+irq+softirq+steal)", got, want)
	}
	if _, err := machineCPU(); err != nil {
		t.Fatal(err)
	}
}

func TestPercentileAndSpread(t *testing.T) {
	var d []time.Duration
	for i := 1; i <= 100; i++ {
		d = append(d, time.Duration(i)*time.Millisecond)
	}
	for _, tc := range []struct {
		p    float64
		want time.Duration
	}{{50, 50 * time.Millisecond}, {99, 99 * time.Millisecond}, {100, 100 * time.Millisecond}, {0, time.Millisecond}} {
		if got := percentile(d, tc.p); got != tc.want {
			t.Errorf("p%.0f = %s, want %s", tc.p, got, tc.want)
		}
	}
	if percentile(nil, 50) != 0 {
		t.Error("percentile of nothing is not 0")
	}
	if s := spreadOf([]float64{3, 1, 2}); s != (spread{Median: 2, Min: 1, Max: 3, N: 3}) {
		t.Errorf("odd spread %+v", s)
	}
	if s := spreadOf([]float64{4, 1, 2, 3}); s.Median != 2.5 {
		t.Errorf("even median %v, want 2.5", s.Median)
	}
}

func TestTableIsAlignedMarkdown(t *testing.T) {
	tb := &table{title: "T", header: []string{"case", "req/s"}, notes: []string{"note"}}
	tb.add("direct", thousands(68734))
	tb.add("stopgate, embedded store", rateCell(spread{Median: 1110, Min: 1000, Max: 1200, N: 3}))
	var b bytes.Buffer
	tb.print(&b)
	want := "### T\n\n" +
		"| case                     |               req/s |\n" +
		"| ------------------------ | ------------------: |\n" +
		"| direct                   |              68 734 |\n" +
		"| stopgate, embedded store | 1 110 (1 000–1 200) |\n" +
		"\nnote\n\n"
	if b.String() != want {
		t.Fatalf("table:\n%s\nwant:\n%s", b.String(), want)
	}
}

func TestRunLoadMeasuresOnlyItsWindow(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("i") == "" {
			http.Error(w, "no request number", http.StatusBadRequest)
			return
		}
		w.Header().Set(headerIntent, "k")
		_, _ = io.WriteString(w, "ok")
	}))
	defer srv.Close()
	spec := loadSpec{Conns: 4, Method: http.MethodGet, URL: srv.URL + "/small", RequireHeader: headerIntent,
		Warmup: 50 * time.Millisecond, Window: 300 * time.Millisecond, Watch: []int{os.Getpid()}}
	res, err := runLoad(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	if res.Requests == 0 || res.Errors != 0 {
		t.Fatalf("requests %d, errors %d (%s)", res.Requests, res.Errors, res.FirstError)
	}
	// The window is timed, not counted: it lasts at least its length
	// (more on a busy machine).
	if res.Elapsed < spec.Window || res.Elapsed > spec.Window+5*time.Second {
		t.Errorf("window %s, want about %s", res.Elapsed, spec.Window)
	}
	if len(res.CPU) != 1 {
		t.Errorf("cpu %v: want one figure, for the one watched process", res.CPU)
	}
	for i := 1; i < len(res.Latencies); i++ {
		if res.Latencies[i] < res.Latencies[i-1] {
			t.Fatal("latencies are not sorted")
		}
	}
}

func TestRunLoadCountsUnguardedAnswersAsErrors(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") }))
	defer srv.Close()
	res, err := runLoad(context.Background(), loadSpec{Conns: 1, Method: http.MethodGet, URL: srv.URL, RequireHeader: headerIntent,
		Warmup: 10 * time.Millisecond, Window: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if res.Errors == 0 || !strings.Contains(res.FirstError, "not guarded") {
		t.Fatalf("errors %d, first %q: an answer without %s must count as a failure", res.Errors, res.FirstError, headerIntent)
	}
}

func TestRunLoadGivesEachConnectionTheProxyCredentialsOfItsOwn(t *testing.T) {
	// The server plays the proxy: it sees each request's credentials and
	// its connection number (?i=CONN-SEQ), and answers by itself (the
	// upstream address, where nothing listens, is never dialled).
	var (
		mu   sync.Mutex
		seen = map[string]string{}
		bad  []string
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user, _, _ := parseProxyAuth(r.Header.Get("Proxy-Authorization"))
		conn, _, _ := strings.Cut(r.URL.Query().Get("i"), "-")
		mu.Lock()
		if prev, ok := seen[conn]; ok && prev != user {
			bad = append(bad, fmt.Sprintf("connection %s sent as %q, then as %q", conn, prev, user))
		}
		seen[conn] = user
		mu.Unlock()
		_, _ = io.WriteString(w, "ok")
	}))
	defer srv.Close()
	proxyAt := func(run string) *url.URL {
		u, err := url.Parse(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		u.User = url.UserPassword(run, "1")
		return u
	}
	spec := loadSpec{Conns: 4, Method: http.MethodGet, URL: "http://127.0.0.1:1/small",
		ProxyFor: func(conn int) *url.URL { return proxyAt(fmt.Sprintf("run-c%d", conn)) },
		Warmup:   10 * time.Millisecond, Window: 100 * time.Millisecond}
	res, err := runLoad(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	if res.Requests == 0 || res.Errors != 0 {
		t.Fatalf("requests %d, errors %d (%s)", res.Requests, res.Errors, res.FirstError)
	}
	want := map[string]string{"0": "run-c0", "1": "run-c1", "2": "run-c2", "3": "run-c3"}
	mu.Lock()
	defer mu.Unlock()
	if !maps.Equal(seen, want) || len(bad) > 0 {
		t.Fatalf("credentials by connection %v, want %v; %v", seen, want, bad)
	}
}

// parseProxyAuth reads Basic credentials as the proxy does.
func parseProxyAuth(h string) (user, pass string, ok bool) {
	r := http.Request{Header: http.Header{"Authorization": {h}}}
	return r.BasicAuth()
}

func TestRunLoadNeverMeasuresAConnectionsFirstRequest(t *testing.T) {
	// Every connection's first request (?i=CONN-0) is refused, as a run
	// that is still being admitted might be; with no warm-up at all the
	// window must still open only after those answers.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Query().Get("i"), "-0") {
			time.Sleep(20 * time.Millisecond)
			http.Error(w, "first request", http.StatusServiceUnavailable)
			return
		}
		_, _ = io.WriteString(w, "ok")
	}))
	defer srv.Close()
	res, err := runLoad(context.Background(), loadSpec{Conns: 8, Method: http.MethodGet, URL: srv.URL,
		Warmup: 0, Window: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if res.Requests == 0 || res.Errors != 0 {
		t.Fatalf("requests %d, errors %d (%s): a first request was measured", res.Requests, res.Errors, res.FirstError)
	}
}

func TestCacheGivesBackWhatItKeptAndOnlyForThisBinary(t *testing.T) {
	root := t.TempDir()
	stale := filepath.Join(root, "0123456789abcdef")
	if err := os.MkdirAll(stale, 0o700); err != nil {
		t.Fatal(err)
	}
	c, err := openCache(root, "")
	if err != nil {
		t.Fatal(err)
	}
	if _, ok, err := c.restore("redis-10-0", t.TempDir()); ok || err != nil {
		t.Fatalf("empty cache: hit %v, err %v", ok, err)
	}
	src := t.TempDir()
	if err := os.MkdirAll(filepath.Join(src, "appendonlydir"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "appendonlydir", "base.rdb"), []byte("data"), 0o600); err != nil {
		t.Fatal(err)
	}
	loads := []loadRecord{{Store: "Redis everysec", What: "finished runs", Count: 10, Took: time.Second, Size: 100}}
	if err := c.save("redis-10-0", src, loads); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Errorf("another binary's entries are still there: %v", err)
	}
	dst := t.TempDir()
	got, ok, err := c.restore("redis-10-0", dst)
	if err != nil || !ok {
		t.Fatalf("restore: hit %v, err %v", ok, err)
	}
	if b, err := os.ReadFile(filepath.Join(dst, "appendonlydir", "base.rdb")); err != nil || string(b) != "data" {
		t.Fatalf("restored file: %q, %v", b, err)
	}
	if len(got) != 1 || got[0].Count != 10 || got[0].Took != time.Second || got[0].Size != 100 {
		t.Fatalf("restored loads %+v", got)
	}
	if _, err := openCache(root, "../escape"); err == nil {
		t.Error("a key with a path in it was accepted")
	}
	keyed, err := openCache(root, "abc123")
	if err != nil || keyed.dir != filepath.Join(root, "abc123") {
		t.Fatalf("keyed cache at %q, %v", keyed.dir, err)
	}
	off, err := openCache("", "")
	if err != nil {
		t.Fatal(err)
	}
	if err := off.save("x", src, loads); err != nil {
		t.Fatal(err)
	}
	if _, ok, _ := off.restore("x", t.TempDir()); ok {
		t.Fatal("a cache that is off gave something back")
	}
}

func TestScenariosAddARunPerConnectionAtTheLargestCountOnlyWhenAsked(t *testing.T) {
	for _, tc := range []struct {
		runPerConn bool
		want       []string
	}{
		{true, []string{"http/64", "http/1", "http-runs/64 a run per connection", "https/64", "https/1"}},
		{false, []string{"http/64", "http/1", "https/64", "https/1"}},
	} {
		e := &env{cfg: &Config{Conns: []int{64, 1}, RunPerConn: tc.runPerConn}}
		var got []string
		for _, sc := range e.scenarios() {
			s := fmt.Sprintf("%s/%d", sc.key, sc.conns)
			if sc.runPerConn {
				s += " a run per connection"
			}
			got = append(got, s)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("RunPerConn %v: scenarios %v, want %v", tc.runPerConn, got, tc.want)
		}
	}
}

func TestSpecGivesEachConnectionAValidRunOfItsOwnOnlyInTheRunPerConnectionScenario(t *testing.T) {
	e := &env{cfg: &Config{Conns: []int{64}, RunPerConn: true, Warmup: time.Millisecond, Window: time.Millisecond},
		up: &upstream{HTTPURL: "http://127.0.0.1:1"}}
	proxy := target{key: "p", proxy: func(run string) *url.URL {
		return &url.URL{Scheme: "http", User: url.UserPassword(run, "1"), Host: "127.0.0.1:2"}
	}, spec: func(*loadSpec) {}}
	direct := target{key: "d", spec: func(*loadSpec) {}}
	const run = "bench-http-runs-64-everysec-r12"
	for _, sc := range e.scenarios() {
		s := e.spec(sc, proxy, run)
		if !sc.runPerConn {
			if s.ProxyFor != nil || s.Proxy.User.Username() != run {
				t.Errorf("%s ×%d: proxy %v, per connection %v: want every connection on run %q", sc.label, sc.conns, s.Proxy, s.ProxyFor != nil, run)
			}
			continue
		}
		if s.Proxy != nil || s.ProxyFor == nil {
			t.Fatalf("%s: proxy %v, per connection %v: want a proxy per connection", sc.label, s.Proxy, s.ProxyFor != nil)
		}
		runs := map[string]bool{}
		for conn := range sc.conns {
			u := s.ProxyFor(conn)
			id := u.User.Username()
			if err := state.ValidateRunID(id); err != nil {
				t.Errorf("connection %d: %v", conn, err)
			}
			if !strings.HasPrefix(id, run+"-") || u.Host != "127.0.0.1:2" {
				t.Errorf("connection %d: proxy %v, want run %s-… at 127.0.0.1:2", conn, u, run)
			}
			runs[id] = true
		}
		if len(runs) != sc.conns {
			t.Errorf("%d connections on %d runs, want a run each", sc.conns, len(runs))
		}
		if d := e.spec(sc, direct, run); d.Proxy != nil || d.ProxyFor != nil {
			t.Errorf("direct, %s: proxy %v, per connection %v: want none", sc.label, d.Proxy, d.ProxyFor != nil)
		}
	}
}
