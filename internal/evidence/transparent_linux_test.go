package evidence_test

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stopgate/stopgate/internal/evidence"
	"github.com/stopgate/stopgate/internal/netns"
	"github.com/stopgate/stopgate/internal/testkit"
	"github.com/stopgate/stopgate/state"
)

// The transparent case runs in a network namespace of its own, where the
// kernel redirects a test uid's connections to stopgate for real (iptables
// REDIRECT, installed by `stopgate redirect install --uid`). netns.Enter
// needs a top-level test, so the case re-runs this test binary for
// TestTransparentInFlightInNamespace, which enters the namespace (netns
// re-runs it once more, inside), plays the rounds there and writes them to
// a file that the case reads back into the table.

// envRoundsFile names the file the namespace run writes its rounds to.
const envRoundsFile = "STOPGATE_EVIDENCE_ROUNDS_FILE"

// uidAgent is the redirected user; nothing else on the machine runs as it.
const uidAgent = 61050

func caseTransparentInFlight(t *testing.T, n int, out *[]evidence.Round) {
	file := filepath.Join(t.TempDir(), "rounds.json")
	ctx, cancel := context.WithTimeout(context.Background(), netns.Timeout+time.Minute)
	defer cancel()
	const name = "TestTransparentInFlightInNamespace"
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run", "^"+name+"$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), envRoundsFile+"="+file, "STOPGATE_EVIDENCE_RUNS="+strconv.Itoa(n))
	cmd.WaitDelay = 10 * time.Second
	output, err := cmd.CombinedOutput()
	rs, readErr := readRounds(file)
	*out = append(*out, rs...)
	if m := regexp.MustCompile(`(?m)^\s+\S+\.go:\d+: (.*)\n--- SKIP: ` + name + `\b`).FindSubmatch(output); m != nil {
		panic(skipCase(string(m[1])))
	}
	switch {
	case err != nil:
		t.Fatalf("the rounds in the network namespace: %v\n%s", err, output)
	case readErr != nil:
		t.Fatalf("the rounds in the network namespace: %v\n%s", readErr, output)
	case len(rs) != n:
		t.Fatalf("the network namespace ran %d rounds, want %d\n%s", len(rs), n, output)
	}
}

// TestTransparentInFlightInNamespace is the TransparentInFlight case of
// TestEvidence, in the network namespace; by itself it does nothing.
func TestTransparentInFlightInNamespace(t *testing.T) {
	file := os.Getenv(envRoundsFile)
	if file == "" {
		t.Skip("the TransparentInFlight case of TestEvidence runs this, in a network namespace of its own")
	}
	if !netns.Enter(t) {
		return
	}
	var rs []evidence.Round
	// Written however the rounds end, a fatal error included.
	defer writeRounds(t, file, &rs)
	transparentRounds(t, rounds(t), &rs)
}

