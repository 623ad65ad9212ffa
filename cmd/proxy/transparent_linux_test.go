package main

import (
	"bufio"
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/netns"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/state"
)

// These tests run in a network namespace of their own (netns.Enter): the
// kernel redirects the connections of a test uid to stopgate for real, and
// the clients are real (node's global fetch, which ignores proxy variables,
// and curl told to ignore them).

// upstreamIP is where the tests' providers listen. Loopback destinations
// must be allowed for these tests; once serve refuses them by default, it
// is the one address to allow.
const upstreamIP = "127.0.0.1"

// Test uids, drawn for this process, four in a row: nothing else on the
// machine runs as them, not even another run of this suite beside this one
// (which a fixed uid would meet: exec --isolate refuses a uid that runs
// processes, and kills what is left of its own uid when CMD ends).
var uidExec, uidExecA, uidExecB, uidHand = testUIDs()

func testUIDs() (exec, execA, execB, hand uint32) {
	base := 100_000 + uint32(mrand.IntN(1_000_000))*4
	return base, base + 1, base + 2, base + 3
}

// nodeFetch prints "node STATUS BODY" for the URL in argv[1]: Node's global
// fetch, which reads no proxy variable.
const nodeFetch = `fetch(process.argv[1], {method: "POST", body: "{}"}).then(async r => console.log("node", r.status, (await r.text()).trim().slice(0, 60))).catch(e => console.log("node error", (e.cause && e.cause.code) || e.message))`

// httpsUpstream is an HTTPS provider for upstream.test and localhost, under
// a CA of its own written to caFile (which serve is told to trust).
func httpsUpstream(t *testing.T, dir string) (srv *httptest.Server, hits *atomic.Int64, caFile string) {
	t.Helper()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "upstream test CA"}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, _ := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	caCert, _ := x509.ParseCertificate(caDER)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	leaf := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "upstream.test"}, DNSNames: []string{"upstream.test", "localhost"}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	leafDER, err := x509.CreateCertificate(rand.Reader, leaf, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caFile = filepath.Join(dir, "upstream-ca.pem")
	if err := os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o644); err != nil {
		t.Fatal(err)
	}
	hits = new(atomic.Int64)
	srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		fmt.Fprintln(w, "done")
	}))
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{leafDER}, PrivateKey: key}}}
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv, hits, caFile
}

// asUID runs a command as uid (bounded), returning its output and exit code.
func asUID(t *testing.T, uid uint32, name string, args ...string) (string, int) {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid, Groups: []uint32{}}}
	cmd.Env = testkit.CleanEnv()
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatalf("%s as uid %d: %v", name, uid, err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	var err error
	select {
	case err = <-done:
	case <-time.After(60 * time.Second):
		_ = cmd.Process.Kill()
		err = <-done
		t.Errorf("%s as uid %d did not end within 60s", name, uid)
	}
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	}
	return strings.TrimSpace(out.String()), code
}

// background is a stopgate exec left running: its output by lines.
type background struct {
	cmd   *exec.Cmd
	lines chan string
	done  chan error
}

func startExec(t *testing.T, s *server, args ...string) *background {
	t.Helper()
	cmd := exec.Command(binary, args...)
	cmd.Env = append(testkit.CleanEnv(), "STOPGATE_CONTROL="+s.control, "STOPGATE_DATA_DIR="+s.dataDir)
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	b := &background{cmd: cmd, lines: make(chan string, 64), done: make(chan error, 1)}
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			b.lines <- sc.Text()
		}
		close(b.lines)
	}()
	go func() { err := cmd.Wait(); pw.Close(); b.done <- err }()
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	return b
}

// until reads lines until one is want (bounded), returning those read.
func (b *background) until(t *testing.T, want string) []string {
	t.Helper()
	var got []string
	deadline := time.After(60 * time.Second)
	for {
		select {
		case line, ok := <-b.lines:
			if !ok {
				t.Fatalf("output ended before %q:\n%s", want, strings.Join(got, "\n"))
			}
			t.Logf("exec| %s", line)
			got = append(got, line)
			if line == want {
				return got
			}
		case <-deadline:
			t.Fatalf("no %q within 60s:\n%s", want, strings.Join(got, "\n"))
		}
	}
}

