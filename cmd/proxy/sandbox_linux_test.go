package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"

	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/state"
)

// The sandbox of stopgate exec, as an ordinary user would run it: CI runs
// as root, so these tests drop exec to uid 65534 themselves (setpriv), and
// give it nothing but its run's worker token, against a plain serve.

// sandboxUID is the unprivileged user the tests run exec as.
const sandboxUID = "65534"

// sandboxKit is what an unprivileged exec needs that the test's own files
// may not give it (the test binary's directory is the test user's): a copy
// of stopgate and of the clients, in a directory anyone may read.
type sandboxKit struct {
	dir     string
	binary  string
	clients string
}

func newSandboxKit(t *testing.T) *sandboxKit {
	t.Helper()
	if _, err := exec.LookPath("setpriv"); err != nil && os.Geteuid() == 0 {
		t.Fatalf("setpriv (util-linux) is needed to drop to uid %s: %v", sandboxUID, err)
	}
	dir, err := os.MkdirTemp("", "stopgate-sandbox-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	k := &sandboxKit{dir: dir, binary: filepath.Join(dir, "stopgate"), clients: filepath.Join(dir, "clients")}
	if out, err := exec.Command("cp", binary, k.binary).CombinedOutput(); err != nil {
		t.Fatalf("copy stopgate: %v %s", err, out)
	}
	if _, err := os.Stat(filepath.Join(sandboxClients, "node_modules", "openai")); err != nil {
		t.Fatalf("the openai SDK is not installed in %s (make test-deps runs npm ci there): %v", sandboxClients, err)
	}
	if out, err := exec.Command("cp", "-r", sandboxClients, k.clients).CombinedOutput(); err != nil {
		t.Fatalf("copy the clients: %v %s", err, out)
	}
	build := exec.Command("go", "build", "-o", filepath.Join(k.clients, "goclient"), "./testdata/goclient")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the Go client: %v %s", err, out)
	}
	if out, err := exec.Command("chmod", "-R", "a+rX", dir).CombinedOutput(); err != nil {
		t.Fatalf("chmod: %v %s", err, out)
	}
	return k
}

const sandboxClients = "testdata/sandbox-clients"

// exec is `stopgate exec` as the unprivileged user, holding only token.
func (k *sandboxKit) exec(s *server, token string, args ...string) *exec.Cmd {
	argv := append([]string{k.binary, "exec"}, args...)
	if os.Geteuid() == 0 {
		argv = append([]string{"setpriv", "--reuid", sandboxUID, "--regid", sandboxUID, "--clear-groups"}, argv...)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir = k.clients
	cmd.Env = append(testkit.CleanEnv(), "STOPGATE_CONTROL="+s.control, "STOPGATE_CONTROL_TOKEN="+token, "STOPGATE_PROXY="+s.proxyAddr(), "HOME="+k.dir)
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// skipWithoutUserNamespaces skips where the kernel makes no user namespace
// for an ordinary user, saying why (exec's own refusal says the same).
func skipWithoutUserNamespaces(t *testing.T, k *sandboxKit) {
	t.Helper()
	argv := []string{"unshare", "-U", "-n", "true"}
	if os.Geteuid() == 0 {
		argv = append([]string{"setpriv", "--reuid", sandboxUID, "--regid", sandboxUID, "--clear-groups"}, argv...)
	}
	if out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput(); err != nil {
		t.Skipf("an unprivileged user cannot make user and network namespaces here (%v: %s); exec refuses with its ways out (--no-isolate, --isolate --uid)", err, out)
	}
}

// llmUpstream is an OpenAI-compatible provider on loopback that counts
// every request it gets, and when, and streams slowly when asked to.
type llmUpstream struct {
	*httptest.Server
	mu     sync.Mutex
	starts []time.Time
	paths  []string
	chunks atomic.Int64
	// lastChunk is when the last streamed chunk was written.
	lastChunk atomic.Int64
}

func newLLMUpstream(t *testing.T) *llmUpstream {
	u := &llmUpstream{}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.mu.Lock()
		u.starts = append(u.starts, time.Now())
		u.paths = append(u.paths, r.URL.Path)
		u.mu.Unlock()
		body, _ := io.ReadAll(r.Body)
		if r.URL.Path != "/v1/chat/completions" {
			fmt.Fprintln(w, "done")
			return
		}
		if !bytes.Contains(body, []byte(`"stream":true`)) {
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprint(w, `{"id":"c1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}]}`)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 150 {
			if _, err := fmt.Fprintf(w, "data: {\"id\":\"c2\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"%d\"}}]}\n\n", i); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			u.chunks.Add(1)
			u.lastChunk.Store(time.Now().UnixNano())
			select {
			case <-r.Context().Done():
				return
			case <-time.After(200 * time.Millisecond):
			}
		}
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	t.Cleanup(u.Close)
	return u
}

// since lists the paths of the requests that arrived at or after at.
func (u *llmUpstream) since(at time.Time) []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	var out []string
	for i, s := range u.starts {
		if !s.Before(at) {
			out = append(out, u.paths[i])
		}
	}
	return out
}

// lines collects a command's output, line by line, for a bounded wait.
type lines struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *lines) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(b)
}