// transparentRounds: A serves the run as its static run with a transparent
// listener, the uid is redirected to it; the uid holds a streamed GET open
// (plain HTTP, read by Host) and a pass-through TLS connection (a host
// stopgate does not intercept, guarded once for the connection); the cancel
// goes through B. Then the uid tries a POST and a new TLS connection.
func transparentRounds(t *testing.T, n int, out *[]evidence.Round) {
	testkit.NeedTools(t, "curl", "iptables", "ip6tables")
	dir := testkit.SharedDir(t)
	cert, caFile := localhostCert(t, dir)
	policy := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(policy, []byte("pass_through: [localhost]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	redis := startRedis(t, false)
	b := startOn(t, redis.URL())
	up := evidence.StartUpstream(t)
	tlsUp := evidence.StartUpstreamTLS(t, cert)
	_, tlsPort, _ := net.SplitHostPort(tlsUp.Addr())
	uid := strconv.Itoa(uidAgent)
	t.Cleanup(func() {
		if msg, err := b.CLI(context.Background(), "redirect", "remove", "--uid", uid); err != nil {
			t.Errorf("redirect remove: %q %v", msg, err)
		}
	})
	for i := range n {
		var r evidence.Round
		ctx := tctx(t)
		run, reason := fmt.Sprintf("transparent-%d", i), "stop while redirected connections are open"
		streamKey, passKey, afterKey := run+"-stream", run+"-pass", run+"-after"
		var log attempts
		admit(t, b, run)
		a := evidence.Start(t, binary, evidence.Config{Store: redis.URL(), Flags: flags("--transparent-addr", freeLoopback(t), "--run", run, "--config", policy)})
		if msg, err := a.CLI(ctx, "redirect", "install", "--uid", uid); err != nil || !strings.Contains(msg, "redirected uid "+uid) {
			t.Fatalf("redirect install: %q %v", msg, err)
		}

		// Neither client is told of any proxy: the kernel sends them to A.
		started := time.Now()
		stream := startAs(t, uidAgent, "curl", "--noproxy", "*", "-sS", "-N", "-H", "Idempotency-Key: "+streamKey, up.URL()+"/stream/"+run+"/"+streamKey)
		if err := stream.firstLine(15 * time.Second); err != nil {
			t.Fatalf("the redirected stream: %v\nserve log:\n%s", err, a.Log())
		}
		log.add(evidence.Attempt{Run: run, Key: streamKey, Started: started, Status: 200})
		pass := startAs(t, uidAgent, "curl", "--noproxy", "*", "-sS", "-N", "--cacert", caFile,
			"--resolve", "localhost:"+tlsPort+":127.0.0.1", "https://localhost:"+tlsPort+"/stream/"+run+"/"+passKey)
		if err := pass.firstLine(15 * time.Second); err != nil {
			t.Fatalf("the redirected pass-through TLS connection: %v\nserve log:\n%s", err, a.Log())
		}
		conns, tlsConns := up.Conns(), tlsUp.Conns()

		ack, _ := cancelRun(t, b, run, reason)
		streamCut, passCut := stream.cutWithin(10*time.Second), pass.cutWithin(10*time.Second)
		judgeCuts(&r, "a redirected connection of run "+run, cut{"the redirected stream", streamCut}, cut{"the redirected pass-through TLS connection", passCut})
		// A cut is an error for the client, never a clean end.
		expect(&r, streamCut < 0 || stream.exitCode() > 0, "curl ends the cut stream with an error, got exit %d", stream.exitCode())
		expect(&r, passCut < 0 || pass.exitCode() > 0, "curl ends the cut TLS connection with an error, got exit %d", pass.exitCode())

		// The same uid after the cancel: a POST, and a new TLS connection.
		postStarted := time.Now()
		msg, _ := runAs(t, uidAgent, "curl", "--noproxy", "*", "-sS", "-o", "-", "-w", "\n%{http_code} %header{x-stopgate-refusal}",
			"-X", "POST", "-H", "Idempotency-Key: "+afterKey, "-d", "amount=1", up.URL()+"/e/"+run+"/"+afterKey)
		after := curlAttempt(run, afterKey, postStarted, msg)
		log.add(after)
		expect(&r, after.Status == 409 && after.Code == state.RefusalRunNotActive, "the uid's POST after the cancel: 409 run_not_active, got %q", msg)
		msg, code := runAs(t, uidAgent, "curl", "--noproxy", "*", "-sS", "-o", "/dev/null", "--cacert", caFile,
			"--resolve", "localhost:"+tlsPort+":127.0.0.1", "https://localhost:"+tlsPort+"/e/"+run+"/"+run+"-pass-after")
		expect(&r, code != 0, "a new pass-through TLS connection after the cancel fails, got exit 0: %q", msg)
		time.Sleep(200 * time.Millisecond)
		expect(&r, up.Conns() == conns && tlsUp.Conns() == tlsConns, "no new connection reaches the providers after the cancel: %d → %d (HTTP), %d → %d (TLS)",
			conns, up.Conns(), tlsConns, tlsUp.Conns())
		expect(&r, tlsUp.Hits(passKey) == 1 && tlsUp.Hits(run+"-pass-after") == 0, "the TLS provider counted the pass-through stream %d time(s) and the later one %d, want 1 and 0",
			tlsUp.Hits(passKey), tlsUp.Hits(run+"-pass-after"))

		// A tunnel's requests are unseen: its effect is counted where it landed.
		final := reconcileBy(t, b, run, &r, func(in state.Intent) int {
			if in.Boundary == state.BoundaryTunnel {
				return tlsUp.Hits(passKey)
			}
			return up.Hits(in.Key)
		})
		expect(&r, final.Run.Status == state.StatusCancelled, "the run is CANCELLED once reconciled, got %s", final.Run.Status)
		var tunnels, refusedTunnels int
		for _, in := range final.Intents {
			switch {
			case in.Key == streamKey:
				// Its answer had begun: the effect is recorded, the cut is a note.
				expect(&r, in.State == state.IntentResponded, "the cut stream is RESPONDED (its answer had begun), got %s", in.State)
			case in.Boundary == state.BoundaryTunnel && in.Target == "localhost:"+tlsPort:
				tunnels++
				refusedTunnels += in.Refusals
				if in.State == state.IntentCancelledBeforeDispatch {
					refusedTunnels++
				}
			}
		}
		cutNoted := false
		for _, e := range final.Events {
			cutNoted = cutNoted || e.Kind == state.EventIntentCut && e.Intent == streamKey && e.Reason != ""
		}
		expect(&r, cutNoted, "the stream's cut is in the audit, with its reason")
		expect(&r, tunnels >= 1 && refusedTunnels >= 1, "the pass-through connections in the audit: %d tunnel intent(s), %d refusal(s); want the one cut and the later one refused", tunnels, refusedTunnels)
		judgeRun(&r, &log, up, run, ack, reason, final)
		*out = append(*out, r)
		a.Kill9()
	}
}

func readRounds(file string) ([]evidence.Round, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var rs []evidence.Round
	if err := json.Unmarshal(b, &rs); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	return rs, nil
}

func writeRounds(t *testing.T, file string, rs *[]evidence.Round) {
	b, err := json.Marshal(*rs)
	if err == nil {
		err = os.WriteFile(file, b, 0o600)
	}
	if err != nil {
		t.Errorf("writing the rounds to %s: %v", file, err)
	}
}

func freeLoopback(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// localhostCert is a certificate for localhost under a CA of its own, whose
// certificate it writes into dir for the clients to trust.
func localhostCert(t *testing.T, dir string) (tls.Certificate, string) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "evidence provider CA"}, NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	leaf := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "localhost"}, DNSNames: []string{"localhost"}, NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	leafDER, err := x509.CreateCertificate(rand.Reader, leaf, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caFile := filepath.Join(dir, "provider-ca.pem")
	if err := os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o644); err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{leafDER}, PrivateKey: key}, caFile
}