// rest reads every remaining line and the exit code (bounded).
func (b *background) rest(t *testing.T) ([]string, int) {
	t.Helper()
	var got []string
	for line := range b.lines {
		t.Logf("exec| %s", line)
		got = append(got, line)
	}
	select {
	case err := <-b.done:
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		}
		return got, code
	case <-time.After(60 * time.Second):
		t.Fatal("stopgate exec did not exit within 60s")
		return nil, 0
	}
}

// gatedScript makes requests, says "ready", waits (bounded) for gate to
// exist, then makes the same requests again.
func gatedScript(gate, target string) string {
	node := fmt.Sprintf("node -e '%s' %s/node", nodeFetch, target)
	curl := fmt.Sprintf(`curl --noproxy '*' -sS -X POST -o /dev/null -w 'curl %%{http_code}\n' %s/curl`, target)
	return fmt.Sprintf(`%s; %s; echo ready; i=0; while [ ! -e %s ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; %s; %s`, node, curl, gate, node, curl)
}

func noRedirectLeft(t *testing.T) {
	t.Helper()
	for _, bin := range []string{"iptables-save", "ip6tables-save"} {
		out, err := exec.Command(bin).CombinedOutput()
		if err != nil {
			t.Fatalf("%s: %v %s", bin, err, out)
		}
		if strings.Contains(string(out), "STOPGATE") {
			t.Errorf("%s still has stopgate rules:\n%s", bin, out)
		}
	}
}

func targets(doc auditDoc) map[string]state.IntentState {
	m := map[string]state.IntentState{}
	for _, in := range doc.Intents {
		m[in.Target] = in.State
	}
	return m
}