func (l *lines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func (l *lines) waitFor(t *testing.T, what string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !strings.Contains(l.String(), what) {
		if time.Now().After(deadline) {
			t.Fatalf("no %q within %s; output so far:\n%s", what, within, l.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// driver is the agent the sandbox tests run: every client once while the
// run is ACTIVE (and a streamed completion in the background), then, once
// exec writes the cancel into STOPGATE_CANCEL_FILE, every client again.
const driver = `set -u
phase() {
  node fetch.mjs "$UP/fetch-$1"
  node openai.mjs "$UP" plain
  ./goclient "$UP/go-$1"
  curl -sS --noproxy '*' -o /dev/null -w "curl %{http_code}\n" -X POST -d '{}' "$UP/curl-$1" || echo "curl error"
  python3 raw.py 127.0.0.1 "$PORT" "/raw-$1"
}
LOG=$(mktemp)
node openai.mjs "$UP" stream > "$LOG" 2>&1 &
STREAM=$!
phase active
echo "phase active done"
while [ ! -e "$STOPGATE_CANCEL_FILE" ]; do sleep 0.1; done
echo "cancel file: $(cat "$STOPGATE_CANCEL_FILE")"
phase cancelled
echo "phase cancelled done"
wait $STREAM
cat "$LOG"
`

// TestSandboxGuardsEveryClientWithoutRoot: an ordinary user holding only
// its run's token runs, through a plain serve, the clients that go around
// proxy variables (Node's fetch, the openai SDK plain and streamed, Go's
// net/http to loopback, curl --noproxy '*', a raw socket): each is guarded
// while the run is ACTIVE, refused after the cancel, and the provider sees
// nothing after the cancel but the end of the stream that was open.
func TestSandboxGuardsEveryClientWithoutRoot(t *testing.T) {
	k := newSandboxKit(t)
	skipWithoutUserNamespaces(t, k)
	up := newLLMUpstream(t)
	_, port, _ := net.SplitHostPort(up.Listener.Addr().String())
	// The fake provider is an inference API, as the shipped policy lists
	// the real ones: its stream is cut at the cancel.
	policy := filepath.Join(t.TempDir(), "stopgate.yaml")
	if err := os.WriteFile(policy, []byte("effects:\n  127.0.0.1:"+port+": none\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	s := startServe(t, "--data-dir", t.TempDir(), "--config", policy)
	s.must(t, 0, "admit", "sandboxed")
	token := strings.TrimSpace(s.must(t, 0, "token", "sandboxed"))

	var out lines
	cmd := k.exec(s, token, "--run", "sandboxed", "--cancel-signal", "none", "--", "sh", "-c", driver)
	cmd.Env = append(cmd.Env, "UP="+up.URL, "PORT="+port)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	out.waitFor(t, "phase active done", 90*time.Second)
	// The stream has begun.
	deadline := time.Now().Add(20 * time.Second)
	for up.chunks.Load() < 3 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	active := out.String()
	for _, want := range []string{"fetch 200", "openai 200 hello", "go 200", "curl 200", "raw 200"} {
		if !strings.Contains(active, want) {
			t.Errorf("while ACTIVE, no %q:\n%s", want, active)
		}
	}
	doc := s.audit(t, "sandboxed")
	for _, target := range []string{"/fetch-active", "/go-active", "/curl-active", "/raw-active", "/v1/chat/completions"} {
		found := false
		for _, in := range doc.Intents {
			found = found || strings.HasSuffix(in.Target, target)
		}
		if !found {
			t.Errorf("no intent for %s in the audit: %+v", target, doc.Intents)
		}
	}

	cancelled := time.Now()
	s.must(t, 0, "cancel", "sandboxed", "--drain", "3s", "--reason", "sandbox test")
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("exec: %v\n%s", err, out.String())
		}
	case <-time.After(90 * time.Second):
		_ = cmd.Process.Kill()
		t.Fatalf("exec did not end:\n%s", out.String())
	}
	all := out.String()
	t.Logf("exec's output:\n%s", all)
	after := all[strings.Index(all, "phase active done"):]
	for _, want := range []string{"cancel file: {", `"status":"CANCELL`, "fetch 409 run_not_active", "openai error 409", "go 409 run_not_active", "curl 409", "raw 409", "phase cancelled done"} {
		if !strings.Contains(after, want) {
			t.Errorf("after the cancel, no %q", want)
		}
	}
	if strings.Contains(after, "ended cleanly") {
		t.Errorf("the stream open at the cancel ended cleanly: it was not cut")
	}
	// The provider's own count: nothing new after the cancel; the stream's
	// last chunk no later than the drain deadline.
	if got := up.since(cancelled); len(got) != 0 {
		t.Errorf("the provider got %d requests after the cancel: %v", len(got), got)
	}
	last := time.Unix(0, up.lastChunk.Load())
	t.Logf("stream: %d chunks, the last %.2fs after the cancel (drain 3s)", up.chunks.Load(), last.Sub(cancelled).Seconds())
	if last.Sub(cancelled) > 4500*time.Millisecond {
		t.Errorf("the stream went on %.1fs past the cancel, past its drain deadline", last.Sub(cancelled).Seconds())
	}
	doc = s.audit(t, "sandboxed")
	refused := 0
	for _, in := range doc.Intents {
		if in.State == state.IntentCancelledBeforeDispatch {
			refused++
		}
	}
	if refused < 5 {
		t.Errorf("%d intents refused after the cancel, want one per client (5): %+v", refused, doc.Intents)
	}
}

// execResult is one exec as the test saw it end.
type execResult struct {
	code  int
	ended time.Time
	out   string
}

func startSandboxExec(t *testing.T, cmd *exec.Cmd) (*lines, chan execResult) {
	t.Helper()
	var out lines
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ch := make(chan execResult, 1)
	go func() {
		err := cmd.Wait()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			code = -1
		}
		ch <- execResult{code: code, ended: time.Now(), out: out.String()}
	}()
	return &out, ch
}

func awaitSandboxExec(t *testing.T, ch chan execResult, within time.Duration) execResult {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(within):
		t.Fatalf("exec did not end within %s", within)
	}
	return execResult{}
}

// TestSandboxTellsTheProcessOfTheCancel: at the cancel exec sends SIGTERM
// to every process of CMD, and a process that traps it exits then; one
// that ignores it is killed, with everything it started, at the drain
// deadline. Two execs of two runs at once, each its own sandbox.
func TestSandboxTellsTheProcessOfTheCancel(t *testing.T) {
	k := newSandboxKit(t)
	skipWithoutUserNamespaces(t, k)
	s := startServe(t, "--data-dir", t.TempDir())
	for _, run := range []string{"traps", "ignores"} {
		s.must(t, 0, "admit", run)
	}
	trapsOut, traps := startSandboxExec(t, k.exec(s, strings.TrimSpace(s.must(t, 0, "token", "traps")), "--run", "traps", "--",
		"sh", "-c", `trap 'echo "got TERM"; exit 3' TERM; echo ready; while :; do sleep 0.1; done`))
	// The child's command line is this test's own: another run of the
	// suite on this machine runs the same test as the same uid.
	child := fmt.Sprintf("sleep %d", 300_000+rand.IntN(600_000))
	ignoresOut, ignores := startSandboxExec(t, k.exec(s, strings.TrimSpace(s.must(t, 0, "token", "ignores")), "--run", "ignores", "--",
		"sh", "-c", `trap '' TERM; `+child+` & echo ready; while :; do sleep 0.1; done`))
	trapsOut.waitFor(t, "ready", 30*time.Second)
	ignoresOut.waitFor(t, "ready", 30*time.Second)

	const drain = 3 * time.Second
	cancelled := map[string]time.Time{}
	for _, run := range []string{"traps", "ignores"} {
		cancelled[run] = time.Now()
		s.must(t, 0, "cancel", run, "--drain", drain.String())
	}
	tr := awaitSandboxExec(t, traps, 30*time.Second)
	ir := awaitSandboxExec(t, ignores, 30*time.Second)
	trapAfter, killAfter := tr.ended.Sub(cancelled["traps"]), ir.ended.Sub(cancelled["ignores"])
	t.Logf("trapping process: exit %d, %.2fs after the cancel; ignoring process: exit %d, %.2fs after the cancel (drain %s)", tr.code, trapAfter.Seconds(), ir.code, killAfter.Seconds(), drain)
	if tr.code != 3 || !strings.Contains(tr.out, "got TERM") || trapAfter > 2*time.Second {
		t.Errorf("the trapping process: exit %d after %s:\n%s", tr.code, trapAfter, tr.out)
	}
	if ir.code != 137 || killAfter < drain-500*time.Millisecond || killAfter > drain+2*time.Second {
		t.Errorf("the ignoring process: exit %d after %s, want 137 at the drain deadline:\n%s", ir.code, killAfter, ir.out)
	}
	if out, _ := exec.Command("pgrep", "-u", sandboxUID, "-x", "-f", child).Output(); len(bytes.TrimSpace(out)) > 0 && os.Geteuid() == 0 {
		t.Errorf("the ignoring process's child outlived its sandbox: pid %s", out)
	}
	for run, want := range map[string][]string{"traps": {"exec.signal", "exec.exited"}, "ignores": {"exec.signal", "exec.killed", "exec.exited"}} {
		got := map[string]string{}
		for _, e := range s.audit(t, run).Events {
			if e.Actor == "worker:"+run && strings.HasPrefix(e.Kind, "exec.") {
				got[e.Kind] = e.Reason
			}
		}
		for _, kind := range want {
			if got[kind] == "" {
				t.Errorf("run %s: no %s event by worker:%s in the audit: %v", run, kind, run, got)
			}
		}
		if !strings.Contains(got["exec.signal"], "SIGTERM") {
			t.Errorf("run %s: exec.signal says %q", run, got["exec.signal"])
		}
		t.Logf("run %s: %v", run, got)
	}
}

// fakeResolver answers A queries for agent.test with 127.0.0.1 and counts
// every datagram it gets.
func fakeResolver(t *testing.T) (addr string, got func() []string) {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	var mu sync.Mutex
	var seen []string
	go func() {
		buf := make([]byte, 65535)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			var p dnsmessage.Parser
			h, err := p.Start(buf[:n])
			q, qerr := p.Question()
			mu.Lock()
			if err != nil || qerr != nil {
				seen = append(seen, fmt.Sprintf("garbage %d bytes", n))
				mu.Unlock()
				continue
			}
			seen = append(seen, q.Type.String()+" "+q.Name.String())
			mu.Unlock()
			b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true})
			_ = b.StartQuestions()
			_ = b.Question(q)
			_ = b.StartAnswers()
			if q.Type == dnsmessage.TypeA && strings.EqualFold(q.Name.String(), "agent.test.") {
				_ = b.AResource(dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 60}, dnsmessage.AResource{A: [4]byte{127, 0, 0, 1}})
			}
			msg, _ := b.Finish()
			_, _ = pc.WriteTo(msg, from)
		}
	}()
	return pc.LocalAddr().String(), func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), seen...)
	}
}