// asUser is a process running as a test uid, with its output by lines.
type asUser struct {
	*conn
	cmd   *exec.Cmd
	lines chan string
	code  int
}

// startAs starts name as uid, with no proxy in its environment; it is
// killed when the test ends. Its end (exit) closes the conn.
func startAs(t *testing.T, uid uint32, name string, args ...string) *asUser {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid, Groups: []uint32{}}}
	cmd.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/"}
	cmd.Dir = "/"
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("%s as uid %d: %v", name, uid, err)
	}
	p := &asUser{conn: &conn{ended: make(chan struct{})}, cmd: cmd, lines: make(chan string, 64)}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			select {
			case p.lines <- sc.Text():
			default: // a stream's later lines are not read
			}
		}
		err := cmd.Wait()
		if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
			p.code = ee.ExitCode()
		}
		if err == nil {
			err = errors.New("exit 0")
		}
		p.err.Store(fmt.Errorf("%w: %s", err, strings.TrimSpace(stderr.String())))
		close(p.lines)
		close(p.ended)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.ended
	})
	return p
}

// firstLine waits (bounded) for the process's first line of output.
func (p *asUser) firstLine(d time.Duration) error {
	select {
	case _, ok := <-p.lines:
		if !ok {
			<-p.ended
			return fmt.Errorf("ended before any output: %v", p.err.Load())
		}
		return nil
	case <-time.After(d):
		return fmt.Errorf("no output within %s", d)
	}
}

// exitCode is the process's exit code once it has ended (-1 for a signal).
func (p *asUser) exitCode() int {
	<-p.ended
	return p.code
}

// runAs runs name as uid to its end (bounded) and returns its output and
// exit code.
func runAs(t *testing.T, uid uint32, name string, args ...string) (string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid, Groups: []uint32{}}}
	cmd.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/"}
	cmd.Dir = "/"
	cmd.WaitDelay = time.Second
	out, err := cmd.CombinedOutput()
	code := 0
	if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("%s as uid %d: %v", name, uid, err)
	}
	return strings.TrimSpace(string(out)), code
}

// curlAttempt reads what curl printed for a request (the body, then a line
// "STATUS REFUSAL") as an Attempt.
func curlAttempt(run, key string, started time.Time, out string) evidence.Attempt {
	a := evidence.Attempt{Run: run, Key: key, Started: started, Ended: time.Now()}
	body, last := "", out
	if i := strings.LastIndexByte(out, '\n'); i >= 0 {
		body, last = out[:i], out[i+1:]
	}
	status, code, _ := strings.Cut(last, " ")
	a.Status, _ = strconv.Atoi(status)
	a.Code = strings.TrimSpace(code)
	if a.Status == 0 {
		a.Err = errors.New(out)
	}
	var b struct {
		Recorded string `json:"recorded"`
	}
	if json.Unmarshal([]byte(body), &b) == nil {
		a.Recorded = b.Recorded
	}
	return a
}