// TestExecIsolateGuardsNodeFetchAndCurl: node's global fetch and curl
// --noproxy '*', run by stopgate exec --isolate, reach the upstream while
// the run is ACTIVE and are in its audit; after stopgate cancel, the same
// process's next requests are refused and the upstream sees nothing more.
func TestExecIsolateGuardsNodeFetchAndCurl(t *testing.T) {
	if !netns.Enter(t) {
		return
	}
	testkit.NeedTools(t, "node", "curl", "iptables", "ip6tables")
	up, hits := upstreamCounter(t)
	target := "http://" + hostOf(up.URL)
	if !strings.HasPrefix(hostOf(up.URL), upstreamIP+":") {
		t.Fatalf("upstream at %s, want %s", up.URL, upstreamIP)
	}
	s := startServe(t, "--data-dir", t.TempDir(), "--transparent-addr", anyPort)
	s.must(t, 0, "admit", "iso")
	dir := testkit.SharedDir(t)
	gate := filepath.Join(dir, "go")

	// The signal at the cancel is another test's: this one looks at what the
	// process's next requests meet.
	b := startExec(t, s, "exec", "--run", "iso", "--isolate", "--uid", fmt.Sprint(uidExec), "--cancel-signal", "none", "--", "sh", "-c", gatedScript(gate, target))
	before := b.until(t, "ready")
	if !slices.Contains(before, "node 200 done") || !slices.Contains(before, "curl 200") || hits.Load() != 2 {
		t.Fatalf("while ACTIVE: %q, upstream saw %d", before, hits.Load())
	}
	doc := s.audit(t, "iso")
	if got := targets(doc); got[target+"/node"] != state.IntentResponded || got[target+"/curl"] != state.IntentResponded {
		t.Fatalf("audit while ACTIVE: %v", got)
	}

	s.must(t, 0, "cancel", "iso", "--reason", "operator pressed stop")
	if err := os.WriteFile(gate, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	after, code := b.rest(t)
	if code != 0 {
		t.Fatalf("stopgate exec exited %d, want the script's 0: %q", code, after)
	}
	if !containsPrefix(after, "node 409") || !slices.Contains(after, "curl 409") {
		t.Fatalf("after the cancel: %q", after)
	}
	if hits.Load() != 2 {
		t.Fatalf("upstream saw %d requests, want 2: nothing after the cancel", hits.Load())
	}
	refused := 0
	for _, in := range s.audit(t, "iso").Intents {
		if in.State == state.IntentCancelledBeforeDispatch {
			refused++
		}
	}
	if refused != 2 {
		t.Fatalf("audit after the cancel: %d refusals recorded, want 2", refused)
	}
	noRedirectLeft(t)
}

// TestExecIsolateTwoRunsAtOnce: two isolated commands of different runs,
// running at the same time, each have their effects under their own run.
func TestExecIsolateTwoRunsAtOnce(t *testing.T) {
	if !netns.Enter(t) {
		return
	}
	testkit.NeedTools(t, "curl", "iptables", "ip6tables")
	up, hits := upstreamCounter(t)
	target := "http://" + hostOf(up.URL)
	s := startServe(t, "--data-dir", t.TempDir(), "--transparent-addr", anyPort)
	gate := filepath.Join(testkit.SharedDir(t), "go")
	script := func(run string) string {
		req := fmt.Sprintf(`curl --noproxy '*' -sS -o /dev/null -w '%s %%{http_code}\n' %s/%s`, run, target, run)
		return fmt.Sprintf(`%s; echo ready; i=0; while [ ! -e %s ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; %s`, req, gate, req)
	}
	for _, run := range []string{"run-a", "run-b", "run-c"} {
		s.must(t, 0, "admit", run)
	}
	a := startExec(t, s, "exec", "--run", "run-a", "--isolate", "--uid", fmt.Sprint(uidExecA), "--", "sh", "-c", script("run-a"))
	bb := startExec(t, s, "exec", "--run", "run-b", "--isolate", "--uid", fmt.Sprint(uidExecB), "--", "sh", "-c", script("run-b"))
	a.until(t, "ready")
	bb.until(t, "ready")
	// Both are running now: a third on a uid in use is refused.
	if msg := s.must(t, 1, "exec", "--run", "run-c", "--isolate", "--uid", fmt.Sprint(uidExecA), "--", "true"); !strings.Contains(msg, "already runs processes") {
		t.Errorf("a uid in use: %q", msg)
	}
	if err := os.WriteFile(gate, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, b := range []*background{a, bb} {
		if out, code := b.rest(t); code != 0 {
			t.Fatalf("exit %d: %q", code, out)
		}
	}
	for _, run := range []string{"run-a", "run-b"} {
		doc := s.audit(t, run)
		// exec's own record of the start, then the two requests.
		if len(doc.Intents) != 3 || doc.Intents[0].Method != "EXEC" {
			t.Fatalf("%s has %d intents, want exec's and 2: %+v", run, len(doc.Intents), doc.Intents)
		}
		for _, in := range doc.Intents[1:] {
			if in.Target != target+"/"+run || in.State != state.IntentResponded {
				t.Fatalf("%s recorded %s %s", run, in.Target, in.State)
			}
		}
	}
	if hits.Load() != 4 {
		t.Fatalf("upstream saw %d, want 4", hits.Load())
	}
	noRedirectLeft(t)
}

// TestTransparentByHand: serve --transparent-addr bound to a run with --run,
// and stopgate redirect install --uid; the uid's node fetch, plain curl,
// HTTPS by SNI (intercepted), a pass-through host, IPv6, and a protocol that
// is neither HTTP nor TLS, before and after the cancel.
func TestTransparentByHand(t *testing.T) {
	if !netns.Enter(t) {
		return
	}
	testkit.NeedTools(t, "node", "curl", "iptables", "ip6tables")
	dir := testkit.SharedDir(t)
	up, hits := upstreamCounter(t)
	target := "http://" + hostOf(up.URL)
	tlsUp, tlsHits, upstreamCA := httpsUpstream(t, dir)
	_, tlsPort, _ := net.SplitHostPort(hostOf(tlsUp.URL))
	ln6, err := net.Listen("tcp6", "[::1]:0")
	if err != nil {
		t.Fatal(err)
	}
	var v6hits atomic.Int64
	v6 := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { v6hits.Add(1); fmt.Fprintln(w, "done") })}
	go v6.Serve(ln6)
	t.Cleanup(func() { v6.Close() })

	policy := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(policy, []byte("pass_through: [localhost]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// serve trusts the HTTPS provider as it would trust a public one.
	s := startServeEnv(t, []string{"SSL_CERT_FILE=" + upstreamCA}, "--data-dir", t.TempDir(), "--transparent-addr", anyPort, "--run", "hand", "--config", policy)
	s.must(t, 0, "admit", "hand")
	caFile := filepath.Join(dir, "stopgate-ca.pem")
	if err := os.WriteFile(caFile, []byte(s.must(t, 0, "ca")), 0o644); err != nil {
		t.Fatal(err)
	}
	out := s.must(t, 0, "redirect", "install", "--uid", fmt.Sprint(uidHand))
	if !strings.Contains(out, fmt.Sprintf("redirected uid %d", uidHand)) {
		t.Fatalf("redirect install: %q", out)
	}
	s.must(t, 0, "redirect", "install", "--uid", fmt.Sprint(uidHand)) // idempotent

	mitm := "https://upstream.test:" + tlsPort + "/hand-tls"
	pass := "https://localhost:" + tlsPort + "/hand-pass"
	v6URL := "http://" + ln6.Addr().String() + "/hand-v6"
	send := func() map[string]string {
		res := map[string]string{}
		res["node"], _ = asUID(t, uidHand, "node", "-e", nodeFetch, target+"/hand-node")
		res["curl"], _ = asUID(t, uidHand, "curl", "--noproxy", "*", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST", target+"/hand-curl")
		res["mitm"], _ = asUID(t, uidHand, "curl", "--noproxy", "*", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--cacert", caFile,
			"--resolve", "upstream.test:"+tlsPort+":"+upstreamIP, "-X", "POST", mitm)
		// The provider's own certificate verifies: nothing intercepted it.
		out, code := asUID(t, uidHand, "curl", "--noproxy", "*", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--cacert", upstreamCA, "-X", "POST", pass)
		res["pass"] = fmt.Sprintf("%s exit %d", out, code)
		res["v6"], _ = asUID(t, uidHand, "curl", "--noproxy", "*", "-g", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST", v6URL)
		return res
	}
	got := send()
	for k, want := range map[string]string{"node": "node 200 done", "curl": "200", "mitm": "200", "pass": "200 exit 0", "v6": "200"} {
		if got[k] != want {
			t.Errorf("while ACTIVE, %s: %q, want %q", k, got[k], want)
		}
	}
	// A protocol that is neither HTTP nor TLS is refused and recorded.
	raw := fmt.Sprintf(`const s=require("net").connect(%s,"%s",()=>s.write("SSH-2.0-test\r\n"));s.on("data",d=>console.log("answered",d.length));s.on("close",()=>console.log("closed"));s.on("error",e=>console.log("error",e.code))`, portOf(up.URL), upstreamIP)
	if out, _ := asUID(t, uidHand, "node", "-e", raw); out != "closed" {
		t.Errorf("a raw TCP client: %q, want closed", out)
	}
	if hits.Load() != 2 || tlsHits.Load() != 2 || v6hits.Load() != 1 {
		t.Fatalf("while ACTIVE the upstreams saw %d, %d (TLS), %d (IPv6); want 2, 2, 1", hits.Load(), tlsHits.Load(), v6hits.Load())
	}
	recorded := targets(s.audit(t, "hand"))
	for tg, want := range map[string]state.IntentState{
		target + "/hand-node": state.IntentResponded, target + "/hand-curl": state.IntentResponded,
		mitm: state.IntentResponded, "localhost:" + tlsPort: state.IntentResponded, v6URL: state.IntentResponded,
		"tcp://" + hostOf(up.URL): state.IntentCancelledBeforeDispatch,
	} {
		if recorded[tg] != want {
			t.Errorf("audit: %s is %q, want %s (all: %v)", tg, recorded[tg], want, recorded)
		}
	}

	s.must(t, 0, "cancel", "hand")
	got = send()
	for k, want := range map[string]string{"node": "node 409", "curl": "409", "mitm": "409", "v6": "409"} {
		if !strings.HasPrefix(got[k], want) {
			t.Errorf("after the cancel, %s: %q, want %q", k, got[k], want)
		}
	}
	if strings.HasSuffix(got["pass"], "exit 0") {
		t.Errorf("after the cancel, a pass-through tunnel opened: %q", got["pass"])
	}
	if hits.Load() != 2 || tlsHits.Load() != 2 || v6hits.Load() != 1 {
		t.Fatalf("after the cancel the upstreams saw %d, %d (TLS), %d (IPv6); want 2, 2, 1", hits.Load(), tlsHits.Load(), v6hits.Load())
	}

	s.must(t, 0, "redirect", "remove", "--uid", fmt.Sprint(uidHand))
	s.must(t, 0, "redirect", "remove", "--uid", fmt.Sprint(uidHand))
	noRedirectLeft(t)
}

func hostOf(u string) string {
	return strings.TrimPrefix(strings.TrimPrefix(u, "http://"), "https://")
}

func portOf(u string) string {
	_, p, _ := net.SplitHostPort(hostOf(u))
	return p
}

func containsPrefix(lines []string, prefix string) bool {
	for _, l := range lines {
		if strings.HasPrefix(l, prefix) {
			return true
		}
	}
	return false
}