// udpProbe, run in the sandbox: a name resolved through the resolver
// exec names; a datagram to the nameserver that is not DNS; UDP to port 53
// of another address, and to a port of the sandbox's own loopback, each
// with a listener of its own in the sandbox that must hear nothing.
const udpProbe = `
import socket
print("resolved", socket.gethostbyname("agent.test"))
ns = [l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")][0]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.sendto(b"x" * 1024, (ns, 53))
for dest in [("127.0.0.1", 9999), ("127.0.0.2", 5353)]:
    ln = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    ln.bind(dest)
    ln.settimeout(0.5)
    try:
        s.sendto(b"y" * 1024, dest)
        print("sent to", dest)
    except OSError as e:
        print("refused", dest, e.__class__.__name__)
    try:
        ln.recvfrom(2048)
        print("ARRIVED", dest)
    except socket.timeout:
        print("dropped", dest)
`

// TestSandboxDNSOnlyToTheResolverNamed: DNS is carried to the resolver
// exec names and nowhere else; nothing else leaves over UDP, not even to
// the sandbox's own loopback, and what reaches the resolver is DNS.
func TestSandboxDNSOnlyToTheResolverNamed(t *testing.T) {
	k := newSandboxKit(t)
	skipWithoutUserNamespaces(t, k)
	s := startServe(t, "--data-dir", t.TempDir())
	resolver, got := fakeResolver(t)
	s.must(t, 0, "admit", "dns")
	out, ch := startSandboxExec(t, k.exec(s, strings.TrimSpace(s.must(t, 0, "token", "dns")), "--run", "dns", "--dns", resolver, "--", "python3", "-c", udpProbe))
	r := awaitSandboxExec(t, ch, 60*time.Second)
	t.Logf("exec (exit %d):\n%s\nresolver got: %v", r.code, out.String(), got())
	if r.code != 0 || !strings.Contains(r.out, "resolved 127.0.0.1") {
		t.Fatalf("the name did not resolve through the resolver named")
	}
	if strings.Contains(r.out, "ARRIVED") || !strings.Contains(r.out, "dropped ('127.0.0.1', 9999)") || !strings.Contains(r.out, "dropped ('127.0.0.2', 5353)") {
		t.Errorf("UDP other than DNS got through in the sandbox")
	}
	for _, q := range got() {
		if !strings.HasSuffix(q, " agent.test.") {
			t.Errorf("the resolver got %q: only queries may reach it", q)
		}
	}
}

// TestExecRefusesARunNeverAdmitted: a mistyped run id is not a new run.
func TestExecRefusesARunNeverAdmitted(t *testing.T) {
	s := startServe(t, "--data-dir", t.TempDir())
	if msg := s.must(t, 1, "exec", "--run", "agent-run-4", "--", "true"); !strings.Contains(msg, "never admitted") || !strings.Contains(msg, "--admit") {
		t.Errorf("exec of a run never seen: %q", msg)
	}
	if code, _, errOut := s.stopgate(t, "status", "agent-run-4"); code != 1 {
		t.Errorf("the refused exec created the run: status exit %d %s", code, errOut)
	}
	if code, _, errOut := s.stopgate(t, "exec", "--run", "agent-run-4", "--admit", "--no-isolate", "--", "true"); code != 0 {
		t.Fatalf("exec --admit: exit %d: %s", code, errOut)
	}
	var row state.Run
	if err := json.Unmarshal([]byte(s.must(t, 0, "status", "agent-run-4", "--json")), &row); err != nil || row.Status != state.StatusActive {
		t.Errorf("after exec --admit: %+v %v", row, err)
	}
}

// TestExecAdmitsWithTheBudgetGiven: exec --admit takes admit's budget flags
// and labels for the run it admits; a run admitted before keeps its budget
// and stderr says so; budget flags without --admit are a usage error, not
// a budget silently dropped.
func TestExecAdmitsWithTheBudgetGiven(t *testing.T) {
	s := startServe(t, "--data-dir", t.TempDir())
	budgetOf := func(run string) state.Budget {
		t.Helper()
		var row state.Run
		if err := json.Unmarshal([]byte(s.must(t, 0, "status", run, "--json")), &row); err != nil {
			t.Fatal(err)
		}
		return row.Budget
	}
	s.must(t, 0, "exec", "--run", "budgeted", "--admit", "--max-effects", "2", "--max-wall-time", "1h", "--no-isolate", "--", "true")
	if b := budgetOf("budgeted"); b.MaxEffects != 2 || b.MaxWallTime != time.Hour {
		t.Errorf("the run exec admitted has budget %+v, want max_effects 2 and max_wall_time 1h", b)
	}
	if code, _, errOut := s.stopgate(t, "exec", "--run", "budgeted", "--admit", "--max-effects", "9", "--no-isolate", "--", "true"); code != 0 || !strings.Contains(errOut, "keeps the budget it was admitted with") {
		t.Errorf("exec --admit of a run admitted before: exit %d, stderr %q: want 0 and a note that its budget stays", code, errOut)
	}
	if b := budgetOf("budgeted"); b.MaxEffects != 2 {
		t.Errorf("a second exec --admit changed the budget to %+v", b)
	}
	if msg := s.must(t, 2, "exec", "--run", "other", "--max-effects", "2", "--no-isolate", "--", "true"); !strings.Contains(msg, "--admit") {
		t.Errorf("budget flags without --admit: %q", msg)
	}
	if code, _, _ := s.stopgate(t, "status", "other"); code != 1 {
		t.Errorf("the refused exec created the run: status exit %d", code)
	}
}
